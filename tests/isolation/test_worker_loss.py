"""Workers killed (kill -9) mid-transfer and mid-stream, and nats-server restarted under load:
a request whose worker dies resumes on the surviving ones with the oracle's tokens (never a
hang, never another request's tokens), the surviving side frees the lost attempt's pages,
and the mesh serves correctly afterwards. A decode
worker that answers a reservation too late costs the request nothing."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from pdmesh.loadtest.client import SSEParser
from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, NatsServer, mesh_env, run_mesh
from tests.support.meshstats import assert_pools_clean, by_role, query_stats, worker_stats
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def big_mesh(nats: NatsServer) -> Iterator[Mesh]:
    env = mesh_env(PDMESH_ALLOW_FAULTS="1", PDMESH_FAULTS="request_faults",
                   PDMESH_TRANSFER_DEADLINE_S="5")
    with run_mesh("--nats-url", nats.url, "--keep-going", "--prefill", "2", "--decode", "2",
                  "--kv-tokens", "4096", env=env, ready_timeout=180) as mesh:
        mesh.nats_url = nats.url
        yield mesh


def _open_stream(mesh: Mesh, body: dict, fault: str = "") -> tuple[object, str]:
    headers = {"Authorization": "Bearer sk-dev-alice", "Content-Type": "application/json"}
    if fault:
        headers["X-Pdmesh-Fault"] = fault
    req = urllib.request.Request(f"{mesh.base_url}/chat/completions", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers=headers)
    resp = urllib.request.urlopen(req, timeout=30)
    first = resp.readline()
    while not first.startswith(b"data: "):
        first = resp.readline()
    return resp, json.loads(first[6:])["id"]


def _rest(resp: object) -> list[dict]:
    parser = SSEParser()
    return [json.loads(data) for raw in resp  # type: ignore[attr-defined]
            for data in parser.feed(raw) if data != "[DONE]"]


def _workers(mesh: Mesh, role: m.Role) -> list[tuple[m.Role, str]]:
    return [(role, s.worker_id) for s in by_role(worker_stats(mesh.nats_url), role)]


def _holder(mesh: Mesh, workers: list[tuple[m.Role, str]], rid: str) -> m.StatsReply:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for s in query_stats(mesh.nats_url, workers):
            if rid in s.leased_requests:  # serving it, not only heard of it
                return s
    raise AssertionError(f"no worker of {workers} holds a lease for {rid}")


def _serves_correctly(mesh: Mesh) -> None:
    deadline = time.monotonic() + 20
    status, body = 0, {}
    while time.monotonic() < deadline:
        status, body = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": "after the loss", "max_tokens": 6, "temperature": 0})
        if status == 200:
            break
        time.sleep(0.5)
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text("after the loss", 6)


def test_a_decode_answering_after_the_reserve_timeout_costs_the_request_nothing(
        big_mesh: Mesh) -> None:
    """`slow_reserve`: the first decode worker asked reserves, but answers only after
    admission's reserve timeout (2 s), as a worker whose NATS link is just coming back
    does (the multi-host lab's host-cut scenario hit it). Admission cancels that
    reservation on that worker alone (`ReserveCancel`) and places the request on the other
    decode: the client gets the oracle's answer, and no lease is left anywhere. Before,
    admission broadcast an Abort of the request: the late worker published a failure on
    the request's token stream and the client got 502 although the retry had placed it."""
    prompt = "a reservation answered late " * 3
    started = time.monotonic()
    status, body = big_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0},
        headers={"X-Pdmesh-Fault": "slow_reserve"})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(prompt, 6)
    assert time.monotonic() - started >= 2.0  # the first reserve really went unanswered
    assert_pools_clean(big_mesh.nats_url)  # the late reservation freed, not left to time out


def _content(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e.get("choices"))


def test_prefill_killed_mid_transfer(big_mesh: Mesh) -> None:
    """kill -9 the prefill while its transfer is stalled half-way: decode sees the data
    plane's peer lost and frees the reservation, the gateway resumes the request on the
    other prefill worker (not with the lost one's fault), and the client gets the oracle's
    whole answer on the same stream. Before, the client got an error."""
    prefills = _workers(big_mesh, m.Role.PREFILL)
    prompt = "killed mid transfer " * 6
    resp, rid = _open_stream(big_mesh, {"model": "tiny", "max_tokens": 8, "messages": [
        {"role": "user", "content": prompt}], "temperature": 0}, fault="stall")
    victim = _holder(big_mesh, prefills, rid)
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    events = _rest(resp)
    assert time.monotonic() - t0 < 15.0
    assert events and "error" not in events[-1], events[-3:]
    assert _content(events) == reference("tiny").expected(prompt, 8, "chat").text
    time.sleep(3.5)  # admission drops the dead worker after its heartbeat TTL
    assert_pools_clean(big_mesh.nats_url)
    _serves_correctly(big_mesh)


def test_decode_killed_mid_stream(big_mesh: Mesh) -> None:
    """kill -9 the decode worker while it streams a seeded sample: the gateway notices the
    missing heartbeats and resumes the stream on the other decode worker from the tokens it
    had sent; the client's one stream carries exactly the oracle's tokens for that seed.
    Before, it ended with an error."""
    decodes = _workers(big_mesh, m.Role.DECODE)
    prompt = "killed mid stream"
    resp, rid = _open_stream(big_mesh, {"model": "tiny", "max_tokens": 160, "messages": [
        {"role": "user", "content": prompt}], "temperature": 0.9, "seed": 1234})
    victim = _holder(big_mesh, decodes, rid)
    # Mid-stream: wait until tokens flow (the KV has arrived and decode is generating).
    parser, before = SSEParser(), []
    while len([e for e in before if _content([e])]) < 5:
        line = resp.readline()  # type: ignore[attr-defined]
        assert line, "the stream ended before decode was killed"
        before += [json.loads(d) for d in parser.feed(line) if d != "[DONE]"]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.monotonic()
    events = before + _rest(resp)
    assert time.monotonic() - t0 < 30.0
    assert "error" not in events[-1], events[-3:]
    oracle = reference("tiny")
    sampling = m.Sampling(temperature=0.9, seed=1234)
    assert _content(events) == oracle.answer(oracle.prompt_ids(prompt, "chat"), 160,
                                             sampling).text
    time.sleep(3.5)
    assert_pools_clean(big_mesh.nats_url)
    _serves_correctly(big_mesh)


def test_nats_restart_mid_load(big_mesh: Mesh, nats: NatsServer) -> None:
    """Requests in flight while nats-server restarts either finish with the right tokens
    or fail cleanly; afterwards the mesh serves the oracle's answer again."""
    prompts = [f"load {i} " * (5 + i) for i in range(6)]

    def one(prompt: str) -> tuple[int, dict]:
        return big_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0},
            timeout=60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {pool.submit(one, p): p for p in prompts}
        time.sleep(0.3)
        nats.stop()
        time.sleep(2)
        nats.start()
        results = [(futures[f], *f.result()) for f in futures]
    for prompt, status, body in results:
        if status == 200:
            assert body["choices"][0]["text"] == expected_text(prompt, 24), prompt
        else:
            assert 500 <= status < 600 and "error" in body, (status, body)
    _serves_correctly(big_mesh)
    assert_pools_clean(big_mesh.nats_url, timeout_s=10)
