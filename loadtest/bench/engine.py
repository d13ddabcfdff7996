"""`pdmesh bench engine`: prefill and decode speed against the machine's own roofline.

In one run it measures the engine (paged prefill, paged decode at batch 1 and 16, the same
decode on contiguous caches, the lease checks) and the floor it is judged against, with the
same weights on the same machine:
* `dense_forward_ms_b1` / `_b16`: a bare contiguous forward of 1 / 16 rows (embedding, every
  layer's matmuls and norms, the lm_head; no attention, no KV cache, no paging, no tiles);
* `dense_prefill_ms`: the same bare forward of all `--prompt-len` rows at once;
* `dense_prefill_attention_ms`: that forward with torch's causal SDPA in every layer (one
  call over all rows: the bare forward of the prompt, attention included);
* `weights_stream_ms`: reading every weight once (the memory-bandwidth floor of a step);
and reports the ratios `decode_vs_dense_b1`, `decode_vs_dense_b16` (decode step time /
dense forward time), `prefill_vs_dense` (paged prefill / the bare forward of the prompt,
attention included: `dense_prefill_attention_ms`) and `prefill_vs_matmuls` (paged prefill /
`dense_prefill_ms`: no attention on that side, so it cannot go below (matmuls + attention)
/ matmuls, ~1.8 for smollm2 at 4k tokens) (and their `_4k` twins when the prompt is ~4k
tokens), `paged_vs_contiguous_b1` / `_b16`,
`lease_check_pct_of_step_b16` (the step's read/write/append checks of its 16 leases,
`KVPool.check_decode_batch`, over the step), and `native_decode_attention` /
`native_decode_linear`
(whether decode attention / the decode matmuls ran in the native kernels,
services/engine/native.py), and `decode_weights_mb` / `decode_floor_ms` /
`decode_vs_floor_b1` (the weight bytes a decode step reads, the time they take at the
rate `weights_stream_ms` measured, the batch-1 step over it).
On a GGUF with Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K matrices a second engine decodes on those
blocks (PDMESH_QUANTIZED_DECODE's path, whatever the environment says; the first one decodes
on fp32), its steps taken in the same turns: `decode_step_q_ms_b1` / `_b16`,
`decode_tokens_per_s_q_b1` / `_b16`, `decode_q_speedup_b1` / `_b16` (fp32 step over it),
`decode_weights_q_mb`, `decode_floor_q_ms`, `decode_q_vs_floor_b1`.
Figures are medians of interleaved runs (prefill and its two dense forwards in turns,
`--prefill-repeat` times; paged and contiguous decode alternate which runs first after the
dense forward; with --cpu-time: the best process CPU time, for
a loaded machine; use it with --threads 1); `load_avg_1m_start` / `_end` say how busy the
machine was. Bounded: ~25 s with `tiny`, ~3 min with `smollm2` on 2 cores.
With --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from pdmesh.kvstore.spec import pages_for
from pdmesh.loadtest.bench import print_report
from pdmesh.services.engine import native
from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.model import ModelWeights, rms_norm
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import DecodeSlot, Engine, PagedKV, make_pool


class _Clock:
    """Wall clock and median (default), or, with --cpu-time, this process's CPU time and
    the best of the runs: on a shared, loaded machine wall-clock figures move 2-10x with
    the neighbours, CPU time of a 1-thread run far less (run it with --threads 1)."""

    read = staticmethod(time.perf_counter)
    reduce = staticmethod(np.median)


def _median(fn, repeat: int) -> float:
    """Median (--cpu-time: best) seconds of `fn()` over `repeat` runs (after one warm-up)."""
    return _interleaved((fn,), repeat)[0]


def _interleaved(fns, repeat: int) -> list[float]:
    """`_median` of each of `fns`, run in turns (one warm-up each first), so that a slow
    or fast phase of a shared machine falls on all of them alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, times, strict=True):
            started = _Clock.read()
            fn()
            out.append(_Clock.read() - started)
    return [float(_Clock.reduce(t)) for t in times]


