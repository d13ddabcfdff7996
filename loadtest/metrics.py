"""Aggregation: latency statistics, throughput, goodput, errors and rejection accounting.

Field names and conventions follow `vllm bench serve` (times in the per-request lists are
seconds, statistics are milliseconds; statistics cover successful requests only; per-request
lists cover every measured request, failed ones with zeros). Warm-up requests never count.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from pdmesh.loadtest.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput SLO must be one of {SLO_METRICS} as NAME:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO value is not a number: {item!r}") from None
        if not slos[name] > 0:
            raise ValueError(f"goodput SLO must be positive: {item!r}")
    return slos


def percentile_name(p: float) -> str:
    """`p99`, `p99.9`: how vllm bench serve names a percentile in its result keys."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_percentiles(raw: str) -> tuple[float, ...]:
    """`--metric-percentiles "25,50,99.9"` -> (25.0, 50.0, 99.9)."""
    try:
        values = tuple(float(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers: {raw!r}") from None
    if not values or any(not 0 < p < 100 for p in values):
        raise ValueError(f"--metric-percentiles must be within (0, 100): {raw!r}")
    return values


def parse_metric_names(raw: str) -> tuple[str, ...]:
    """`--percentile-metrics "ttft,tpot"` -> ("ttft", "tpot")."""
    names = tuple(x.strip() for x in raw.split(",") if x.strip())
    bad = [n for n in names if n not in LATENCY_METRICS]
    if not names or bad:
        raise ValueError(f"--percentile-metrics must name some of {LATENCY_METRICS}: {raw!r}")
    return names


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES
                 ) -> dict[str, float]:
    """mean / median / std / percentiles in milliseconds (zeros when there is nothing)."""
    if len(values_s) == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0,
                **{percentile_name(p): 0.0 for p in percentiles}}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std())}
    for p in percentiles:
        stats[percentile_name(p)] = float(np.percentile(ms, p))
    return stats


def meets_slos(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    """A successful request within every SLO (a 1-token reply has TPOT 0, as in vllm)."""
    if not result.success:
        return False
    values_ms = {"ttft": result.ttft_s * 1000.0, "tpot": (result.tpot_s or 0.0) * 1000.0,
                 "e2el": result.e2el_s * 1000.0}
    return all(values_ms[name] <= limit for name, limit in slos_ms.items())


def rejection_accounting(results: Sequence[RequestResult]) -> dict[str, int]:
    """Over-long prompts must end in HTTP 400; valid prompts must never get a 4xx.

    `missed_rejections` (an over-long prompt produced output: the incident's failure mode)
    must be 0. `misreported_rejections`: an over-long prompt failed, but not with a 400.
    `unexpected_rejections`: a valid prompt got any 4xx (429 included, also counted alone
    as `throttled_requests`)."""
    expected = [r for r in results if r.expect_reject and r.error_kind != "cancelled"]
    valid = [r for r in results if not r.expect_reject]
    return {
        "expected_rejections": len(expected),
        "correct_rejections": sum(r.status == 400 for r in expected),
        "missed_rejections": sum(r.success or bool(r.generated_text) for r in expected),
        "misreported_rejections": sum(
            r.status != 400 and not r.success and not r.generated_text for r in expected),
        "unexpected_rejections": sum(
            r.status is not None and 400 <= r.status < 500 for r in valid),
        # 429 (back-pressure: "busy, retry later") is a 4xx too, so it is inside
        # unexpected_rejections; this tells it apart from refusing the prompt itself.
        "throttled_requests": sum(r.status == 429 for r in results),
    }


def errors_by_kind(results: Sequence[RequestResult]) -> dict[str, int]:
    return dict(sorted(Counter(r.error_kind for r in results if r.error_kind).items()))


def ttft_by_input_len(results: Sequence[RequestResult]) -> dict[str, dict[str, float]]:
    """TTFT statistics per prompt-length bucket (nearest power of two, in tokens)."""
    buckets: dict[int, list[float]] = {}
    for r in results:
        if r.success and r.input_len > 0:
            bucket = 2 ** round(math.log2(r.input_len))
            buckets.setdefault(bucket, []).append(r.ttft_s)
    return {str(b): {"count": len(v), **{f"{k}_ttft_ms": x for k, x in summarize_ms(v).items()}}
            for b, v in sorted(buckets.items())}


def compute_metrics(results: Sequence[RequestResult], duration_s: float,
                    slos_ms: dict[str, float] | None = None,
                    metrics: Sequence[str] = LATENCY_METRICS,
                    percentiles: Sequence[float] = PERCENTILES) -> dict:
    """The measured figures of one run (warm-up requests are dropped here); statistics
    for `metrics` (`--percentile-metrics`) at `percentiles` (`--metric-percentiles`)."""
    measured = sorted((r for r in results if not r.warmup), key=lambda r: r.index)
    ok = [r for r in measured if r.success]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    out: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(measured) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (sum(meets_slos(r, slos_ms) for r in measured) / duration_s
                            if slos_ms else None),
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": [r.input_len for r in measured],
        "output_lens": [r.output_tokens if r.success else 0 for r in measured],
        "ttfts": [r.ttft_s if r.success else 0.0 for r in measured],
        "itls": [r.itls_s if r.success else [] for r in measured],
        "errors": [r.error for r in measured],
        "generated_texts": [r.generated_text for r in measured],
    }
    series = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [itl for r in ok for itl in r.itls_s],
        "e2el": [r.e2el_s for r in ok],
    }
    for metric in metrics:
        for stat, value in summarize_ms(series[metric], percentiles).items():
            out[f"{stat}_{metric}_ms"] = value
    # pdmesh extras
    out["e2els"] = [r.e2el_s if r.success else 0.0 for r in measured]
    out["tenants"] = [r.tenant for r in measured]
    out["expect_reject"] = [r.expect_reject for r in measured]
    out["statuses"] = [r.status for r in measured]
    out["errors_by_kind"] = errors_by_kind(measured)
    out["rejection_codes"] = dict(Counter(r.error_code for r in measured
                                          if r.expect_reject and r.error_code))
    out.update(rejection_accounting(measured))
    out["goodput_slos_ms"] = dict(slos_ms or {})
    out["ttft_ms_by_input_len"] = ttft_by_input_len(measured)
    out["per_tenant"] = {
        str(t): {"requests": sum(r.tenant == t for r in measured),
                 "completed": sum(r.tenant == t and r.success for r in measured)}
        for t in sorted({r.tenant for r in measured})
    }
    return out
