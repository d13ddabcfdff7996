"""Output: results JSON (vllm bench serve field names), PNG plots, text tables.

Plots read only the results dicts, so they can be redrawn from saved JSON files. They need
matplotlib (the `plot` extra); without it they are skipped with a note and everything else
is written.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pdmesh.loadtest import phases

# The results schema: `vllm bench serve` names (its tooling reads the file) + pdmesh extras.
VLLM_RESULT_KEYS = (
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p99")),
)
PDMESH_RESULT_KEYS = (
    "label", "base_url", "seed", "context_length", "num_tenants", "issued", "not_issued",
    "interrupted", "deadline_reached", "failed", "e2els", "tenants", "expect_reject",
    "statuses", "errors_by_kind", "rejection_codes", "expected_rejections",
    "correct_rejections", "missed_rejections", "misreported_rejections",
    "unexpected_rejections", "throttled_requests", "goodput_slos_ms", "ttft_ms_by_input_len",
    "per_tenant", "ttft_breakdown",
)
INTEGRITY_RESULT_KEYS = ("integrity_checked", "integrity_mismatches", "integrity_unchecked",
                         "integrity_reference_failures")
LATENCY_CDF_PNG = "latency_cdf.png"
TTFT_VS_PROMPT_PNG = "ttft_vs_prompt_len.png"


def write_json(path: Path, payload: object) -> None:
    """Write atomically (tmp + rename), so an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _ok_mask(result: Mapping) -> list[bool]:
    return [not err for err in result["errors"]]


def _latency_series(result: Mapping) -> dict[str, np.ndarray]:
    ok = _ok_mask(result)
    return {
        "TTFT": np.array([t for t, good in zip(result["ttfts"], ok, strict=True) if good]),
        "ITL": np.array([x for itl, good in zip(result["itls"], ok, strict=True) if good
                         for x in itl]),
        "E2E latency": np.array([t for t, good in zip(result["e2els"], ok, strict=True)
                                 if good]),
    }


def _figure(**kw: Any) -> Any:
    # No pyplot: Agg rendering, no global GUI state. Imported here: an optional extra.
    from matplotlib.figure import Figure

    return Figure(**kw)


def plot_latency_cdfs(runs: Mapping[str, Mapping], path: Path) -> Path:
    """One panel per latency (TTFT, ITL, E2E), one CDF line per run (label -> results)."""
    fig = _figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for label, result in runs.items():
        for ax, (name, values_s) in zip(axes, _latency_series(result).items(), strict=True):
            ax.set_title(f"{name} CDF")
            ax.set_xlabel("milliseconds")
            ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of tokens")
            if len(values_s) == 0:
                continue
            xs = np.sort(values_s) * 1000.0
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post",
                    label=f"{label} (n={len(xs)})")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    fig.savefig(path, dpi=100)
    return path


def plot_ttft_vs_prompt_len(runs: Mapping[str, Mapping], path: Path) -> Path:
    fig = _figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for label, result in runs.items():
        ok = _ok_mask(result)
        lens = [n for n, good in zip(result["input_lens"], ok, strict=True) if good]
        ttfts = [t * 1000.0 for t, good in zip(result["ttfts"], ok, strict=True) if good]
        ax.scatter(lens, ttfts, s=12, alpha=0.7, label=f"{label} (n={len(lens)})")
    ax.set_title("TTFT vs prompt length")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left")
    fig.savefig(path, dpi=100)
    return path


def write_plots(runs: Mapping[str, Mapping], output_dir: Path) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("matplotlib") is None:
        print("loadtest: no plots (matplotlib is not installed: pip install 'pdmesh[plot]')",
              file=sys.stderr)
        return []
    return [plot_latency_cdfs(runs, output_dir / LATENCY_CDF_PNG),
            plot_ttft_vs_prompt_len(runs, output_dir / TTFT_VS_PROMPT_PNG)]


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_row(name: str, value: object, name_width: int, value_width: int = 18) -> str:
    return f"{name:<{name_width}}{_fmt(value):>{value_width}}"


def format_block(title: str, rows: Iterable[tuple[str, object]], name_width: int,
                 value_width: int = 18) -> list[str]:
    """A title line (`===== title =====`) and one `name ... value` line a row; the caller
    adds its own lines and the closing `=` line."""
    lines = [title.center(name_width + value_width, "=")]
    lines += [format_row(name, value, name_width, value_width) for name, value in rows]
    return lines


