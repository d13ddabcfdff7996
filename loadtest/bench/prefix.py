"""`pdmesh bench prefix-cache`: TTFT with the tenant-salted prefix cache vs without, in-process.

Workload (defaults): 8 tenants share the *same* 4096-token system prompt (the worst case for
isolation: identical tokens, different tenants), each request adds 256 distinct tokens. Per
tenant: request A misses (the salt keeps tenants apart even though the tokens are equal) and
is computed in full, exactly as without a cache; request B (same prefix, new suffix) hits
and computes only its suffix. One tenant's B also runs with the cache bypassed, to check the
first-token logits are bit-identical either way. TTFT here is what the prefill worker does
before it can send: allocate (+ pin, + evict), prefill, sample the first token, insert.

Bounded: tenants run one after another (A then B) until `--budget-s` (default 60 s) is
spent; `tenants_measured` says how many made it (a 4k-token CPU prefill of `tiny` takes
several seconds, so a loaded 2-core machine may measure fewer than 8). `--prefix-len`
shrinks the work. With --json the last stdout line is one JSON object. Figures, never
pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pdmesh.kvstore import PrefixCache
from pdmesh.kvstore.spec import pages_for
from pdmesh.loadtest.bench import print_report
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.runner import Engine, make_pool

SUFFIX_SEED_BASE = 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench prefix-cache")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=4096, help="shared prefix tokens")
    parser.add_argument("--suffix-len", type=int, default=256, help="distinct tokens/request")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--budget-s", type=float, default=60.0,
                        help="stop starting new tenants after this many seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.tenants < 1 or args.prefix_len < 1 or args.suffix_len < 1:
        parser.error("--tenants, --prefix-len and --suffix-len must be positive")

    model = load_model(args.model)
    prompt_len = args.prefix_len + args.suffix_len
    if prompt_len > model.config.max_context:
        parser.error(f"prompt of {prompt_len} tokens exceeds the model's context")
    page = args.page_tokens
    pages_per_prompt = pages_for(prompt_len, page)
    pool = make_pool(model, num_pages=pages_per_prompt * (args.tenants + 3), page_tokens=page,
                     device=args.device)
    engine = Engine(model, pool)
    cache = PrefixCache(pool, align_tokens=engine.prefix_align_tokens)
    vocab = min(model.config.vocab_size, 256)
    prefix = np.random.default_rng(0).integers(0, vocab, args.prefix_len).tolist()

    def suffix(seed: int) -> list[int]:
        return np.random.default_rng(SUFFIX_SEED_BASE + seed).integers(
            0, vocab, args.suffix_len).tolist()

    def run(salt: str, tokens: list[int]) -> tuple[float, int, int, torch.Tensor]:
        """One prefill as the worker does it: (ttft_s, cached, computed, logits)."""
        if args.device != "cpu":
            torch.cuda.synchronize()
        started = time.perf_counter()
        lease = cache.allocate(f"bench-{salt}", salt, tokens)
        computed_before = engine.prefill_tokens_computed
        logits = engine.prefill(lease, tokens[lease.cached_tokens:], lease.cached_tokens)
        int(torch.argmax(logits))  # the first token (syncs the device)
        cache.insert(salt, tokens, lease)
        elapsed = time.perf_counter() - started
        pool.release(lease, "bench")
        return (elapsed, lease.cached_tokens, engine.prefill_tokens_computed - computed_before,
                logits)

    bench_started = time.perf_counter()
    run("warmup", prefix[:64] + suffix(-1)[:8])  # first-call costs out of the figures
    cache.clear()
    cold, warm, cached_warm, computed_cold, computed_warm = [], [], [], [], []
    cross_tenant_hits, identical, measured = 0, True, 0
    for tenant in range(args.tenants):
        if measured and time.perf_counter() - bench_started > args.budget_s:
            break
        salt = f"tenant-{tenant}"
        # A: a miss, even though other tenants cached these very tokens.
        seconds, cached, computed, _ = run(salt, prefix + suffix(2 * tenant))
        cross_tenant_hits += cached
        cold.append(seconds)
        computed_cold.append(computed)
        # B: same tenant, same prefix, new suffix: a hit.
        tokens = prefix + suffix(2 * tenant + 1)
        seconds, cached, computed, logits = run(salt, tokens)
        warm.append(seconds)
        cached_warm.append(cached)
        computed_warm.append(computed)
        if tenant == 0:  # the same request with the cache bypassed (empty salt)
            bypass_s, _, _, bypass_logits = run("", tokens)
            identical = bool(torch.equal(logits, bypass_logits))
            cold.append(bypass_s)
        measured += 1
    pool.check_integrity()
    cache.check_integrity()

    without, with_cache = statistics.median(cold), statistics.median(warm)
    report = {
        "model": model.name,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "tenants": args.tenants,
        "tenants_measured": measured,
        "prefix_tokens": args.prefix_len,
        "suffix_tokens": args.suffix_len,
        "align_tokens": engine.prefix_align_tokens,
        "ttft_s_without_cache": without,
        "ttft_s_with_cache": with_cache,
        "ttft_ratio_with_vs_without": with_cache / without,
        "speedup": without / with_cache,
        "cached_tokens_per_hit": statistics.median(cached_warm),
        "computed_tokens_without_cache": statistics.median(computed_cold),
        "computed_tokens_with_cache": statistics.median(computed_warm),
        "cross_tenant_hit_tokens": cross_tenant_hits,
        "first_token_logits_identical": identical,
        "evicted_pages": cache.stats.evicted_pages,
        "wall_s": time.perf_counter() - bench_started,
    }
    print_report(report, args.json, decimals=4)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