@torch.inference_mode()
def dense_forward(config: ModelConfig, w: ModelWeights, token_ids: torch.Tensor,
                  attention: bool = False) -> torch.Tensor:
    """The roofline: one plain forward of all rows of `token_ids` with the model's weights
    as loaded (one standard GEMM per weight matrix over all rows; no attention, no KV, no
    per-row kernels, no tiles) and the logits of the last (at most 16) rows. With
    `attention`, each layer also runs torch's causal SDPA over all rows at once (one call,
    contiguous q/k/v, no cache, no chunks, no pages): a bare forward of the prompt."""
    x = w.embed[token_ids]
    n, heads, kv_heads, hd = x.shape[0], config.n_heads, config.n_kv_heads, config.head_dim
    for layer in w.layers:
        h = rms_norm(x, layer.attn_norm, config.norm_eps)
        q, k, v = F.linear(h, layer.wq), F.linear(h, layer.wk), F.linear(h, layer.wv)
        if attention:
            q = F.scaled_dot_product_attention(  # [1, heads, n, hd]: the flash kernel
                q.view(1, n, heads, hd).transpose(1, 2),
                k.view(1, n, kv_heads, hd).transpose(1, 2),
                v.view(1, n, kv_heads, hd).transpose(1, 2), is_causal=True, enable_gqa=True,
            )[0].transpose(0, 1).reshape(n, heads * hd)
        x = x + F.linear(q, layer.wo)
        h = rms_norm(x, layer.ffn_norm, config.norm_eps)
        x = x + F.linear(F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up),
                         layer.w_down)
    return F.linear(rms_norm(x[-16:], w.norm, config.norm_eps), w.lm_head)


@torch.inference_mode()
def weights_stream(w: ModelWeights) -> float:
    """Read every weight once (a sum per tensor: memory-bound)."""
    tensors = [w.embed, w.norm, w.lm_head]
    for layer in w.layers:
        tensors.extend(vars(layer).values())
    seen, total = set(), 0.0
    for t in tensors:
        if t is None:  # a bias the model does not have
            continue
        key = (t.data_ptr(), t.shape)
        if key not in seen:
            seen.add(key)
            total += float(t.sum())
    return total


def _stream_bytes(w: ModelWeights) -> int:
    """The bytes `weights_stream` reads."""
    tensors = [w.embed, w.norm, w.lm_head]
    for layer in w.layers:
        tensors.extend(vars(layer).values())
    seen = {(t.data_ptr(), t.shape): t.nbytes for t in tensors if t is not None}
    return sum(seen.values())


def _step_bytes(llama) -> int:
    """The weight bytes one decode step reads (every layer's matmuls, biases and norms, the
    final norm, the lm_head; not the embedding rows), on the blocks where it decodes on
    them."""
    w = llama.weights
    quant = llama.quantized.fused() if llama.quantized is not None else None
    total = w.norm.nbytes
    for i, layer in enumerate(w.layers):
        for name, t in vars(layer).items():
            qm = quant[i].get(name) if quant is not None else None
            total += qm.data.nbytes if qm is not None else (0 if t is None else t.nbytes)
    head = llama.quantized.lm_head if llama.quantized is not None else None
    return total + (head.data.nbytes if head is not None else w.lm_head.nbytes)


