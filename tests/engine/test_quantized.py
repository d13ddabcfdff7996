"""Decode on a GGUF's own quantized blocks (kernels/decode_linear_q.c, native.linear_q).

The kernel against an independent float64 computation of what it promises (int8
activations per block of 32, the weights' own blocks as the `gguf` package dequantizes
them), its batch invariance, its vectorised path against its portable one, and the whole
model: a quantized tiny GGUF (Q4_1, Q4_K and Q6_K) decoded batch-invariant through the
one-call step, and SmolLM2's Q4_1 file (`make test-long`) against the fp32 reference (logprob
differences, greedy agreement) and batch-invariant.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pdmesh.services.engine import native
from tests.support.engine import fp32_and_on_blocks, int8_rows, teacher_forced

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")
# SmolLM2 on its blocks (a minute): make test-long
long_test = pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                               reason="SmolLM2 on its Q4_1 blocks: make test-long")
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
K_TYPES = ("Q4_K", "Q6_K")  # 256-value super-blocks


def _q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks (the `gguf` package cannot quantize to it): scales d and
    dmin of weights' size, random packed 6-bit scales and mins, random nibbles."""
    blocks = np.empty((rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.002, 0.02, (rows, cols // 256, 1)).astype(
        np.float16).view(np.uint8)
    blocks[..., 2:4] = rng.uniform(0.002, 0.05, (rows, cols // 256, 1)).astype(
        np.float16).view(np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 256, 140), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def _q6_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q6_K super-blocks (the `gguf` package cannot quantize to it either): random
    low nibbles and high 2-bit pairs, random signed 8-bit scales, d of weights' size."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = rng.integers(-128, 128, (rows, cols // 256, 16)).astype(
        np.int8).view(np.uint8)
    blocks[..., 208:210] = rng.uniform(0.0002, 0.002, (rows, cols // 256, 1)).astype(
        np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    return (_q4_k if kind == "Q4_K" else _q6_k)(rows, cols, rng)


def _matrix(kind: str, rows: int, cols: int, seed: int = 0
            ) -> tuple[native.QuantMatrix, np.ndarray]:
    """Random weights as blocks of `kind`, and those blocks dequantized (float64)."""
    rng = np.random.default_rng(seed)
    t = GGMLQuantizationType[kind]
    if kind in K_TYPES:
        blocks = _random_blocks(kind, rows, cols, rng)
    else:
        blocks = quantize(rng.standard_normal((rows, cols)).astype(np.float32), t)
    return (native.QuantMatrix(native.QUANT_TYPES[kind], cols, np.ascontiguousarray(blocks)),
            dequantize(blocks, t).astype(np.float64))


@pytest.mark.parametrize("kind", TYPES)
def test_each_output_is_the_int8_rows_times_the_dequantized_blocks(kind: str) -> None:
    qm, w = _matrix(kind, 48, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    got = native.linear_q(x, qm).double().numpy()
    want = int8_rows(x.numpy()) @ w.T
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
    # and close to the fp32 product: int8 activations lose < 2% here
    exact = x.double().numpy() @ w.T
    assert np.abs(got - exact).max() / np.abs(exact).max() < 0.02


@pytest.mark.parametrize("kind", TYPES)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(kind: str) -> None:
    qm, _ = _matrix(kind, 80, 768, seed=2)
    x = torch.randn(16, 768, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([native.linear_q(x[i:i + 1], qm) for i in range(16)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (2, 3, 16):
                assert torch.equal(native.linear_q(x[:m], qm), alone[:m]), (t, m)
            assert torch.equal(native.linear_q(x.flip(0), qm), alone.flip(0))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", TYPES)
def test_the_vectorised_path_gives_the_portable_paths_bits(kind: str) -> None:
    cols = 1024 if kind in K_TYPES else 576  # (SmolLM2's width is no multiple of 256)
    qm, _ = _matrix(kind, 64, cols, seed=4)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(5)) * 3
    x[2] = 0  # an all-zero block: scale 0
    x[3, :32] = 1e-30  # tiny values
    assert torch.equal(native.linear_q(x, qm), native.linear_q(x, qm, portable=True))


def test_bad_arguments_are_refused() -> None:
    qm, _ = _matrix("Q4_1", 32, 64)
    with pytest.raises(ValueError, match="fp32 CPU x"):
        native.linear_q(torch.zeros(1, 32), qm)
    with pytest.raises(ValueError, match="not one of"):
        native.QuantMatrix(13, 64, qm.data)  # Q5_K
    with pytest.raises(ValueError, match="a width the type takes"):
        native.QuantMatrix(native.QUANT_TYPES["Q4_K"], 288, np.zeros((32, 162), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        native.QuantMatrix(qm.type, 96, qm.data)


@pytest.fixture(scope="module")
def smollm2_both() -> tuple[object, object]:
    """SmolLM2's Q4_1 GGUF loaded once with its blocks: (fp32 reference engine, engine
    decoding on the blocks), the same weights."""
    from pdmesh.services.engine.checkpoint import resolve

    path = resolve("smollm2").path
    assert path is not None
    return fp32_and_on_blocks(path)


@pytest.mark.slow
@long_test
def test_smollm2_on_its_q4_1_blocks_against_the_fp32_reference(smollm2_both) -> None:
    """Decode on the blocks follows the fp32 reference's own greedy continuation (200
    tokens, teacher-forced): the accuracy the int8 activations cost, measured."""
    from pdmesh.services.engine.sampling import SamplingParams

    reference, quantized = smollm2_both
    tok = reference.loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]))
    tokens = reference.generate(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    ref = teacher_forced(reference, prompt, tokens)
    got = teacher_forced(quantized, prompt, tokens)
    picked = torch.tensor(tokens[1:])
    diff = (got.gather(1, picked[:, None]) - ref.gather(1, picked[:, None])).abs()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"q4_1 blocks vs fp32: {len(picked)} steps, greedy agreement {agree:.3f}, "
          f"|logprob diff| of the reference's token: mean {diff.mean():.4f}, "
          f"max {diff.max():.4f}")
    assert agree >= 0.9
    assert diff.mean() < 0.1
    # and not the fp32 path by another name
    assert not torch.equal(got, ref)


@pytest.mark.slow
@long_test
def test_smollm2_on_its_blocks_is_batch_invariant(smollm2_both) -> None:
    """A request's decode logits on the blocks are the same bits alone or beside others."""
    _, quantized = smollm2_both
    tok = quantized.loaded.tokenizer
    prompts = [tok.encode(text) for text in ("The capital of France is", "def fib(n):",
                                             "1, 2, 3, 4,")]
    caches, size = [], max(map(len, prompts)) + 4  # one cache shape for the batch
    for p in prompts:
        caches.append(quantized.new_cache(size))
        quantized.prefill(caches[-1], p)
    alone = [quantized.decode([c], [p[-1]], [len(p)])[0]
             for c, p in zip(caches, prompts, strict=True)]
    # the same step again, batched: each request rewrites its own slot, then reads it
    together = quantized.decode(caches, [p[-1] for p in prompts], [len(p) for p in prompts])
    for i in range(3):
        assert torch.equal(together[i], alone[i]), i


def _write_quantized_tiny(tiny, path, kind: str = "Q4_1") -> None:
    """tiny as llama.cpp would write it quantized: every layer matmul `kind` (q/k rows
    permuted first, as its converter does), the lm_head Q8_0. Q4_K and Q6_K, which the
    `gguf` package cannot quantize to, get random blocks of the matrices' shapes instead."""
    from tests.engine.test_models import permute
    from tests.support.engine import tiny_gguf_writer

    cfg, w = tiny.config, tiny.weights
    writer = tiny_gguf_writer(path, cfg)

    def add(name: str, t: np.ndarray, kind: str | None = None) -> None:
        t = np.ascontiguousarray(t, dtype=np.float32)
        if kind is None:
            writer.add_tensor(name, t)
        elif kind in K_TYPES:
            writer.add_tensor(name, _random_blocks(kind, t.shape[0], t.shape[1],
                                                   np.random.default_rng(len(name))),
                              raw_dtype=GGMLQuantizationType[kind])
        else:
            qt = GGMLQuantizationType[kind]
            writer.add_tensor(name, quantize(t, qt), raw_dtype=qt)

    add("token_embd.weight", w.embed.numpy())
    add("output_norm.weight", w.norm.numpy())
    add("output.weight", w.lm_head.numpy(), "Q8_0")
    for i, layer in enumerate(w.layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", layer.attn_norm.numpy())
        add(p + "ffn_norm.weight", layer.ffn_norm.numpy())
        add(p + "attn_q.weight", permute(layer.wq.numpy(), cfg.n_heads), kind)
        add(p + "attn_k.weight", permute(layer.wk.numpy(), cfg.n_kv_heads), kind)
        for name, t in (("attn_v", layer.wv), ("attn_output", layer.wo),
                        ("ffn_gate", layer.w_gate), ("ffn_up", layer.w_up),
                        ("ffn_down", layer.w_down)):
            add(p + name + ".weight", t.numpy(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_the_kept_blocks_are_the_fp32_weights_rows(tiny, tmp_path, kind: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kept matrix, dequantized, is bit for bit the fp32 weight the loader made of
    the same tensor: same rows, same order (llama's q/k permutation undone on the blocks)."""
    from pdmesh.services.engine.gguf_loader import load_gguf

    path = tmp_path / "tiny-q.gguf"
    _write_quantized_tiny(tiny, path, kind)
    monkeypatch.setenv(native.QUANT_SETTING, "on")
    loaded = load_gguf(path)
    q = loaded.weights.quantized
    assert q is not None and q.lm_head is not None
    names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    for i, layer in enumerate(loaded.weights.layers):
        assert sorted(q.layers[i]) == sorted(names)
        for name in names:
            qm = q.layers[i][name]
            got = dequantize(qm.data, GGMLQuantizationType(qm.type))
            assert np.array_equal(got, getattr(layer, name).numpy()), (i, name)
    head = dequantize(q.lm_head.data, GGMLQuantizationType.Q8_0)
    assert np.array_equal(head, loaded.weights.lm_head.numpy())
    monkeypatch.setenv(native.QUANT_SETTING, "off")
    assert load_gguf(path).weights.quantized is None  # not kept unless asked for


def test_bench_engine_times_decode_on_the_blocks_beside_fp32(tiny, tmp_path) -> None:
    """`pdmesh bench engine` on a quantized GGUF: the blocks' decode step in the same turns
    as the fp32 one, and each against the bytes it streams."""
    import json
    import subprocess
    import sys

    path = tmp_path / "tiny-q.gguf"
    _write_quantized_tiny(tiny, path)
    out = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench", "engine",
                          "--model", str(path), "--prompt-len", "128", "--context-len", "64",
                          "--steps", "4", "--json"], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("decode_step_q_ms_b1", "decode_step_q_ms_b16", "decode_q_speedup_b1",
                "decode_floor_q_ms", "decode_q_vs_floor_b1", "decode_floor_ms"):
        assert got[key] > 0, key
    assert got["decode_weights_q_mb"] < got["decode_weights_mb"] / 4


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_a_model_on_its_blocks_decodes_each_row_as_alone(tiny, tmp_path, kind: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-call native step on a GGUF's blocks (every layer matmul `kind`, lm_head
    Q8_0): three requests batched get the bits each gets alone, and the step is not the
    fp32 one."""
    from pdmesh.services.engine.fingerprint import decode_path
    from pdmesh.services.engine.gguf_loader import load_gguf
    from pdmesh.services.engine.reference import ReferenceEngine

    path = tmp_path / "tiny-q.gguf"
    _write_quantized_tiny(tiny, path, kind)
    monkeypatch.setenv(native.QUANT_SETTING, "on")
    loaded = load_gguf(path)
    engine = ReferenceEngine(loaded)
    assert decode_path(engine.model).startswith("native-step-q:")
    assert engine.model._native_layers().quantized == 4 * loaded.config.n_layers
    prompts = [[5, 9, 200, 17], [1, 2, 3, 4, 5, 6, 7], [250, 251]]
    caches = [engine.new_cache(12) for _ in prompts]
    for cache, p in zip(caches, prompts, strict=True):
        engine.prefill(cache, p)
    alone = [engine.decode([c], [p[-1]], [len(p)])[0]
             for c, p in zip(caches, prompts, strict=True)]
    together = engine.decode(caches, [p[-1] for p in prompts], [len(p) for p in prompts])
    for i in range(3):
        assert torch.equal(together[i], alone[i]), i
    monkeypatch.setenv(native.QUANT_SETTING, "off")
    fp32 = ReferenceEngine(loaded)
    cache = fp32.new_cache(12)
    fp32.prefill(cache, prompts[0])
    assert not torch.equal(fp32.decode([cache], [prompts[0][-1]], [4])[0], alone[0])
    # other bits, another fingerprint: no mesh pairs the two, no soak judges one by the other
    assert decode_path(fp32.model).startswith("native-step:")
