"""`pdmesh bench engine`: prefill and decode throughput, paged vs contiguous, check cost.

Bounded (~30 s on 2 cores with `tiny`). With --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from pdmesh.kvstore.spec import pages_for
from pdmesh.loadtest.bench import print_report
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import DecodeSlot, Engine, make_pool


def _best(fn, repeat: int) -> float:
    """Median seconds of `fn()` over `repeat` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def _decode_figures(batch: int, engine: Engine, reference: ReferenceEngine,
                    rng: np.random.Generator, vocab: int, ctx: int, steps: int
                    ) -> dict[str, float]:
    """Median decode-step seconds at `batch`, paged and contiguous (and, at 16, the cost of
    the lease checks), over `ctx`-token contexts."""
    pool = engine.pool
    leases, caches = [], []
    for i in range(batch):
        tokens = rng.integers(0, vocab, ctx).tolist()
        lease = pool.allocate(f"bench-{i}", ctx + 2 * steps + 4)
        engine.prefill(lease, tokens)
        cache = reference.new_cache(ctx + 2 * steps + 4)
        reference.prefill(cache, tokens)
        leases.append(lease)
        caches.append(cache)
    position = [ctx]

    def paged_step() -> None:
        engine.decode_step([DecodeSlot(lease, 1, position[0]) for lease in leases])
        position[0] += 1

    cposition = [ctx]

    def contiguous_step() -> None:
        reference.decode(caches, [1] * batch, [cposition[0]] * batch)
        cposition[0] += 1

    paged, contiguous = [], []
    for _ in range(steps // 2):  # interleave so load noise hits both equally
        paged.append(_best(paged_step, 1))
        contiguous.append(_best(contiguous_step, 1))
    results = {f"decode_step_s_b{batch}": float(np.median(paged)),
               f"contiguous_step_s_b{batch}": float(np.median(contiguous))}
    if batch == 16:
        def check_all() -> None:
            for lease in leases:
                pool.check_writable(lease, position[0], 1)
                pool.check_readable(lease, position[0])

        results["check_s_b16"] = _best(check_all, 50)
    for lease in leases:
        pool.release(lease, "bench")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench engine")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--context-len", type=int, default=512, help="tokens per decode request")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    model = load_model(args.model)
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 256)
    steps, ctx = args.steps, args.context_len
    pages_per_req = pages_for(max(args.prompt_len, ctx + 2 * steps + 4), 16)
    pool = make_pool(model, num_pages=pages_per_req * 17, page_tokens=16)
    engine = Engine(model, pool)
    reference = ReferenceEngine(model)

    # Prefill throughput.
    prompt = rng.integers(0, vocab, args.prompt_len).tolist()

    def prefill_once() -> None:
        lease = pool.allocate("bench-prefill", len(prompt))
        engine.prefill(lease, prompt)
        pool.release(lease, "bench")

    prefill_s = _best(prefill_once, 2)

    # Decode at batch 1 and 16 on paged leases and on contiguous caches.
    results: dict[str, float] = {}
    for batch in (1, 16):
        results.update(_decode_figures(batch, engine, reference, rng, vocab, ctx, steps))
    pool.check_integrity()

    report = {
        "model": model.name,
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.prompt_len,
        "prefill_tokens_per_s": args.prompt_len / prefill_s,
        "decode_context_tokens": ctx,
        "decode_tokens_per_s_b1": 1 / results["decode_step_s_b1"],
        "decode_tokens_per_s_b16": 16 / results["decode_step_s_b16"],
        "paged_vs_contiguous_b1": results["contiguous_step_s_b1"] / results["decode_step_s_b1"],
        "paged_vs_contiguous_b16": results["contiguous_step_s_b16"]
        / results["decode_step_s_b16"],
        "lease_check_pct_of_step_b16": 100 * results["check_s_b16"] / results["decode_step_s_b16"],
    }
    print_report(report, args.json, decimals=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