def _decode_figures(batch: int, engine: Engine, reference: ReferenceEngine,
                    dense_weights: ModelWeights, rng: np.random.Generator, vocab: int,
                    ctx: int, steps: int, engine_q: Engine | None = None) -> dict[str, float]:
    """Median decode-step seconds at `batch`, paged and contiguous, and the dense forward
    of `batch` rows, interleaved so load noise hits all three alike; at 16, the cost of
    the lease checks. The contiguous caches get the paged prompt KV copied in (same bytes,
    no second prefill). `engine_q` (decode on the checkpoint's quantized blocks, the same
    pool) takes its paged steps in the same turns, on the same leases."""
    pool, device = engine.pool, engine.pool.device
    leases, caches = [], []
    room = ctx + 3 * steps + 4
    for i in range(batch):
        tokens = rng.integers(0, vocab, ctx).tolist()
        lease = pool.allocate(f"bench-{i}", room)
        engine.prefill(lease, tokens)
        cache = reference.new_cache(room)
        paged = PagedKV(pool, lease)
        for layer in range(engine.config.n_layers):
            keys, values = paged.read(layer, ctx)
            cache.write(layer, 0, keys, values)
        leases.append(lease)
        caches.append(cache)
    position, cposition = [ctx], [ctx]
    dense_ids = torch.ones(batch, dtype=torch.long, device=device)

    def paged_step() -> None:
        engine.decode_step([DecodeSlot(lease, 1, position[0]) for lease in leases])
        position[0] += 1

    def contiguous_step() -> None:
        reference.decode(caches, [1] * batch, [cposition[0]] * batch)
        cposition[0] += 1

    def quantized_step() -> None:
        assert engine_q is not None
        engine_q.decode_step([DecodeSlot(lease, 1, position[0]) for lease in leases])
        position[0] += 1

    paged, contiguous, dense, checks, quantized = [], [], [], [], []

    def check_all() -> None:  # what a decode step checks: check_decode_batch
        pool.check_decode_batch(leases, [position[0]] * batch)

    for i in range(steps // 2):
        # Paged and contiguous take turns at running first after the dense forward: that
        # one pays for the caches the dense forward took (3-8 % of a tiny batch-1 step,
        # measured either way round, warm-up call included), which the ratio must not
        # charge to one of them.
        for fn, out in ((paged_step, paged), (contiguous_step, contiguous))[::1 - 2 * (i % 2)]:
            out.append(_median(fn, 1))
        dense.append(_median(lambda: dense_forward(engine.config, dense_weights, dense_ids), 1))
        if engine_q is not None:
            quantized.append(_median(quantized_step, 1))
        if batch == 16:  # in the steps' own window: a machine's slow phase hits both
            for _ in range(5):
                started = _Clock.read()
                check_all()
                checks.append(_Clock.read() - started)
    results = {f"decode_step_s_b{batch}": float(_Clock.reduce(paged)),
               f"contiguous_step_s_b{batch}": float(_Clock.reduce(contiguous)),
               f"dense_forward_s_b{batch}": float(_Clock.reduce(dense))}
    if batch == 16:
        results["check_s_b16"] = float(_Clock.reduce(checks))
    if quantized:
        results[f"decode_step_q_s_b{batch}"] = float(_Clock.reduce(quantized))
    for lease in leases:
        pool.release(lease, "bench")
    return results


@contextlib.contextmanager
def _setting(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` set to `value` for the block (then as it was)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _reference_args(device: str, dtype: torch.dtype) -> dict:
    """ReferenceEngine arguments; older engines took no device dtype (the bench also runs
    against them, to measure a "before" figure in the same run)."""
    return {} if (device, dtype) == ("cpu", torch.float32) else {"device": device,
                                                                  "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench engine")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-len", type=int, default=4000)
    parser.add_argument("--context-len", type=int, default=512, help="tokens per decode request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    parser.add_argument("--prefill-repeat", type=int, default=3,
                        help="timed prefill (and dense prefill) runs after the warm-up, "
                             "in turns; the median is reported")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: torch's default)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time with process CPU time, best of the runs (loaded machines)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        _Clock.read, _Clock.reduce = staticmethod(time.process_time), staticmethod(np.min)
    load_start = os.getloadavg()[0]

    # A GGUF's quantized blocks are kept (PDMESH_QUANTIZED_DECODE=on at load) for a second
    # engine decoding on them; the first decodes on fp32 whatever the environment says.
    with _setting(native.QUANT_SETTING, "on"):
        model = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 256)
    steps, ctx = max(args.steps, 2), args.context_len
    pages_per_req = pages_for(max(args.prompt_len, ctx + 2 * steps + 4), 16)
    pool = make_pool(model, num_pages=pages_per_req * 17, page_tokens=16, device=args.device)
    with _setting(native.QUANT_SETTING, "off"):
        engine = Engine(model, pool)
        reference = ReferenceEngine(model, **_reference_args(args.device, pool.spec.dtype))
    engine_q = None
    if model.weights.quantized is not None and native.usable(pool.device, pool.spec.dtype):
        with _setting(native.QUANT_SETTING, "on"):
            engine_q = Engine(model, pool)

    # Prefill, against a dense forward of the same rows (one warm-up run each).
    prompt = rng.integers(0, vocab, args.prompt_len).tolist()
    prompt_ids = torch.tensor(prompt, dtype=torch.long, device=pool.device)
    dense_weights = model.weights
    if (pool.device.type, pool.spec.dtype) != ("cpu", torch.float32):
        dense_weights = model.weights.to(pool.device, pool.spec.dtype)

    def prefill_once() -> None:
        lease = pool.allocate("bench-prefill", len(prompt))
        engine.prefill(lease, prompt)
        pool.release(lease, "bench")

    prefill_s, dense_prefill_s, dense_attention_s = _interleaved(
        (prefill_once, lambda: dense_forward(model.config, dense_weights, prompt_ids),
         lambda: dense_forward(model.config, dense_weights, prompt_ids, attention=True)),
        args.prefill_repeat)
    stream_s = _median(lambda: weights_stream(dense_weights), 3)

    results: dict[str, float] = {}
    for batch in (1, 16):
        results.update(_decode_figures(batch, engine, reference, dense_weights, rng, vocab,
                                       ctx, steps, engine_q))
    pool.check_integrity()

    report: dict[str, object] = {
        "model": model.name,
        "device": str(pool.device),
        "dtype": str(pool.spec.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "clock": "cpu_best" if args.cpu_time else "wall_median",
        "prefill_tokens": args.prompt_len,
        "prefill_tokens_per_s": args.prompt_len / prefill_s,
        "decode_context_tokens": ctx,
        "decode_tokens_per_s_b1": 1 / results["decode_step_s_b1"],
        "decode_tokens_per_s_b16": 16 / results["decode_step_s_b16"],
        "decode_step_ms_b1": 1000 * results["decode_step_s_b1"],
        "decode_step_ms_b16": 1000 * results["decode_step_s_b16"],
        "dense_forward_ms_b1": 1000 * results["dense_forward_s_b1"],
        "dense_forward_ms_b16": 1000 * results["dense_forward_s_b16"],
        "dense_prefill_ms": 1000 * dense_prefill_s,
        "dense_prefill_attention_ms": 1000 * dense_attention_s,
        "weights_stream_ms": 1000 * stream_s,
        "decode_vs_dense_b1": results["decode_step_s_b1"] / results["dense_forward_s_b1"],
        "decode_vs_dense_b16": results["decode_step_s_b16"] / results["dense_forward_s_b16"],
        # "prefill_vs_dense": against the bare forward of the prompt, attention included;
        # the matmul-only floor is kept beside it.
        "prefill_vs_dense": prefill_s / dense_attention_s,
        "prefill_vs_matmuls": prefill_s / dense_prefill_s,
        "paged_vs_contiguous_b1": results["contiguous_step_s_b1"] / results["decode_step_s_b1"],
        "paged_vs_contiguous_b16": results["contiguous_step_s_b16"]
        / results["decode_step_s_b16"],
        "lease_check_pct_of_step_b16": 100 * results["check_s_b16"] / results["decode_step_s_b16"],
    }
    # The memory-bandwidth floor of a step: its weight bytes at weights_stream's rate.
    bandwidth = _stream_bytes(dense_weights) / stream_s
    report["decode_weights_mb"] = _step_bytes(engine.model) / 1e6
    report["decode_floor_ms"] = 1000 * _step_bytes(engine.model) / bandwidth
    report["decode_vs_floor_b1"] = 1000 * results["decode_step_s_b1"] / report["decode_floor_ms"]
    if engine_q is not None:  # decode on the checkpoint's quantized blocks, same turns
        q_bytes = _step_bytes(engine_q.model)
        report["decode_weights_q_mb"] = q_bytes / 1e6
        report["decode_floor_q_ms"] = 1000 * q_bytes / bandwidth
        for b in (1, 16):
            report[f"decode_step_q_ms_b{b}"] = 1000 * results[f"decode_step_q_s_b{b}"]
            report[f"decode_tokens_per_s_q_b{b}"] = b / results[f"decode_step_q_s_b{b}"]
            report[f"decode_q_speedup_b{b}"] = (results[f"decode_step_s_b{b}"]
                                                / results[f"decode_step_q_s_b{b}"])
        report["decode_q_vs_floor_b1"] = (report["decode_step_q_ms_b1"]
                                          / report["decode_floor_q_ms"])
    if 3900 <= args.prompt_len <= 4200:
        report["prefill_vs_dense_4k"] = report["prefill_vs_dense"]
        report["prefill_vs_matmuls_4k"] = report["prefill_vs_matmuls"]
    report["native_decode_attention"] = native.usable(pool.device, pool.spec.dtype)
    # older engines have no native matmuls (the bench also times them)
    report["native_decode_linear"] = getattr(engine.model, "native_linear", lambda: False)()
    report["load_avg_1m_start"] = load_start
    report["load_avg_1m_end"] = os.getloadavg()[0]
    print_report(report, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
