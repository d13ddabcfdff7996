"""A gateway whose own event loop stalled never blames a live worker; a worker that really
stops heartbeating still fails its request.

A real gateway (in this process) on a real nats-server, in front of the scripted mesh of
tests/support/scripted_mesh.py on the same loop. The test blocks that loop (as a long
tokenization or a GC pause would) for twice --worker-ttl-s: when it resumes, the gateway
has processed no heartbeat for longer than the TTL, from anyone, and must not take that
for a dead worker. Workers that really stop heartbeating, one or all, still fail the
request about a TTL later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from pdmesh.gateway.app import Gateway
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import DECODE, PREFILL, ScriptedMesh, gateways

TTL_S = 0.5  # --worker-ttl-s of the gateway under test
TOKENS = 60  # one every 50 ms: a 3 s stream


@pytest.fixture
async def scripted(nats_server: NatsServer
                   ) -> AsyncIterator[Callable[..., Awaitable[tuple[Gateway, ScriptedMesh]]]]:
    async with gateways(nats_server.url) as start_mesh:

        async def start(script) -> tuple[Gateway, ScriptedMesh]:
            run = await start_mesh(script, heartbeat_s=0.1, worker_ttl_s=TTL_S,
                                   prefill_stall_s=10.0, request_timeout_s=10.0)
            await asyncio.sleep(TTL_S + 0.2)  # the gateway has listened for a whole TTL
            return run.gw, run.mesh

        yield start


async def _stream(gw: Gateway) -> tuple[int, list[bytes]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{gw.rt.http_port}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": TOKENS, "stream": True},
            headers={"Authorization": "Bearer sk-dev-bob"}) as resp:
        return resp.status, [line async for line in resp.content if line.startswith(b"data:")]


async def _tokens(mesh: ScriptedMesh, rid: str) -> None:
    for seq in range(TOKENS):
        await mesh.token(rid, seq, finish=seq == TOKENS - 1)
        await asyncio.sleep(0.05)


async def test_a_stalled_gateway_loop_does_not_fail_a_live_stream(scripted) -> None:
    """The loop blocks for 2x the TTL, twice, mid-stream: the stream must end with all its
    tokens, not with `worker_lost` ("worker dec-1 stopped heartbeating")."""
    gw, mesh = await scripted(_tokens)
    stream = asyncio.ensure_future(_stream(gw))
    for _ in range(2):
        await asyncio.sleep(0.6)  # tokens flowing
        time.sleep(2 * TTL_S)  # noqa: ASYNC251 - the loop stalls: blocking it is the test
    status, events = await stream
    assert status == 200
    assert not any(b'"error"' in e for e in events), events[-1]
    assert events[-1].strip() == b"data: [DONE]"
    assert mesh.aborts == []


async def test_a_pause_of_the_whole_machine_blames_no_worker(scripted) -> None:
    """Gateway and workers freeze together (a VM paused, the host swapping): when the
    gateway's loop resumes, no heartbeat or token is due yet (the workers' next come 0.3 s
    later), so a NATS round trip brings none. The gateway knows its own loop just stalled and
    waits for them instead of failing the stream."""

    thawed = asyncio.Event()

    async def frozen_with_the_gateway(mesh: ScriptedMesh, rid: str) -> None:
        for seq in range(TOKENS):
            if DECODE in mesh.silent:  # frozen: no token either
                await thawed.wait()
            await mesh.token(rid, seq, finish=seq == TOKENS - 1)
            await asyncio.sleep(0.05)

    gw, mesh = await scripted(frozen_with_the_gateway)
    stream = asyncio.ensure_future(_stream(gw))
    await asyncio.sleep(0.6)  # tokens flowing
    mesh.silent = frozenset({PREFILL, DECODE})  # frozen with the gateway ...
    await asyncio.sleep(0.15)  # (a heartbeat already on its way is taken before the freeze)
    time.sleep(2 * TTL_S)  # noqa: ASYNC251 - the loop stalls: blocking it is the test

    async def resume() -> None:
        await asyncio.sleep(0.3)  # ... and their next heartbeat comes a little after
        mesh.silent = frozenset()
        thawed.set()

    waking = asyncio.ensure_future(resume())
    status, events = await stream
    await waking
    assert status == 200
    assert not any(b'"error"' in e for e in events), events[-1]
    assert events[-1].strip() == b"data: [DONE]"


async def test_a_worker_that_stops_heartbeating_still_fails_its_request(scripted) -> None:
    """decode goes silent (no heartbeat, no token) mid-stream while prefill keeps
    heartbeating: the gateway, which heard heartbeats all along, ends the stream with
    `worker_lost` naming decode about a TTL later (not after --request-timeout-s)."""
    silent_at: list[float] = []

    async def goes_silent(mesh: ScriptedMesh, rid: str) -> None:
        for seq in range(3):
            await mesh.token(rid, seq)
            await asyncio.sleep(0.05)
        mesh.silent = frozenset({DECODE})
        silent_at.append(time.monotonic())

    gw, mesh = await scripted(goes_silent)
    status, events = await _stream(gw)
    ended_after = time.monotonic() - silent_at[0]
    assert status == 200
    assert b'"code":"worker_lost"' in events[-1] and DECODE.encode() in events[-1], events
    assert TTL_S - 0.1 < ended_after < TTL_S + 2.0, ended_after
    await asyncio.sleep(0.2)
    assert mesh.aborts  # the gateway told the mesh to let go


async def test_workers_that_all_stop_heartbeating_still_fail_the_request(scripted) -> None:
    """Every worker goes silent mid-stream (a colocated mesh's one worker killed): hearing
    nobody is no reason to wait for --request-timeout-s, the gateway's loop kept up, so the
    stream ends with `worker_lost` about a TTL later."""
    silent_at: list[float] = []

    async def all_silent(mesh: ScriptedMesh, rid: str) -> None:
        for seq in range(3):
            await mesh.token(rid, seq)
            await asyncio.sleep(0.05)
        mesh.silent = frozenset({PREFILL, DECODE})
        silent_at.append(time.monotonic())

    gw, _mesh = await scripted(all_silent)
    status, events = await _stream(gw)
    ended_after = time.monotonic() - silent_at[0]
    assert status == 200
    assert b'"code":"worker_lost"' in events[-1], events
    assert TTL_S - 0.1 < ended_after < TTL_S + 2.0, ended_after
