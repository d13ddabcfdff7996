"""Batch invariance, disaggregated == reference, and lease checks on the engine path (I2, I4),
for tiny and for tiny with the served families' details (biases, rescaled RoPE, a sliding
window)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdmesh.kvstore import KVPool, LeaseAccessError, PoolSpec, ScrubPolicy
from pdmesh.services.engine.families import llama3_freq_factors
from pdmesh.services.engine.models import LoadedModel, load_model
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import DecodeSlot, Engine, make_pool
from pdmesh.services.engine.sampling import SamplingParams
from tests.support.engine import batched_generate, prompt

PARAMS = SamplingParams(max_tokens=8)
WINDOW = 48  # the sliding window of "tiny-families": prompts of 100..700 reach past it
# Mixed lengths, including ones that cross page (16) and prefill-chunk (512) boundaries.
LENGTHS = [37, 1, 15, 16, 17, 100, 513, 64, 250, 3, 700, 31, 48, 9, 129, 300]


@pytest.fixture(scope="module", params=["tiny", "tiny-families"])
def tiny(request) -> LoadedModel:
    """Every test here runs on `tiny`, and on tiny with each served family's detail: q/k/v
    biases (Qwen2), Llama 3.1's RoPE rescaling and a sliding window (Mistral), which both
    decode paths and prefill must keep batch-invariant too."""
    model = load_model("tiny")
    if request.param == "tiny":
        return model
    config = dataclasses.replace(
        model.config, rope_theta=500000.0, sliding_window=WINDOW,
        rope_freq_factors=llama3_freq_factors(model.config.head_dim, 500000.0, 8.0, 1.0, 4.0,
                                              64))
    gen = torch.Generator().manual_seed(7)
    for layer in model.weights.layers:
        layer.bq, layer.bk, layer.bv = (torch.randn(t.shape[0], generator=gen) * 0.5
                                        for t in (layer.wq, layer.wk, layer.wv))
    return LoadedModel(config, model.weights, model.tokenizer, request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [prompt(seed, length) for seed, length in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def _expected_by_path() -> dict[tuple[str, str], list[list[int]]]:
    return {}


@pytest.fixture
def expected_here(tiny, prompts, attention_path, _expected_by_path) -> list[list[int]]:
    """The reference's tokens on the decode attention path this test runs."""
    key = (tiny.name, attention_path)
    if key not in _expected_by_path:
        ref = ReferenceEngine(tiny)
        _expected_by_path[key] = [ref.generate(p, PARAMS) for p in prompts]
    return _expected_by_path[key]


def test_outputs_depend_on_the_prompt(expected_here) -> None:
    # Otherwise equality below would prove nothing.
    assert len({tuple(e) for e in expected_here}) == len(expected_here)


def test_alone_equals_batched_with_15_others(tiny, prompts, expected_here) -> None:
    pool = make_pool(tiny, num_pages=400, page_tokens=16)
    engine = Engine(tiny, pool)
    alone = batched_generate(engine, prompts[:1], PARAMS)[0]
    together = batched_generate(engine, prompts, PARAMS)
    assert alone == together[0] == expected_here[0]
    assert together == expected_here
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages  # nothing leaked


def test_disaggregated_equals_reference(tiny, prompts, expected_here) -> None:
    """Prefill on pool A, copy prompt pages byte for byte into pool B, decode there."""
    prefill_pool = make_pool(tiny, num_pages=200, page_tokens=16, scrub=ScrubPolicy.POISON)
    decode_pool = make_pool(tiny, num_pages=400, page_tokens=16, scrub=ScrubPolicy.POISON)
    prefill, decode = Engine(tiny, prefill_pool), Engine(tiny, decode_pool)
    # Earlier tenants leave junk in decode's pages, and shift its page numbering.
    junk = [decode_pool.allocate("junk", 97)]
    decode_pool.tensor.normal_()
    leases, first_tokens = [], []
    for i, p in enumerate(prompts):
        src = prefill_pool.allocate(f"p{i}", len(p))
        first_tokens.append(int(torch.argmax(prefill.prefill(src, p))))
        dst = decode_pool.allocate(f"d{i}", len(p) + PARAMS.max_tokens)
        assert dst.page_ids != src.page_ids or i == 0
        for index in range(src.num_pages):
            decode_pool.page_buffer(dst, index)[:] = prefill_pool.page_buffer(src, index)
            decode_pool.mark_written(dst, index, src.page_written[index])
        prefill_pool.release(src, "transferred")
        leases.append(dst)
    outputs = batched_generate(decode, prompts, PARAMS, leases=leases, first_tokens=first_tokens)
    assert outputs == expected_here
    for lease in junk:
        decode_pool.release(lease, "done")
    for pool in (prefill_pool, decode_pool):
        pool.check_integrity()
        assert pool.num_free_pages == pool.num_pages


def _prefilled(engine: Engine, pool: KVPool, request_id: str, tokens: list[int]):
    lease = pool.allocate(request_id, len(tokens) + 4)
    token = int(torch.argmax(engine.prefill(lease, tokens)))
    return lease, token


def test_decode_through_stale_lease_raises(tiny) -> None:
    pool = make_pool(tiny, num_pages=16, page_tokens=16)
    engine = Engine(tiny, pool)
    victim_prompt = prompt(1, 40)
    victim, token = _prefilled(engine, pool, "tenant-a", victim_prompt)
    pool.release(victim, "finished")
    other, _ = _prefilled(engine, pool, "tenant-b", prompt(2, 40))
    assert other.page_ids[:3] == victim.page_ids[:3]  # LIFO reuse: same physical pages
    with pytest.raises(LeaseAccessError):
        engine.decode_step([DecodeSlot(victim, token, len(victim_prompt))])
    victim._live = True  # a control-path bug judges the dead request live
    with pytest.raises(LeaseAccessError):
        engine.decode_step([DecodeSlot(victim, token, len(victim_prompt))])
    with pytest.raises(LeaseAccessError):
        engine.prefill(victim, victim_prompt)
    victim._live = False
    pool.release(other, "finished")
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages


def test_decode_through_foreign_lease_raises(tiny) -> None:
    pool = make_pool(tiny, num_pages=16, page_tokens=16)
    engine = Engine(tiny, pool)
    a, _ = _prefilled(engine, pool, "tenant-a", prompt(1, 40))
    b, token = _prefilled(engine, pool, "tenant-b", prompt(2, 40))
    c, token_c = _prefilled(engine, pool, "tenant-c", prompt(3, 40))
    forged = dataclasses.replace(b, page_ids=a.page_ids)  # b's identity, a's pages
    with pytest.raises(LeaseAccessError) as info:
        engine.decode_step([DecodeSlot(c, token_c, 40), DecodeSlot(forged, token, 40)])
    assert info.value.page_id in a.page_ids
    assert pool.written_prefix(c) == 40  # the refused step wrote nothing for anyone
    for lease in (a, b, c):
        pool.release(lease, "done")
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages


def test_decode_over_unwritten_prompt_is_refused(tiny) -> None:
    """The incident: pages reserved for a long prompt, only one token written."""
    pool = make_pool(tiny, num_pages=16, page_tokens=16)
    engine = Engine(tiny, pool)
    lease = pool.allocate("stub", 100)
    token = int(torch.argmax(engine.prefill(lease, [7])))
    with pytest.raises(LeaseAccessError):
        engine.decode_step([DecodeSlot(lease, token, 99)])
    pool.mark_written(lease, 2, 16)  # written pages past a hole do not count
    with pytest.raises(LeaseAccessError):
        pool.check_readable(lease, 40)
    with pytest.raises(LeaseAccessError):
        engine.prefill(lease, [1, 2, 3])  # prefill must append at the written length
    pool.release(lease, "aborted")
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages


def test_engine_rejects_mismatched_pool(tiny) -> None:
    with pytest.raises(ValueError):
        Engine(tiny, KVPool(PoolSpec(num_layers=3, num_kv_heads=2, head_dim=32, page_tokens=16,
                                     num_pages=4)))
    pool = make_pool(tiny, num_pages=4, page_tokens=16)
    engine = Engine(tiny, pool)
    assert engine.pool.spec.bytes_per_token == 4 * 2 * 2 * 32 * 4
    lease = pool.allocate("r", 10)
    with pytest.raises(LeaseAccessError):
        engine.prefill(lease, list(range(17)))  # more than the lease holds
    pool.release(lease, "done")
    assert pool.num_free_pages == pool.num_pages


def test_decode_logits_bits_do_not_depend_on_batch_size_or_row(tiny, attention_path) -> None:
    """One request's decode logits, bit for bit, alone and at the first/last row of batches
    of 2, 7 and 16: tiles of 4, 8 and 16 rows give the same bits."""
    ref = ReferenceEngine(tiny)
    prompts = [prompt(100 + i, 20 + i) for i in range(16)]
    caches = []
    for p in prompts:
        cache = ref.new_cache(64)
        ref.prefill(cache, p)
        caches.append(cache)
    alone = ref.decode([caches[0]], [5], [len(prompts[0])])[0]
    for size in (2, 7, 16):
        for row in (0, size - 1):
            order = list(range(1, size))
            order.insert(row, 0)
            logits = ref.decode([caches[i] for i in order], [5 + i for i in order],
                                [len(prompts[i]) for i in order])
            assert torch.equal(logits[row], alone), (size, row)


def test_paged_decode_logits_bits_equal_reference_alone_and_batched(tiny, attention_path) -> None:
    """The paged store (one write per layer for the batch, one gather per request from the
    pool's flat page rows) gives a request the reference's logits bit for bit, alone and
    in the middle of a batch whose leases hold interleaved, out-of-order pages."""
    ref = ReferenceEngine(tiny)
    prompts = [prompt(200 + i, 5 + 37 * i) for i in range(7)]
    pool = make_pool(tiny, num_pages=120, page_tokens=16)
    engine = Engine(tiny, pool)
    spacers = [pool.allocate(f"s{i}", 16 * (i + 1)) for i in range(3)]
    leases = []
    for i, p in enumerate(prompts):  # free spacers between allocations: scattered pages
        leases.append(_prefilled(engine, pool, f"r{i}", p)[0])
        if spacers:
            pool.release(spacers.pop(), "spacer")
    assert any(list(lease.page_ids) != list(range(lease.page_ids[0], lease.page_ids[0]
                                                   + lease.num_pages)) for lease in leases)
    cache = ref.new_cache(len(prompts[3]) + 4)
    ref.prefill(cache, prompts[3])
    expected = ref.decode([cache], [9], [len(prompts[3])])[0]
    alone = engine.decode_step([DecodeSlot(leases[3], 9, len(prompts[3]))])[0]
    assert torch.equal(alone, expected)
    # The batched case decodes the same prompt from a second, freshly prefilled lease.
    fresh = _prefilled(engine, pool, "r3b", prompts[3])[0]
    batch = [DecodeSlot(fresh, 9, len(prompts[3])) if i == 3
             else DecodeSlot(leases[i], 1, len(prompts[i])) for i in range(len(prompts))]
    logits = engine.decode_step(batch)
    assert torch.equal(logits[3], expected)
    assert not torch.equal(logits[2], expected)
