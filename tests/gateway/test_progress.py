"""The gateway's liveness is progress, not a fixed deadline, and it measures the phases of
the time to first token.

A real gateway (in this process) on a real nats-server, in front of a scripted mesh
(tests/support/scripted_mesh.py): the test answers admission's submit itself and plays
prefill and decode on the request's token stream with exactly the timing each case needs
(a prefill that reports progress for longer than --prefill-stall-s, one that goes quiet, a
decode that stops sending tokens). The same
rules on a real mesh are in tests/gateway/test_long_prompt.py.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from pdmesh.gateway.app import Gateway
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import (
    PREFILL,
    Running,
    ScriptedMesh,
    gateways,
    heard_workers,
)

STALL_S = 0.6  # --prefill-stall-s and --request-timeout-s of the gateway under test


@pytest.fixture
async def scripted(nats_server: NatsServer) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    async with gateways(nats_server.url) as start:
        yield functools.partial(start, prefill_stall_s=STALL_S, request_timeout_s=STALL_S)



def _value(sample: dict, name: str) -> float:
    return sample.get((name, frozenset({"model_name": "tiny"}.items())), 0.0)


async def test_progress_keeps_a_long_prefill_alive_and_tokens_keep_a_long_generation(
        scripted) -> None:
    """Prefill reports progress for 4x --prefill-stall-s, then tokens flow for 4x
    --request-timeout-s: nothing is cut, because something arrives well within each limit.
    The phase timings come in (PhaseTiming after the last token: the stream lingers)."""
    tokens = 8

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.progress_for(rid, 4 * STALL_S)
        await mesh.token(rid, 0, decode_first_token_s=0.004)
        for seq in range(1, tokens):
            await asyncio.sleep(0.3)
            await mesh.token(rid, seq, finish=seq == tokens - 1)
        await asyncio.sleep(0.1)
        await mesh.send(rid, m.PhaseTiming(request_id=rid, queue_s=0.25, prefill_s=2.0,
                                           transfer_s=0.5, exposed_transfer_s=0.125))

    run = await scripted(script)
    before = await run.metrics()
    status, reply, elapsed = await run.post({"prompt": "hello", "max_tokens": tokens})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == "a" * tokens
    assert elapsed > 4 * STALL_S + 0.3 * (tokens - 1)  # longer than either limit, many times
    assert run.mesh.aborts == []  # finished cleanly
    deadline = time.monotonic() + 3
    while True:
        after = await run.metrics()
        count = "pdmesh:request_kv_transfer_time_seconds_count"
        if _value(after, count) > _value(before, count) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    for name, seconds in (("request_prefill_queue_time_seconds", 0.25),
                          ("request_prefill_compute_time_seconds", 2.0),
                          ("request_kv_transfer_time_seconds", 0.5),
                          ("request_kv_transfer_exposed_time_seconds", 0.125),
                          ("request_decode_first_token_time_seconds", 0.004)):
        full = f"pdmesh:{name}"
        assert _value(after, full + "_count") - _value(before, full + "_count") == 1, name
        assert math.isclose(_value(after, full + "_sum") - _value(before, full + "_sum"),
                            seconds), name


async def test_a_prefill_that_goes_quiet_ends_the_request_after_the_stall_limit(
        scripted) -> None:
    """Progress, then nothing: a 504 `deadline` after --prefill-stall-s of silence (not after
    --request-timeout-s, not never), saying where it stalled, and an Abort for the mesh."""

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.progress_for(rid, 1.0)  # then silence, worker heartbeats still alive

    run = await scripted(script, request_timeout_s=30.0)
    status, reply, elapsed = await run.post({"prompt": "hello", "max_tokens": 4})
    assert status == 504, reply
    assert reply["error"]["code"] == "deadline"
    assert "no progress" in reply["error"]["message"]
    assert "--prefill-stall-s" in reply["error"]["message"]
    assert PREFILL in reply["error"]["message"]
    last_progress_at = 0.8  # five reports, 0.2 s apart
    assert last_progress_at + STALL_S - 0.1 < elapsed < last_progress_at + STALL_S + 2.0
    await asyncio.sleep(0.2)
    assert run.mesh.aborts == [run.mesh.submits[0].request_id]
    after = await run.metrics()
    key = ("pdmesh:requests_total", frozenset({"model_name": "tiny", "tenant": "alice",
                                               "outcome": "failed",
                                               "reason": "deadline"}.items()))
    assert after.get(key) == 1


async def test_a_stream_that_stops_after_its_first_token_ends_after_the_idle_limit(
        scripted) -> None:
    """Tokens, then nothing (decode alive by its heartbeats): the stream ends with an
    error event after --request-timeout-s of silence, not --prefill-stall-s."""

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.token(rid, 0)
        await mesh.token(rid, 1)

    run = await scripted(script, prefill_stall_s=30.0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http, http.post(
            run.base + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True},
            headers={"Authorization": "Bearer sk-dev-alice"}) as resp:
        assert resp.status == 200
        body = (await resp.read()).decode()
    elapsed = time.monotonic() - t0
    assert '"code":"deadline"' in body and "no token" in body, body
    assert "--request-timeout-s" in body
    assert STALL_S - 0.1 < elapsed < STALL_S + 2.0


async def test_a_control_message_over_nats_max_payload_is_a_clear_413(tmp_path: Path) -> None:
    """A NATS with a smaller max_payload than the mesh sets (an operator's own server): a
    prompt within the served context whose submit would not fit is a 413 that says so,
    never the generic 500, and nothing reaches admission."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 65536\n")
    server = NatsServer(config=conf).start()
    import nats

    nc = await nats.connect(server.url)

    async def answer(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.token(rid, 0, finish=True)

    mesh = ScriptedMesh(nc, answer, served_context=1 << 18)
    gw: Gateway | None = None
    try:
        await mesh.start()
        gw = Gateway(resolve("gateway", {"model": "tiny", "nats_url": server.url,
                                         "http_host": "127.0.0.1", "http_port": 0}, {}))
        await gw.start()
        await heard_workers(gw)
        run = Running(gw, mesh)
        for path, body in (("/v1/completions", {"prompt": "x" * 70_000, "max_tokens": 4}),
                           ("/v1/completions", {"prompt": [200] * 40_000, "max_tokens": 4}),
                           ("/v1/chat/completions", {"max_tokens": 4, "messages": [
                               {"role": "user", "content": "y" * 70_000}]})):
            status, reply, _ = await run.post(body, path)
            assert status == 413, reply
            assert reply["error"]["code"] == "request_too_large"
            assert "max_payload of 65536 bytes" in reply["error"]["message"]
        status, reply, _ = await run.post({"prompt": "x" * 1000, "max_tokens": 1})
        assert status == 200, reply  # a small one goes through
    finally:
        if gw is not None:
            await gw.rt.drain("test over")
        await mesh.close()
        await nc.close()
        server.stop()
    assert len(mesh.submits) == 1


def test_phase_histograms_take_only_sane_figures() -> None:
    """A worker's PhaseTiming is input: negative or non-finite figures are not observed."""
    metrics = GatewayMetrics(CollectorRegistry(), "tiny")
    metrics.observe_phases(m.PhaseTiming(request_id="r", queue_s=0.5, prefill_s=-1.0,
                                         transfer_s=math.nan, exposed_transfer_s=math.inf))
    assert metrics.prefill_queue.labels("tiny")._sum.get() == 0.5
    metrics.observe_decode_first_token(-0.1)
    metrics.observe_decode_first_token(0.25)
    assert metrics.decode_first_token.labels("tiny")._sum.get() == 0.25
    for hist in (metrics.prefill_compute, metrics.kv_transfer, metrics.kv_transfer_exposed):
        assert hist.labels("tiny")._sum.get() == 0
