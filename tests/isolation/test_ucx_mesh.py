"""The same data-plane threats on a mesh whose KV moves over UCX (UCXX: `UCX_TLS=tcp`, and
unset as `pdmesh up` runs it: shared-memory lanes, `PDMESH_UCX_ERROR_MODE` auto -> none) or
NIXL (one-sided WRITE over its UCX): it serves the oracle, and a faulty transfer fails only
its own request."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator

import pytest

from pdmesh.transports._nixl_build import INSTALL_HINT, nixl_module
from tests.support.meshproc import Mesh, mesh_env, run_mesh
from tests.support.meshstats import assert_pools_clean
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]

_NO_UCXX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None,
                              reason="ucxx is not importable")
KINDS = [
    pytest.param("ucx", marks=[pytest.mark.ucx, _NO_UCXX]),
    pytest.param("ucx-shm", marks=[pytest.mark.ucx, _NO_UCXX]),
    pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
        nixl_module() is None, reason=f"no NIXL build is importable ({INSTALL_HINT})")]),
]
FAULTS = ["corrupt_payload", "stale_epoch", "stub_transfer", "drop_frame", "commit_first",
          "foreign_reservation"]


@pytest.fixture(scope="module", params=KINDS)
def transport_mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    env = mesh_env(PDMESH_ALLOW_FAULTS="1", PDMESH_FAULTS="request_faults",
                   PDMESH_TRANSFER_DEADLINE_S="5", UCX_TLS="tcp")
    if request.param == "ucx-shm":  # UCX picks its transports, shared memory among them
        env = {k: v for k, v in env.items() if k not in ("UCX_TLS", "PDMESH_UCX_ERROR_MODE")}
    kind = request.param.split("-")[0]
    with run_mesh("--transport", kind, "--kv-tokens", "4096", env=env) as mesh:
        yield mesh


PROMPT = "over the UCX-class data plane, " * 6


def test_the_mesh_serves_the_oracle(transport_mesh: Mesh) -> None:
    status, body = transport_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(PROMPT, 10)
    assert_pools_clean(transport_mesh.nats_url)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_faulty_transfer_fails_only_that_request(transport_mesh: Mesh, fault: str) -> None:
    status, body = transport_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={"X-Pdmesh-Fault": fault})
    assert status == 502 and body["error"]["code"] == "transfer_failed", (fault, body)
    status, body = transport_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected_text(PROMPT, 8)
    assert_pools_clean(transport_mesh.nats_url)


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_workers_do_not_spin_after_transfers(transport_mesh: Mesh) -> None:
    """After traffic, an idle decode worker keeps its pooled inbound link (a header receive
    stays posted). With ucxx polling every outstanding request from the event loop (no
    `UCXPY_ENABLE_PYTHON_FUTURE`, how services ran before), that idle worker used a whole
    core for as long as it lived (1.0 CPU-s per second, measured); services now run ucxx
    with its futures (`make_service_transport`)."""
    for _ in range(3):
        status, body = transport_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
    workers = [pid for pid in transport_mesh.child_pids()
               if b"serve\x00decode" in open(f"/proc/{pid}/cmdline", "rb").read()
               or b"serve\x00prefill" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(workers) >= 2, transport_mesh.child_pids()
    time.sleep(1.0)  # the requests' own work is over
    before = {pid: _cpu_s(pid) for pid in workers}
    started = time.monotonic()
    time.sleep(3.0)
    elapsed = time.monotonic() - started
    busy = {pid: (_cpu_s(pid) - cpu) / elapsed for pid, cpu in before.items()}
    # Heartbeats and NIXL's own progress calls cost a few percent; a spinning loop ~100 %.
    assert max(busy.values()) < 0.25, busy
