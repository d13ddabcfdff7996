"""Graceful drain of a decode worker mid-stream (SIGTERM), on real processes.

The mesh (`pdmesh up`, 1 prefill + 1 small decode) is joined by two decode workers this
test starts itself (`pdmesh serve decode`, so their exit codes are its own to read) with the
only pools large enough for the test's requests: a stream lands on one of them, the other is
where it can go. SIGTERM to the one holding the stream:
- within its drain timeout the stream finishes there, with the oracle's tokens, and the
  worker exits 0 once it has;
- past its timeout the worker hands the request off (`worker_drained`), the gateway resumes
  it on the other worker from the tokens the client has, and the client's one stream still
  carries exactly the oracle's tokens (seeded sampling); the worker exits 0.
Runs under `make test-chaos`. Before, SIGTERM cancelled every task: the stream ended with
`internal` ("cannot schedule new futures after shutdown").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from pdmesh.loadtest.client import SSEParser
from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import REPO, Mesh, NatsServer, mesh_env, run_mesh
from tests.support.meshstats import assert_pools_clean, query_stats, worker_stats

pytestmark = [pytest.mark.mesh, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("PDMESH_CHAOS_TESTS") != "1",
                                 reason="real drains (a minute): make test-chaos")]

MESH_KV_TOKENS = 512  # the mesh's own decode: too small for the test's requests
OWN_KV_TOKENS = 4096
MAX_TOKENS = 700  # prompt + this > MESH_KV_TOKENS: only the test's decode workers fit it


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mesh(nats: NatsServer) -> Iterator[Mesh]:
    with run_mesh("--nats-url", nats.url, "--keep-going", "--kv-tokens", str(MESH_KV_TOKENS),
                  ready_timeout=180) as mesh:
        mesh.nats_url = nats.url
        yield mesh


def _decode(mesh: Mesh, worker_id: str, drain_timeout_s: float) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdmesh.services.ops.cli", "serve", "decode",
           "--nats-url", mesh.nats_url, "--worker-id", worker_id, "--model", "tiny",
           "--kv-tokens", str(OWN_KV_TOKENS), "--http-port", "0",
           "--drain-timeout-s", str(drain_timeout_s)]
    env = mesh_env(PDMESH_VERIFY_KEY=mesh.verify_key, PDMESH_LOG_LEVEL="INFO")
    env.pop("PDMESH_SIGNING_KEY", None)
    env.pop("PDMESH_SALT_KEY", None)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


@pytest.fixture
def decodes(mesh: Mesh, request: pytest.FixtureRequest) -> Iterator[dict[str, subprocess.Popen]]:
    drain_timeout_s = request.param
    tag = "long" if drain_timeout_s > 5 else "short"
    procs = {f"dd-{tag}-{i}": _decode(mesh, f"dd-{tag}-{i}", drain_timeout_s) for i in range(2)}
    with ExitStack() as stack:
        for proc in procs.values():
            stack.callback(_stop, proc)
        deadline = time.monotonic() + 120
        while set(procs) - set(worker_stats(mesh.nats_url)):
            assert time.monotonic() < deadline, "the test's decode workers never came up"
            assert all(p.poll() is None for p in procs.values()), "a decode worker exited"
        yield procs


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    if proc.stderr is not None:
        proc.stderr.close()


def _stream(mesh: Mesh, body: dict) -> object:
    req = urllib.request.Request(
        f"{mesh.base_url}/completions", method="POST",
        data=json.dumps({"model": "tiny", "stream": True, **body}).encode(),
        headers={"Authorization": "Bearer sk-dev-alice", "Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)


def _events(resp: object, parser: SSEParser, until_text_chunks: int | None = None
            ) -> list[dict]:
    """Read the stream to its end, or until that many chunks with text."""
    events: list[dict] = []
    for raw in resp:  # type: ignore[attr-defined]
        events += [json.loads(d) for d in parser.feed(raw) if d != "[DONE]"]
        if until_text_chunks is not None and sum(
                1 for e in events if e.get("choices") and e["choices"][0].get("text")
        ) >= until_text_chunks:
            break
    return events


def _text(events: list[dict]) -> str:
    return "".join(e["choices"][0].get("text") or "" for e in events if e.get("choices"))


def _holder(mesh: Mesh, procs: dict[str, subprocess.Popen], rid: str) -> str:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for s in query_stats(mesh.nats_url, [(m.Role.DECODE, w) for w in procs]):
            if rid in s.leased_requests:  # serving it, not only heard of it
                return s.worker_id
    raise AssertionError(f"none of {sorted(procs)} holds a lease for {rid}")


def _drain_mid_stream(mesh: Mesh, procs: dict[str, subprocess.Popen], body: dict
                      ) -> tuple[str, list[dict], subprocess.Popen, float]:
    resp = _stream(mesh, body)
    parser = SSEParser()
    before = _events(resp, parser, until_text_chunks=5)
    holder = _holder(mesh, procs, before[0]["id"])
    procs[holder].send_signal(signal.SIGTERM)
    termed_at = time.monotonic()
    events = before + _events(resp, parser)
    return holder, events, procs[holder], termed_at


@pytest.mark.parametrize("decodes", [30.0], indirect=True)
def test_sigterm_lets_the_stream_finish_then_exits_0(mesh: Mesh, decodes) -> None:
    prompt = "drained while streaming"
    holder, events, proc, termed_at = _drain_mid_stream(
        mesh, decodes, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert "error" not in events[-1], events[-3:]
    assert _text(events) == reference("tiny").expected(prompt, MAX_TOKENS).text
    assert proc.wait(30) == 0, f"{holder} exit code"
    assert time.monotonic() - termed_at < 30
    log = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "1 in flight at its start, 0 handed on, 0 cut" in log, log[-2000:]
    metrics = urllib.request.urlopen(mesh.metrics_url, timeout=5).read().decode()
    assert "pdmesh:requests_migrated_total{" not in metrics  # it finished where it was
    assert_pools_clean(mesh.nats_url)


# A short drain: the tokens generated within it go into the resumed prompt, which must fit
# the mesh's prefill pool (MESH_KV_TOKENS); a second of tiny's decode can fill it alone.
@pytest.mark.parametrize("decodes", [0.3], indirect=True)
def test_sigterm_past_the_drain_timeout_resumes_on_the_other_worker(mesh: Mesh,
                                                                    decodes) -> None:
    prompt = "drained past its timeout"
    sampling = m.Sampling(temperature=0.8, seed=4321, ignore_eos=True)
    holder, events, proc, _ = _drain_mid_stream(
        mesh, decodes, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.8,
                        "seed": 4321, "ignore_eos": True})
    assert "error" not in events[-1], events[-3:]
    oracle = reference("tiny")
    expected = oracle.answer(oracle.prompt_ids(prompt), MAX_TOKENS, sampling)
    assert expected.num_tokens == MAX_TOKENS  # outlasts the drain timeout
    assert _text(events) == expected.text
    assert proc.wait(30) == 0, f"{holder} exit code"
    log = proc.stderr.read().decode()  # type: ignore[union-attr]
    assert "1 handed on, 0 cut" in log, log[-2000:]
    metrics = urllib.request.urlopen(mesh.metrics_url, timeout=5).read().decode()
    migrated = [line for line in metrics.splitlines()
                if line.startswith("pdmesh:requests_migrated_total{")]
    assert any('from_role="decode"' in line and 'cause="worker_drained"' in line
               for line in migrated), migrated
    assert_pools_clean(mesh.nats_url)
