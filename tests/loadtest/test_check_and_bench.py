"""`pdmesh check` against the real mesh, and `pdmesh bench admission` end to end.

The shared `live_mesh` runs `pdmesh up --model tiny --kv-tokens 4096`; the tiny model is
configured for 65536 tokens, so every worker clamps to its 4096-token pool (I5) and
`pdmesh check` must say so and exit 1. No speed assertions here: targets live in the bench.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import LIVE_MESH_KV_TOKENS
from tests.support.meshproc import REPO, Mesh, mesh_env

pytestmark = pytest.mark.slow


def pdmesh(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", *args], cwd=REPO,
                          env=mesh_env(**env), capture_output=True, text=True, timeout=timeout,
                          check=False)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.mesh
def test_check_shows_the_clamp_on_the_live_mesh(live_mesh: Mesh) -> None:
    res = pdmesh("check", "--json", "--listen-s", "2", PDMESH_NATS_URL=live_mesh.nats_url)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    report = last_json(res.stdout)
    assert report["exit_code"] == 1 and report["ok"] is False
    assert report["counts"]["prefill"] >= 1 and report["counts"]["decode"] >= 1
    for w in report["workers"]:
        assert w["model"] == "tiny"
        assert w["configured_context"] == 65536 > w["pool_capacity_tokens"]
        assert w["pool_capacity_tokens"] == LIVE_MESH_KV_TOKENS
        assert w["served_context"] == LIVE_MESH_KV_TOKENS
        assert w["capacity_mismatch"] is True and w["flagged_by_worker"] is True
        assert w["mismatch"] == "CLAMPED"
        assert w["data_address"].startswith("tcp://127.0.0.1:")
        # Dialled from this host: every data plane answers.
        assert w["data_plane"]["reachable"] is True, w["data_plane"]
        assert 0 <= w["free_tokens"] <= w["pool_capacity_tokens"]
        # The stats request/reply answered: pool intact, page counts consistent.
        stats = w["stats"]
        assert stats is not None, w["stats_error"]
        assert stats["integrity_ok"] is True
        assert (stats["leased_pages"] + stats["free_pages"] + stats["cached_pages"]
                == stats["total_pages"] > 0)
    assert sorted(report["mismatches"]) == sorted(w["worker_id"] for w in report["workers"])
    assert report["unreachable"] == []
    # Loud in the human table too.
    assert "!! CLAMPED !!" in res.stdout
    assert "!! CAPACITY CHECK:" in res.stdout


def test_check_with_nothing_listening_exits_2_in_one_line() -> None:
    from pdmesh.services.ops.launcher import free_port

    res = pdmesh("check", "--connect-timeout-s", "1",
                 PDMESH_NATS_URL=f"nats://127.0.0.1:{free_port()}")
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "unreachable" in res.stderr
    assert "Traceback" not in res.stderr


def test_check_on_a_nats_without_workers_exits_2(nats_server) -> None:
    res = pdmesh("check", "--json", "--listen-s", "0.7", PDMESH_NATS_URL=nats_server.url)
    assert res.returncode == 2
    assert "no worker answered" in res.stderr and "Traceback" not in res.stderr
    assert last_json(res.stdout)["workers"] == []


def test_bench_admission_json_has_sane_figures() -> None:
    res = pdmesh("bench", "admission", "--json", "--duration-s", "1.5", "--latency-s", "1",
                 "--no-workers-s", "0.3", "--concurrency", "8", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    r = last_json(res.stdout)
    assert r["bench"] == "admission"
    assert r["decisions_per_s"] > 0 and r["concurrency"] == 8
    lat = r["rejection_latency_ms"]
    for source in ("client_rtt", "server"):
        s = lat[source]
        assert s["n"] > 0
        assert 0 < s["median_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]
    # The service's own timer sits inside the client's round trip.
    assert lat["server"]["median_ms"] <= lat["client_rtt"]["median_ms"]
    h = lat["histogram"]
    assert h["n"] == lat["server"]["n"]  # the /metrics histogram saw every rejection
    assert h["median_ms"] is not None and h["median_ms"] <= h["p90_ms"] <= h["p99_ms"]
    assert r["target_median_ms"] == 2.0 and isinstance(r["target_met"], bool)
    phases = r["phases"]
    assert set(phases) == {"no_workers", "throughput", "latency"}
    assert set(phases["no_workers"]["reasons"]) == {"no_workers"}
    assert set(phases["throughput"]["reasons"]) == {"context_length_exceeded",
                                                   "prompt_exceeds_prefill_pool"}
    for p in phases.values():
        assert p["errors"] == 0 and p["unexpected"] == []
        assert p["requests"] == p["client_rtt"]["n"] > 0
    # I1: no rejection reached anything past the decision.
    assert r["i1"] == {"tickets_issued": 0, "reservations": 0, "dispatches": 0,
                       "worker_messages": 0, "violations": 0}
    assert "decisions/s" in res.stdout and "median ms" in res.stdout
