"""Where the time to first token went: a breakdown by phase from a pdmesh gateway's /metrics.

The gateway keeps histograms of each phase of the TTFT as the workers measured them
(gateway/metrics.py): admission's queue, prefill's queue, the prefill compute, the KV
transfer left after the last chunk (the exposed part), decode's commit -> first token. A
run scrapes /metrics before and after; the difference of each histogram's sum and count
gives the mean of that phase over the run's requests, set against the mean TTFT the gateway
saw. What the phases do not cover (HTTP, tokenizing, NATS hops, the stream to the client)
is the rest. A server without these series (vLLM, SGLang) gets no breakdown.

A pdmesh gateway serves its metrics on a port of its own, never on the API port
(`--metrics-url`; by default the API port + 100, `client.default_metrics_url`).
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdmesh:time_to_first_token_seconds"
# (label, histogram) in the order they happen; the exposed transfer is the part of the
# transfer that adds to the TTFT (the rest overlaps the prefill).
PHASES = (
    ("admission queue", "pdmesh:request_queue_time_seconds"),
    ("prefill queue", "pdmesh:request_prefill_queue_time_seconds"),
    ("prefill compute", "pdmesh:request_prefill_compute_time_seconds"),
    ("KV transfer (exposed)", "pdmesh:request_kv_transfer_exposed_time_seconds"),
    ("decode first token", "pdmesh:request_decode_first_token_time_seconds"),
)
TRANSFER = "pdmesh:request_kv_transfer_time_seconds"
Scrape = dict[str, float]  # "<histogram>_sum" / "<histogram>_count", summed over labels


def parse(text: str) -> Scrape:
    """Sums and counts of the TTFT and phase histograms in a Prometheus text exposition."""
    wanted = {TTFT, TRANSFER, *(name for _, name in PHASES)}
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for suffix in ("_sum", "_count"):
                base = sample.name[: -len(suffix)]
                if sample.name.endswith(suffix) and base in wanted:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


async def scrape(session: aiohttp.ClientSession, metrics_url: str) -> Scrape | None:
    """The figures at `metrics_url`, or None when it does not answer or has no pdmesh
    series."""
    try:
        async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
            figures = parse(text)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    # A fresh pdmesh gateway has no TTFT sample yet (its series carry a tenant label): it
    # is recognised by its series prefix, and its "before" is all zeros.
    return figures if f"{TTFT}_count" in figures or "\npdmesh:" in text else None


def _mean(before: Mapping[str, float], after: Mapping[str, float], name: str
          ) -> tuple[float | None, int]:
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return (total / count if count > 0 else None), int(count)


def breakdown(before: Mapping[str, float] | None, after: Mapping[str, float] | None
              ) -> dict | None:
    """Mean of each phase (ms), its share of the mean TTFT, and the exposed share of the KV
    transfer, over the requests between two scrapes; None without pdmesh figures."""
    if before is None or after is None:
        return None
    ttft, requests = _mean(before, after, TTFT)
    if ttft is None:
        return None
    phases = []
    covered = 0.0
    for label, name in PHASES:
        mean, count = _mean(before, after, name)
        if mean is not None:
            covered += mean
        phases.append({"phase": label, "metric": name, "requests": count,
                       "mean_ms": None if mean is None else mean * 1e3,
                       "share_of_ttft": None if mean is None or ttft <= 0 else mean / ttft})
    rest = max(ttft - covered, 0.0)
    phases.append({"phase": "rest (HTTP, NATS, stream)", "metric": None, "requests": requests,
                   "mean_ms": rest * 1e3, "share_of_ttft": rest / ttft if ttft > 0 else None})
    transfer, _ = _mean(before, after, TRANSFER)
    exposed, _ = _mean(before, after, "pdmesh:request_kv_transfer_exposed_time_seconds")
    return {"requests": requests, "mean_ttft_ms": ttft * 1e3, "phases": phases,
            "mean_kv_transfer_ms": None if transfer is None else transfer * 1e3,
            "exposed_transfer_share": (exposed / transfer if transfer and exposed is not None
                                       else None)}


def format_breakdown(b: Mapping) -> list[tuple[str, str]]:
    """Rows (label, value) for the summary block: one per phase, `mean ms (share %)`."""
    def cell(mean_ms: float | None, share: float | None) -> str:
        if mean_ms is None:
            return "-"
        return f"{mean_ms:.1f} ms" + ("" if share is None else f" ({share * 100:.0f}%)")

    rows = [(f"  {p['phase']}", cell(p["mean_ms"], p["share_of_ttft"])) for p in b["phases"]]
    share = b.get("exposed_transfer_share")
    rows.append(("  KV transfer exposed / whole",
                 "-" if share is None else f"{share * 100:.0f}% of "
                 f"{b['mean_kv_transfer_ms']:.1f} ms"))
    return [(f"TTFT by phase (mean {b['mean_ttft_ms']:.1f} ms, "
             f"{b['requests']} req)", ""), *rows]
