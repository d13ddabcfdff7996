"""Chaos: `pdmesh soak` for three minutes against `pdmesh up --model tiny --prefill 2
--decode 2` while a killer SIGTERMs or SIGKILLs a random prefill or decode worker every
15-30 s and the launcher restarts each one (`--restart always`; the killer:
loadtest/chaos.py). No admitted request may fail, every served reply is the oracle's, no
lease is left once every worker is back, and the gateway counted the migrations.

A refusal before admission (HTTP 429 or 503 before any reply started: the mesh saturated or
without a worker while one restarts) is tolerated and counted: admission placed nothing,
so nothing was lost, and the client may retry. Every other failure counts against the run
(chaos.RecordingTally). Faults are off: every failure here is the kills' doing.

Runs only under `make test-chaos` (PDMESH_CHAOS_TESTS=1). PDMESH_CHAOS_SEED replays a run
(the kill schedule and the soak's workload; each run prints its seed), PDMESH_CHAOS_DURATION_S
sets the soak's length (180), PDMESH_CHAOS_OUT where the JSON and the mesh's log are saved
(default: the test's tmp_path). The JSON (soak results, kills, migrations) is printed too.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import secrets
import sys
import threading
import time
from pathlib import Path

import pytest

from pdmesh.loadtest import chaos
from pdmesh.loadtest.soak import run as soak_run
from pdmesh.loadtest.soak.pool import check_pools
from pdmesh.services.runtime import redact
from tests.support.meshproc import Mesh, mesh_env, run_mesh

ENABLED = os.environ.get("PDMESH_CHAOS_TESTS") == "1"
DURATION_S = float(os.environ.get("PDMESH_CHAOS_DURATION_S") or 180)
WORKERS = {"prefill": 2, "decode": 2}
MESH_ARGS = ("--prefill", "2", "--decode", "2", "--kv-tokens", "4096", "--restart", "always")
CONCURRENCY = 4  # two cores run the mesh, the soak and its oracle
# No kill this close to the soak's end: the last worker killed is back before the soak's
# own pool check (a restart waits out the heartbeat TTL, then loads the model).
LAST_KILL_MARGIN_S = 30.0
BACK_TIMEOUT_S = 90.0

pytestmark = [
    pytest.mark.mesh,
    pytest.mark.slow,
    pytest.mark.skipif(not ENABLED, reason="chaos run (minutes): make test-chaos "
                                           "(PDMESH_CHAOS_TESTS=1)"),
]


def _seed() -> int:
    raw = os.environ.get("PDMESH_CHAOS_SEED", "")
    return int(raw) if raw else secrets.randbelow(1 << 31)


def _soak_argv(mesh: Mesh, seed: int, out_dir: Path) -> list[str]:
    return ["--base-url", mesh.base_url, "--api-keys", ",".join(mesh.api_keys),
            "--duration", f"{DURATION_S:g}", "--concurrency", str(CONCURRENCY),
            "--seed", str(seed), "--min-len", "32", "--max-len", "512", "--min-tokens", "8",
            "--max-tokens", "32", "--fault-fraction", "0", "--request-timeout", "60",
            "--drain-timeout", "60", "--output-dir", str(out_dir), "--label", f"soak-{seed}",
            "--nats-url", mesh.nats_url, "--pool-settle", "30"]


def _verdict(soak: dict, code: int, killer: chaos.Killer, all_back: bool, pool: dict,
             moved: dict) -> list[str]:
    """Every pass criterion that failed, as one line each."""
    out = []
    if code != soak_run.EXIT_OK:
        out.append(f"soak exited {code}: {soak.get('failures')}")
    if soak["failed_admitted"]:
        out.append(f"{soak['failed_admitted']} admitted requests failed")
    if soak["oracle_mismatches"]:
        out.append(f"{soak['oracle_mismatches']} oracle mismatches")
    if soak["oracle_checked"] != soak["served"]:
        out.append(f"{soak['served'] - soak['oracle_checked']} served replies not checked")
    if not killer.kills:
        out.append("no worker was killed")
    out += killer.problems
    if not all_back:
        out.append(f"workers not all back {BACK_TIMEOUT_S:g}s after the soak")
    if not pool.get("checked") or pool["leaked_leases"] or pool["integrity_failures"]:
        out.append(f"pool check: {pool.get('error') or ''} leaked leases "
                   f"{pool.get('leaked_leases')}, integrity failures "
                   f"{pool.get('integrity_failures')}")
    if len(pool.get("workers", ())) != sum(WORKERS.values()) or pool.get("unanswered"):
        out.append(f"pool check heard {len(pool.get('workers', ()))} workers, "
                   f"{pool.get('unanswered')} without stats")
    if not moved["migrated_total"]:
        out.append("the gateway counted no migration")
    if moved["failed_total"]:
        out.append(f"{moved['failed_total']} migrations failed: {moved['failed']}")
    return out


@pytest.mark.timeout(int(DURATION_S) + 420)
def test_no_admitted_request_fails_while_workers_are_killed_and_restarted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = _seed()
    out_dir = Path(os.environ.get("PDMESH_CHAOS_OUT") or tmp_path)
    print(f"\nchaos: seed {seed} (replay: PDMESH_CHAOS_SEED={seed} make test-chaos); soak "
          f"{DURATION_S:g}s at concurrency {CONCURRENCY}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with run_mesh(*MESH_ARGS, env=mesh_env(), ready_timeout=180) as mesh:
        before = chaos.scrape(mesh.metrics_url)
        killer = chaos.Killer(mesh.nats_url, WORKERS, seed,
                              until_s=DURATION_S - LAST_KILL_MARGIN_S,
                              recover_timeout_s=BACK_TIMEOUT_S,
                              owns=lambda pid: pid in mesh.child_pids())
        monkeypatch.setattr(soak_run, "Tally",
                            functools.partial(chaos.RecordingTally, t0=killer.t0))
        stop = threading.Event()
        thread = threading.Thread(target=killer.run, args=(stop,), name="chaos-killer",
                                  daemon=True)
        thread.start()
        try:
            code = soak_run.main(_soak_argv(mesh, seed, out_dir))
        finally:
            stop.set()
            thread.join(BACK_TIMEOUT_S + 10)
        all_back = killer.wait_all_back(BACK_TIMEOUT_S) is not None
        pool = asyncio.run(check_pools(mesh.nats_url, settle_s=20))
        moved = chaos.migrations(before, chaos.scrape(mesh.metrics_url))
        log = list(mesh.log)
    soak_file = out_dir / f"soak-{seed}.json"
    assert soak_file.exists(), f"the soak saved no results (exit {code}):\n" + "\n".join(
        log[-40:])
    soak = json.loads(soak_file.read_text())
    soak.pop("config", None)
    kills = killer.report()
    soak["failed_requests"] = chaos.after_kills(soak["failed_requests"], kills["kills"])
    problems = _verdict(soak, code, killer, all_back, pool, moved)
    log_path = out_dir / f"mesh-{seed}.log"
    log_path.write_text(redact.redact("\n".join(log)) + "\n")
    log_path.chmod(0o600)
    result = {
        "ok": not problems, "problems": problems, "seed": seed,
        "replay": f"PDMESH_CHAOS_SEED={seed} make test-chaos",
        "mesh": ["pdmesh", "up", "--model", "tiny", *MESH_ARGS],
        "elapsed_s": round(time.monotonic() - t0, 1), "mesh_log": str(log_path),
        "kills": kills["kills"], "killer": {k: v for k, v in kills.items() if k != "kills"},
        "migrations": moved, "pool_check_after_restarts": pool, "soak": soak,
    }
    path = out_dir / f"chaos-{seed}.json"
    soak_run.write_results(path, result)
    print(json.dumps(soak_run.scrub(result), indent=2))
    print(f"chaos: results saved to {path}; the mesh's log to {log_path}", file=sys.stderr)
    warnings = [line for line in log if "WARNING" in line or "ERROR" in line]
    assert not problems, "\n".join([*problems, "mesh log (warnings and errors, last 40):",
                                    *warnings[-40:]])