def format_summary(result: Mapping) -> str:
    """A `vllm bench serve`-style block of the main figures of one run."""
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Benchmark duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total generated tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Request goodput (req/s)", result["request_goodput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        stats = [k[: -len(f"_{metric}_ms")] for k in result if k.endswith(f"_{metric}_ms")]
        for stat in stats:
            if stat != "std":
                label = stat.upper() if stat.startswith("p") else stat.capitalize()
                rows.append((f"{label} {name} (ms)", result[f"{stat}_{metric}_ms"]))
    if result.get("ttft_breakdown"):
        rows += phases.format_breakdown(result["ttft_breakdown"])
    rows += [
        ("Expected rejections", result["expected_rejections"]),
        ("Correct rejections (400)", result["correct_rejections"]),
        ("Missed rejections (must be 0)", result["missed_rejections"]),
        ("Unexpected rejections (4xx)", result["unexpected_rejections"]),
        ("  of which throttled (429)", result["throttled_requests"]),
        ("Errors by kind", json.dumps(result["errors_by_kind"])),
    ]
    if "integrity_mismatches" in result:
        rows.append(("Integrity checked / mismatches",
                     f"{result['integrity_checked']} / {result['integrity_mismatches']}"))
    lines = format_block(f" Load test result: {result.get('label', '')} ", rows, 42)
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)


COMPARE_ROWS = (
    ("mean_ttft_ms", "Mean TTFT (ms)"),
    ("median_ttft_ms", "Median TTFT (ms)"),
    ("p99_ttft_ms", "P99 TTFT (ms)"),
    ("mean_tpot_ms", "Mean TPOT (ms)"),
    ("p99_itl_ms", "P99 ITL (ms)"),
    ("mean_e2el_ms", "Mean E2EL (ms)"),
    ("output_throughput", "Output tokens/s"),
    ("request_throughput", "Requests/s"),
    ("completed", "Completed"),
    ("missed_rejections", "Missed rejections"),
)


def _ratio(a: object, b: object) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b:
        ratio = a / b
        return ratio if math.isfinite(ratio) else None
    return None


def comparison(label_a: str, a: Mapping, label_b: str, b: Mapping) -> dict:
    """Side-by-side figures of two runs of the same workload, with ratios a / b."""
    rows = {key: {label_a: a.get(key), label_b: b.get(key), "ratio": _ratio(a.get(key),
                                                                           b.get(key))}
            for key, _ in COMPARE_ROWS}
    buckets = {}
    for bucket, stats in a.get("ttft_ms_by_input_len", {}).items():
        other = b.get("ttft_ms_by_input_len", {}).get(bucket)
        if other:
            buckets[bucket] = {label_a: stats["median_ttft_ms"], label_b: other["median_ttft_ms"],
                               "ratio": _ratio(stats["median_ttft_ms"], other["median_ttft_ms"])}
    # Same seed, same prompts, greedy: both servers must give the same text (I4).
    both_ok = [i for i, (ea, eb) in enumerate(zip(a["errors"], b["errors"], strict=True))
               if not ea and not eb]
    differing = [i for i in both_ok if a["generated_texts"][i] != b["generated_texts"][i]]
    return {"labels": [label_a, label_b], "rows": rows, "median_ttft_ms_by_input_len": buckets,
            "outputs_compared": len(both_ok), "output_mismatches": len(differing),
            "output_mismatch_indices": differing,
            "ttft_ratio": rows["mean_ttft_ms"]["ratio"],
            "output_throughput_ratio": rows["output_throughput"]["ratio"]}


def format_comparison(comp: Mapping) -> str:
    label_a, label_b = comp["labels"]
    lines = [f"{'metric':<28}{label_a:>14}{label_b:>14}{'ratio':>10}", "-" * 66]
    names = dict(COMPARE_ROWS)
    for key, row in comp["rows"].items():
        lines.append(f"{names[key]:<28}{_fmt(row[label_a]):>14}{_fmt(row[label_b]):>14}"
                     f"{_fmt(row['ratio']):>10}")
    for bucket, row in comp["median_ttft_ms_by_input_len"].items():
        lines.append(f"{'Median TTFT ~' + bucket + ' tok':<28}{_fmt(row[label_a]):>14}"
                     f"{_fmt(row[label_b]):>14}{_fmt(row['ratio']):>10}")
    lines.append(f"Greedy outputs compared / differing: {comp['outputs_compared']} / "
                 f"{comp['output_mismatches']}")
    return "\n".join(lines)
