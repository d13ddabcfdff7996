"""Prefix cache with the real engine (tiny model): hits compute less, outputs do not change.

Output identity is against the single-process ReferenceEngine (the I4 oracle), token for
token and bit for bit on the first-token logits, for cached and uncached prefills alike.
"Faster" is measured in computed tokens (Engine.prefill_tokens_computed), never wall time.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh.kvstore import PrefixCache
from pdmesh.services.engine.model import PREFILL_CHUNK
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import Engine, make_pool
from pdmesh.services.engine.sampling import SamplingParams
from tests.support import oracle
from tests.support.engine import batched_generate, prompt

ALICE, BOB = "salt-alice", "salt-bob"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def setup():
    tiny = oracle.tiny()
    pool = make_pool(tiny, num_pages=160, page_tokens=16)
    engine = Engine(tiny, pool)
    cache = PrefixCache(pool, align_tokens=engine.prefix_align_tokens)
    return engine, cache, ReferenceEngine(tiny)


def cached_prefill(engine: Engine, cache: PrefixCache, salt: str, tokens: list[int],
                   max_tokens: int = GREEDY.max_tokens):
    """What the prefill service does, plus room to decode in the same lease."""
    lease = cache.allocate("r", salt, tokens, num_tokens=len(tokens) + max_tokens)
    before = engine.prefill_tokens_computed
    logits = engine.prefill(lease, tokens[lease.cached_tokens:], lease.cached_tokens)
    cache.insert(salt, tokens, lease)
    return lease, logits, engine.prefill_tokens_computed - before


def generate(engine: Engine, cache: PrefixCache, salt: str, tokens: list[int]):
    lease, logits, computed = cached_prefill(engine, cache, salt, tokens)
    first = int(torch.argmax(logits))
    out = batched_generate(engine, [tokens], GREEDY, leases=[lease], first_tokens=[first])
    return out[0], logits, lease.cached_tokens, computed


def reference_run(reference: ReferenceEngine, tokens: list[int]):
    """Reference first-token logits and greedy tokens, from one reference prefill."""
    cache = reference.new_cache(len(tokens) + GREEDY.max_tokens)
    logits = reference.prefill(cache, tokens)
    out = [int(torch.argmax(logits))]
    while len(out) < GREEDY.max_tokens:
        step = reference.decode([cache], [out[-1]], [len(tokens) + len(out) - 1])[0]
        out.append(int(torch.argmax(step)))
    return logits, out


def test_alignment_is_whole_pages_and_whole_chunks(setup) -> None:
    engine, _, _ = setup
    assert engine.prefix_align_tokens == PREFILL_CHUNK == 512


def test_same_tenant_hits_computes_less_and_outputs_are_identical(setup) -> None:
    engine, cache, reference = setup
    shared = prompt(1, PREFILL_CHUNK)
    first_prompt, second_prompt = shared + prompt(2, 20), shared + prompt(3, 45)
    out1, logits1, cached1, computed1 = generate(engine, cache, ALICE, first_prompt)
    assert cached1 == 0 and computed1 == len(first_prompt)
    # Positive control: the shared 512 tokens are reused, only the suffix is computed.
    out2, logits2, cached2, computed2 = generate(engine, cache, ALICE, second_prompt)
    assert cached2 == PREFILL_CHUNK and computed2 == 45
    for tokens, out, logits in ((first_prompt, out1, logits1), (second_prompt, out2, logits2)):
        ref_logits, ref_out = reference_run(reference, tokens)
        assert torch.equal(logits, ref_logits)  # the same bits, cached or not
        assert out == ref_out
    # The identical prompt again: everything but the last (partial) chunk is reused.
    out3, _, cached3, computed3 = generate(engine, cache, ALICE, second_prompt)
    assert (cached3, computed3) == (PREFILL_CHUNK, 45) and out3 == out2
    cache.check_integrity()


def test_same_prefix_from_another_tenant_never_hits(setup) -> None:
    engine, cache, reference = setup
    tokens = prompt(7, PREFILL_CHUNK + 30)
    out_a, _, cached_a, _ = generate(engine, cache, ALICE, tokens)
    assert cache.cached_tokens(ALICE, tokens) == PREFILL_CHUNK  # alice would hit now
    assert cache.cached_tokens(BOB, tokens) == 0
    out_b, _, cached_b, computed_b = generate(engine, cache, BOB, tokens)
    assert cached_a == 0 and cached_b == 0 and computed_b == len(tokens)
    assert out_a == out_b == reference_run(reference, tokens)[1]
    cache.check_integrity()


def test_transferred_pages_equal_an_uncached_prefill(setup) -> None:
    """What prefill sends to decode (every prompt page, read-only views) is byte-identical
    with and without the cache."""
    engine, cache, _ = setup
    tokens = prompt(11, PREFILL_CHUNK + 40)
    warm, _, _ = cached_prefill(engine, cache, ALICE, tokens)
    engine.pool.release(warm, "done")
    hit, _, _ = cached_prefill(engine, cache, ALICE, tokens)
    cold, _, _ = cached_prefill(engine, cache, "", tokens)  # empty salt: never cached
    assert hit.cached_tokens == PREFILL_CHUNK and cold.cached_tokens == 0
    pool = engine.pool
    for index in range(-(-len(tokens) // 16)):
        used = min(16, len(tokens) - index * 16)  # the last page holds only the prompt's tail
        assert len(pool.page_view(hit, index)) == pool.spec.bytes_per_page
        assert torch.equal(pool.tensor[hit.page_ids[index]][:, :, :used],
                           pool.tensor[cold.page_ids[index]][:, :, :used])
    for lease in (hit, cold):
        engine.pool.release(lease, "done")
    cache.check_integrity()
