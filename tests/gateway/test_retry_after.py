"""Every 503 or 429 that a retry can fix carries `Retry-After`: admission not answering (a
NATS with workers heartbeating but nobody on the submit subject, as while admission
restarts), admission's 503 without an estimate of its own, a tenant's tokenizer queue full.
A real gateway over HTTP on a real nats-server; the tokenizer pool directly."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import aiohttp
import nats
import pytest

from pdmesh.gateway.app import Gateway
from pdmesh.gateway.schema import RETRY_AFTER_S, ApiError
from pdmesh.gateway.text import TokenizerPool
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import ScriptedMesh, heard_workers

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


class _Workers(ScriptedMesh):
    """Prefill and decode heartbeating; admission as `answer` says: None (no responder on
    the submit subject: admission down or restarting) or a Rejected with this code."""

    def __init__(self, nc, answer: m.Code | None) -> None:
        super().__init__(nc, script=lambda mesh, rid: asyncio.sleep(0))
        self.answer = answer

    async def start(self) -> None:
        if self.answer is not None:
            submits, code = m.Decoder(m.SubmitRequest), self.answer

            async def on_submit(msg) -> None:
                req = submits.decode(msg.subject, msg.data)
                await msg.respond(m.encode(m.Rejected(
                    request_id=req.request_id, outcome=m.Outcome(code=code, detail="busy"),
                    prompt_len=len(req.prompt_ids), max_tokens=req.max_tokens)))

            await self.nc.subscribe(m.SUBMIT_SUBJECT, cb=on_submit)
        self._own(self._heartbeats())


@contextlib.asynccontextmanager
async def _gateway(nats_url: str, answer: m.Code | None) -> AsyncIterator[str]:
    nc = await nats.connect(nats_url)
    workers = _Workers(nc, answer)
    await workers.start()
    gw = Gateway(resolve("gateway", {"model": "tiny", "nats_url": nats_url,
                                     "http_host": "127.0.0.1", "http_port": 0}, {}))
    await gw.start()
    try:
        await heard_workers(gw)
        yield f"http://127.0.0.1:{gw.rt.http_port}"
    finally:
        await gw.rt.drain("test over")
        await workers.close()
        await nc.close()


async def _post(base: str, path: str, body: dict) -> tuple[int, dict, str | None]:
    async with aiohttp.ClientSession() as http, http.post(
            base + path, json=body, headers={"Authorization": "Bearer sk-dev-alice"}) as resp:
        return resp.status, await resp.json(), resp.headers.get("Retry-After")


@pytest.mark.parametrize("stream", [False, True])
async def test_admission_not_answering_is_a_503_with_retry_after(
        nats_server: NatsServer, stream: bool) -> None:
    async with _gateway(nats_server.url, None) as base:
        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", {
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user",
                                                                "content": "hi"}]})):
            status, reply, retry_after = await _post(base, path, {**body, "stream": stream})
            assert status == 503, reply
            assert reply["error"]["code"] == "no_workers"
            assert retry_after == str(int(RETRY_AFTER_S)), (path, retry_after)


@pytest.mark.parametrize("code,status", [(m.Code.NO_WORKERS, 503), (m.Code.SATURATED, 429)])
async def test_admissions_rejection_without_an_estimate_gets_retry_after(
        nats_server: NatsServer, code: m.Code, status: int) -> None:
    async with _gateway(nats_server.url, code) as base:
        got, reply, retry_after = await _post(base, "/v1/completions", BODY)
        assert got == status, reply
        assert retry_after == str(int(RETRY_AFTER_S)), reply


async def test_admissions_invalid_rejection_gets_no_retry_after(
        nats_server: NatsServer) -> None:
    """A retry cannot fix a 400: no Retry-After (the header is not added everywhere)."""
    async with _gateway(nats_server.url, m.Code.INVALID) as base:
        got, reply, retry_after = await _post(base, "/v1/completions", BODY)
        assert got == 400 and retry_after is None, reply


async def test_a_full_tokenizer_queue_is_a_429_with_retry_after() -> None:
    pool = TokenizerPool(ByteTokenizer(), budget=10)
    release = threading.Event()
    first = asyncio.ensure_future(pool.run("t", 8, release.wait, 10.0))
    try:
        await asyncio.sleep(0.05)  # the first job holds 8 of the tenant's 10 characters
        with pytest.raises(ApiError) as err:
            await pool.run("t", 8, len, "x")
        assert err.value.status == 429
        assert err.value.headers() == {"Retry-After": str(int(RETRY_AFTER_S))}
    finally:
        release.set()
        await first
