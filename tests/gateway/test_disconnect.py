"""A client that goes away mid-request aborts it across the mesh: the decode worker's
lease is freed within a second (I6, STYLE practice 8), and the pool stays intact."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdmesh.loadtest.client import SSEParser
from pdmesh.services.protocol import messages as m
from tests.support.gateway_workers import MeshWorkers
from tests.support.meshproc import Mesh

pytestmark = pytest.mark.mesh

FREE_WITHIN_S = 1.0
# Greedy output for "abc" runs 1500 tokens without an EOS (checked against tests/support/oracle.py;
# about 15 s on the tiny model): it is still generating when the client leaves.
MAX_TOKENS = 1500
LONG = {"model": "tiny", "prompt": "abc", "max_tokens": MAX_TOKENS, "temperature": 0}


@pytest.fixture
async def workers(live_mesh: Mesh) -> AsyncIterator[MeshWorkers]:
    w = await MeshWorkers.connect(live_mesh.nats_url)
    try:
        yield w
    finally:
        await w.close()


async def pools_idle(workers: MeshWorkers) -> bool:
    stats = await workers.stats(m.Role.DECODE) + await workers.stats(m.Role.PREFILL)
    assert all(s.integrity_ok for s in stats), [s.integrity_error for s in stats]
    return all(s.live_leases == 0 and s.leased_pages == 0 for s in stats)


async def wait_freed(workers: MeshWorkers, request_id: str) -> float:
    """Seconds until no worker holds a lease; fails after FREE_WITHIN_S."""
    t0 = time.monotonic()
    while not await pools_idle(workers):
        waited = time.monotonic() - t0
        assert waited < FREE_WITHIN_S, f"{request_id}: lease still held after {waited:.2f}s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def generated_tokens(workers: MeshWorkers) -> float:
    (decode,) = await workers.stats(m.Role.DECODE)
    return decode.counters["generated_tokens"]


async def assert_holding(workers: MeshWorkers, request_id: str) -> None:
    (decode,) = await workers.stats(m.Role.DECODE)
    assert request_id in decode.request_ids
    assert decode.live_leases == 1 and decode.leased_pages > 0, decode


async def assert_aborted(workers: MeshWorkers, tokens_before: float) -> None:
    """Freed because it was aborted, not because it ran to max_tokens; and it stays so."""
    made = await generated_tokens(workers) - tokens_before
    assert 0 < made < MAX_TOKENS / 2, made
    await asyncio.sleep(0.2)
    assert await generated_tokens(workers) - tokens_before == made


async def test_stream_disconnect_frees_decode_lease(live_mesh: Mesh,
                                                    workers: MeshWorkers) -> None:
    assert await pools_idle(workers), "a previous test left a lease behind"
    tokens_before = await generated_tokens(workers)
    url = f"http://127.0.0.1:{live_mesh.gateway_port}/v1/completions"
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(url, json={**LONG, "stream": True},
                                  headers={"Authorization": "Bearer sk-dev-alice"})
        assert resp.status == 200
        chunks: list[dict] = []
        parser = SSEParser()
        async for raw in resp.content.iter_any():
            chunks += [json.loads(e) for e in parser.feed(raw) if e.startswith("{")]
            if len(chunks) >= 2:
                break
        request_id = chunks[0]["id"]
        await assert_holding(workers, request_id)
        resp.close()  # drops the connection mid-stream
    finally:
        await session.close()
    await wait_freed(workers, request_id)
    await assert_aborted(workers, tokens_before)


async def test_non_stream_disconnect_frees_decode_lease(live_mesh: Mesh,
                                                        workers: MeshWorkers) -> None:
    assert await pools_idle(workers), "a previous test left a lease behind"
    tokens_before = await generated_tokens(workers)
    reader, writer = await asyncio.open_connection("127.0.0.1", live_mesh.gateway_port)
    body = json.dumps(LONG).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Authorization: Bearer sk-dev-alice\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    # No id comes back before the end: find the request by the decode lease it holds.
    deadline = time.monotonic() + 10
    while True:
        (decode,) = await workers.stats(m.Role.DECODE)
        if decode.live_leases:
            break
        assert time.monotonic() < deadline, "the request never reached decode"
        await asyncio.sleep(0.02)
    request_id = decode.request_ids[-1]
    await asyncio.sleep(0.2)  # well into generation
    await assert_holding(workers, request_id)
    writer.close()
    await writer.wait_closed()
    await wait_freed(workers, request_id)
    await assert_aborted(workers, tokens_before)
    assert not await reader.read()  # nothing was ever answered
