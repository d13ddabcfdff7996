"""After a soak: every KV lease back in its pool, and every pool's integrity check passing.

Asks the workers over NATS (the same stats request `pdmesh check` makes) until no worker
holds a lease or `settle_s` has passed. Leases still held then (after aborts, faults and
rejections) are a leak; a failed integrity check is a broken pool. Only meaningful when
nothing else is using the mesh at the time.
"""

from __future__ import annotations

import asyncio
import time

from pdmesh.loadtest.check import Unreachable, collect


def _summary(rows: list, waited_s: float, error: str = "") -> dict:
    workers = []
    for r in rows:
        s = r.stats
        workers.append({
            "worker_id": r.beat.worker_id, "role": r.beat.role.value,
            "live_leases": None if s is None else s.live_leases,
            "leased_pages": None if s is None else s.leased_pages,
            "total_pages": None if s is None else s.total_pages,
            "integrity_ok": None if s is None else s.integrity_ok,
            "integrity_error": "" if s is None else s.integrity_error,
            "stats_error": r.stats_error})
    return {
        "checked": bool(workers) and not error,
        "error": error,
        "waited_s": waited_s,
        "workers": workers,
        "leaked_leases": sum(w["live_leases"] or 0 for w in workers),
        "integrity_failures": sum(w["integrity_ok"] is False for w in workers),
        "unanswered": sum(w["live_leases"] is None for w in workers),
    }


async def check_pools(nats_url: str, settle_s: float = 10.0) -> dict:
    """Poll the workers' stats until no lease is held (or `settle_s` passes)."""
    t0 = time.monotonic()
    rows: list = []
    while True:
        try:
            col = await collect(nats_url, listen_s=1.0)
        except Unreachable as exc:
            return _summary([], time.monotonic() - t0, str(exc))
        rows = col.sorted_rows()
        result = _summary(rows, time.monotonic() - t0)
        settled = result["leaked_leases"] == 0 and result["unanswered"] == 0
        if settled or time.monotonic() - t0 >= settle_s:
            if not rows:
                result["error"] = "no worker answered"
            return result
        await asyncio.sleep(0.5)
