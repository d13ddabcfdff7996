"""The gateway's liveness rule on a real mesh (tiny model, 16k context): a prefill several
times longer than --prefill-stall-s and a generation longer than --request-timeout-s both
complete, because prefill's progress and decode's tokens keep arriving; a prefill frozen
mid-prompt (SIGSTOP, its heartbeats' TTL set far longer) ends the request with a 504 after
--prefill-stall-s. The same rules against a scripted mesh, with exact timing, are in
test_progress.py. The long prefill and generation run in `make test-long`."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.meshproc import Mesh, mesh_env, run_mesh

pytestmark = pytest.mark.mesh

STALL_S = 2.0  # --prefill-stall-s, and --request-timeout-s (silence after the first token)
CONTEXT = 16_384


@pytest.fixture(scope="module")
def slow_mesh() -> Iterator[Mesh]:
    with run_mesh("--max-context", str(CONTEXT), "--kv-tokens", str(CONTEXT + 256),
                  env=mesh_env(PDMESH_PREFILL_STALL_S=str(STALL_S),
                               PDMESH_REQUEST_TIMEOUT_S=str(STALL_S),
                               # Progress every heartbeat: four chances per stall limit.
                               PDMESH_HEARTBEAT_S="0.25", PDMESH_WORKER_TTL_S="60",
                               # One thread: the prompt takes several stall limits.
                               PDMESH_TORCH_THREADS="1")) as mesh:
        yield mesh


def _prompt(n: int, salt: int) -> list[int]:
    return [3 + (i * 7 + salt) % 240 for i in range(n)]


def _child(mesh: Mesh, service: str) -> int:
    for pid in mesh.child_pids():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"serve" in argv and service.encode() in argv:
            return pid
    raise AssertionError(f"no {service} process under pdmesh up")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                    reason="long prefill and generation: make test-long")
def test_a_prefill_and_a_generation_longer_than_the_limits_complete(slow_mesh: Mesh) -> None:
    t0 = time.monotonic()
    status, reply = slow_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": _prompt(CONTEXT - 64, 1), "max_tokens": 64,
        "min_tokens": 64, "temperature": 0}, timeout=300)
    elapsed = time.monotonic() - t0
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 64
    print(f"16k prompt + 64 tokens: {elapsed:.1f}s")
    assert elapsed > 3 * STALL_S, f"the prompt was too quick to prove anything: {elapsed:.1f}s"


@pytest.mark.slow
def test_a_frozen_prefill_ends_the_request_after_the_stall_limit(slow_mesh: Mesh) -> None:
    prefill = _child(slow_mesh, "prefill")
    result: dict = {}

    def post() -> None:
        t0 = time.monotonic()
        result["reply"] = slow_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": _prompt(CONTEXT - 64, 2), "max_tokens": 4},
            timeout=120)
        result["elapsed"] = time.monotonic() - t0

    client = threading.Thread(target=post)
    client.start()
    time.sleep(1.0)  # the prompt is being computed (several seconds of work)
    os.kill(prefill, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        client.join(30)
        waited = time.monotonic() - frozen_at
    finally:
        os.kill(prefill, signal.SIGCONT)
    assert not client.is_alive()
    status, reply = result["reply"]
    assert status == 504, reply
    assert reply["error"]["code"] == "deadline"
    # Decode (which holds the reservation) and the gateway both go by prefill's progress,
    # with the same limit: either may report it first, in the same words.
    assert "no progress" in reply["error"]["message"], reply
    # Caught by the stall limit, long before the heartbeats' 60 s TTL.
    assert waited < STALL_S + 10, waited
    # The mesh still serves once prefill runs again.
    status, reply = slow_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "after", "max_tokens": 2}, timeout=120)
    assert status == 200, reply
