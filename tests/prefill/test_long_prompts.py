"""Long prompts end to end, on a real mesh (`pdmesh up`, tiny model). They take about a
minute, so they run in `make test-long` (PDMESH_LONG_TESTS=1), not in `make test`.

Liveness is progress, not a deadline: the mesh below gives up on a prefill that reports no
progress for STALL_S, yet serves prompts whose prefill takes longer than that. Prompts run
one chunk per turn, started prompts take turns, and the KV streams as chunks finish. The
tiny model's tokenizer is byte-level: a prompt of N characters is about N tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, mesh_env, run_mesh
from tests.support.meshstats import assert_pools_clean, by_role, counter, worker_stats
from tests.support.oracle import expected_text

pytestmark = [
    pytest.mark.mesh, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                       reason="long-prompt scenarios (a minute): make test-long "
                       "(PDMESH_LONG_TESTS=1)"),
]

STALL_S = 1.5  # --prefill-stall-s of this mesh (a 512-token chunk takes far less)
LONGER = 12000  # tokens: 24 chunks, a prefill of several STALL_S
LONGEST = 16000  # tokens: 32 chunks, for an abort to land mid-prefill


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    # 32k: the long prompt stays within the dev tenant's kv_share (half the decode KV), so
    # the same tenant's short prompt is admitted beside it.
    with run_mesh("--kv-tokens", "32768",
                  env=mesh_env(PDMESH_PREFILL_STALL_S=str(STALL_S))) as mesh:
        yield mesh


def complete(mesh: Mesh, prompt: str, max_tokens: int) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=120)
    return status, body, time.monotonic() - started


def computed_tokens(mesh: Mesh) -> float:
    return counter(worker_stats(mesh.nats_url, listen_s=0.6), m.Role.PREFILL, "prompt_tokens")


def test_a_prefill_longer_than_the_stall_limit_completes_with_the_oracle(mesh: Mesh) -> None:
    # The whole prefill takes longer than STALL_S; each chunk far less. A fixed deadline
    # would cut every prompt whose prefill outlasted it.
    prompt = "a long prompt streams its KV chunk by chunk. " * (LONGER // 45)
    status, body, elapsed = complete(mesh, prompt, 4)
    assert status == 200, body
    assert elapsed > STALL_S, f"prefill took {elapsed:.1f}s: too fast to prove anything"
    assert body["choices"][0]["text"] == expected_text(prompt, 4)  # streamed KV, same bits
    assert_pools_clean(mesh.nats_url)


def test_a_short_prompt_overtakes_a_long_one(mesh: Mesh) -> None:
    long_prompt = "x" * LONGER
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_job = pool.submit(complete, mesh, long_prompt, 2)
        time.sleep(0.3)  # the long prefill is under way (a few of its chunks at most)
        status, body, short_s = complete(mesh, "short prompt", 2)
        long_status, long_body, long_s = long_job.result(timeout=120)
    assert status == 200 and long_status == 200, (body, long_body)
    assert body["choices"][0]["text"] == expected_text("short prompt", 2)
    # Chunk-level turns: the short prompt waited for a chunk of the long one, not all of
    # it (first come first served, it would wait for the whole long prefill).
    assert short_s < (long_s - 0.3) / 3, (short_s, long_s)
    assert long_body["choices"][0]["text"] == expected_text(long_prompt, 2)
    assert_pools_clean(mesh.nats_url)


def _open_stream(mesh: Mesh, prompt: str) -> socket.socket:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", mesh.gateway_port), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer sk-dev-alice\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def test_an_abort_mid_prefill_stops_it_within_a_chunk_and_frees_the_leases(
        mesh: Mesh) -> None:
    before = computed_tokens(mesh)
    sock = _open_stream(mesh, "y" * LONGEST)
    deadline = time.monotonic() + 30
    while computed_tokens(mesh) == before:  # at least one chunk done
        assert time.monotonic() < deadline, "the prefill never started"
        time.sleep(0.05)
    sock.close()  # the client leaves mid-prefill
    assert_pools_clean(mesh.nats_url, timeout_s=5)
    stopped = computed_tokens(mesh)
    time.sleep(1.5)  # far longer than a chunk: nothing more is computed for it
    assert computed_tokens(mesh) == stopped
    assert stopped - before < LONGEST - 512, "the whole prompt was computed after the abort"


def test_a_frozen_prefill_worker_is_caught_by_heartbeats(mesh: Mesh) -> None:
    stats = worker_stats(mesh.nats_url)
    prefill = by_role(stats, m.Role.PREFILL)[0]
    before = computed_tokens(mesh)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(complete, mesh, "z" * LONGEST, 2)
        deadline = time.monotonic() + 30
        while computed_tokens(mesh) == before:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.05)
        os.kill(prefill.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            status, body, _ = job.result(timeout=60)
            ended = time.monotonic() - frozen_at
        finally:
            os.kill(prefill.pid, signal.SIGCONT)
    assert status >= 500, body  # a clear error, not a hang and not a 200
    # Within the worker TTL (3 s) or the stall limit, whichever comes first, plus slack.
    assert ended < STALL_S + 3.0, ended
    assert_pools_clean(mesh.nats_url, timeout_s=10)
