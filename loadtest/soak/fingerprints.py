"""Before a soak judges anything: its oracle must compute the bits the mesh computes.

The engine fingerprint of the oracle's reference engine (services/engine/fingerprint.py) is
compared with the one each prefill and decode worker announces in its heartbeats. A worker
that announces another one runs another model file, kernel build, torch, dtype or device:
its replies would be judged against answers it cannot give, so the soak refuses to run. A
worker that announces none cannot be checked; it is reported, not refused.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdmesh.loadtest.check import WORKER_ROLES, Unreachable, collect
from pdmesh.services.engine.fingerprint import engine_fingerprint
from pdmesh.services.engine.oracle import Oracle
from pdmesh.services.protocol import messages as m

LISTEN_S = 2.0  # heartbeats heard before the run (four at the default --heartbeat-s)


def oracle_fingerprint(oracle: Oracle, model: str) -> str:
    """The fingerprint of the oracle's reference engine, loaded from the spec `model`."""
    ref = oracle.reference
    return engine_fingerprint(ref.loaded, ref.engine, spec=model)


def compare(oracle: str, beats: Iterable[m.Heartbeat]) -> dict:
    """The check as the results file keeps it: each worker's fingerprint, those that
    differ from the oracle's (`mismatched`: the soak must not judge) and those that
    announce none."""
    workers = {f"{b.role.value} {b.worker_id}": b.fingerprint for b in beats
               if b.role in WORKER_ROLES}
    return {"checked": bool(workers), "oracle": oracle, "workers": workers,
            "mismatched": sorted(w for w, fp in workers.items() if fp and fp != oracle),
            "unannounced": sorted(w for w, fp in workers.items() if not fp),
            "error": "" if workers else f"no prefill or decode heartbeat in {LISTEN_S:g}s"}


async def check_fingerprints(nats_url: str, oracle: str, listen_s: float = LISTEN_S) -> dict:
    """`compare` against the heartbeats heard on the mesh's NATS for `listen_s`."""
    try:
        col = await collect(nats_url, listen_s, stats=False, probe=False)
    except Unreachable as exc:
        return {**compare(oracle, ()), "error": str(exc)}
    return compare(oracle, (row.beat for row in col.sorted_rows()))


def refusal(check: dict) -> str:
    """Why the soak must not judge this mesh ("" when it may)."""
    if not check["mismatched"]:
        return ""
    names = "; ".join(f"{w}: {check['workers'][w]}" for w in check["mismatched"])
    return (f"the oracle's engine fingerprint {check['oracle']} differs from the workers' "
            f"({names}): they compute other bits, so every reply would be judged against "
            "answers they cannot give; run the oracle on the mesh's build (--oracle-model, "
            "PDMESH_NATIVE_KERNELS, torch, machine type)")
