"""A scripted mesh in front of a real gateway: the test answers admission's submit itself and
plays prefill and decode on the request's token stream (MACed under the request's stream
key, as the real workers do), with whatever timing a case needs. Used by the gateway tests
that run a real `Gateway` in the test's own process on a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.gateway.app import Gateway
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve

PREFILL, DECODE = "pre-1", "dec-1"
Script = Callable[["ScriptedMesh", str], Awaitable[None]]


class ScriptedMesh:
    """Admission, prefill and decode as the gateway sees them over NATS: heartbeats, an
    Admitted reply to every submit, then `script(mesh, request_id)` on its token stream."""

    def __init__(self, nc, script: Script, served_context: int = 4096,
                 heartbeat_s: float = 0.2) -> None:
        self.nc, self.script, self.served_context = nc, script, served_context
        self.heartbeat_s = heartbeat_s
        self.silent: frozenset[str] = frozenset()  # workers that stop heartbeating
        self.submits: list[m.SubmitRequest] = []
        self.keys: dict[str, bytes] = {}  # request id -> stream key (the workers get it)
        self.aborts: list[str] = []
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        submits, aborts = m.Decoder(m.SubmitRequest), m.Decoder(m.Abort)

        async def on_submit(msg) -> None:
            req = submits.decode(msg.subject, msg.data)
            self.submits.append(req)
            self.keys[req.request_id] = streamauth.parse_key(req.stream_key)
            for c in req.choices:
                self.keys[c.request_id] = streamauth.parse_key(c.stream_key)
            await msg.respond(m.encode(m.Admitted(
                request_id=req.request_id, decode_worker=DECODE, prefill_worker=PREFILL,
                choices=[m.Placement(request_id=c.request_id, decode_worker=DECODE,
                                     prefill_worker=PREFILL) for c in req.choices])))
            for rid in [req.request_id, *(c.request_id for c in req.choices)]:
                self._own(self.script(self, rid))

        async def on_abort(msg) -> None:
            self.aborts.append(aborts.decode(msg.subject, msg.data).request_id)

        await self.nc.subscribe(m.SUBMIT_SUBJECT, cb=on_submit)
        await self.nc.subscribe(m.ABORT_SUBJECT, cb=on_abort)
        self._own(self._heartbeats())

    def _own(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _heartbeats(self) -> None:
        while True:
            for worker, role in ((PREFILL, m.Role.PREFILL), (DECODE, m.Role.DECODE)):
                if worker in self.silent:
                    continue
                await self.nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                    worker_id=worker, role=role, model="tiny", pool_capacity_tokens=1 << 20,
                    available_tokens=1 << 20, page_tokens=16,
                    configured_context=self.served_context,
                    served_context=self.served_context, sent_at=time.time())))
            await asyncio.sleep(self.heartbeat_s)

    async def send(self, request_id: str, event: m.StreamEvent) -> None:
        """As the request's worker sends it: MACed under the request's stream key."""
        subject, data = m.tokens_subject(request_id), m.encode(event)
        await self.nc.publish(subject, data, headers=streamauth.sign(
            self.keys[request_id], subject, data))

    async def progress_for(self, request_id: str, seconds: float, every_s: float = 0.2) -> None:
        """Prefill working on the prompt: a PrefillProgress every `every_s` for `seconds`."""
        steps = max(1, round(seconds / every_s))
        for i in range(steps):
            await self.send(request_id, m.PrefillProgress(
                request_id=request_id, reservation_id="r", done_tokens=i, total_tokens=steps))
            await asyncio.sleep(every_s)

    async def token(self, request_id: str, seq: int, finish: bool = False,
                    decode_first_token_s: float | None = None) -> None:
        await self.send(request_id, m.TokenEvent(
            request_id=request_id, seq=seq, token_ids=[ord("a")], prompt_tokens=5,
            finish=m.FINISHED_LENGTH if finish else None,
            decode_first_token_s=decode_first_token_s))

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Running:
    def __init__(self, gw: Gateway, mesh: ScriptedMesh) -> None:
        self.gw, self.mesh = gw, mesh
        self.base = f"http://127.0.0.1:{gw.rt.http_port}"
        self.metrics_url = f"http://127.0.0.1:{gw.rt.metrics_port}/metrics"

    async def post(self, body: dict, path: str = "/v1/completions") -> tuple[int, dict, float]:
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http, http.post(
                self.base + path, json={"model": "tiny", **body},
                headers={"Authorization": "Bearer sk-dev-alice"}) as resp:
            return resp.status, await resp.json(), time.monotonic() - t0

    async def metrics(self) -> dict[tuple[str, frozenset], float]:
        async with aiohttp.ClientSession() as http, http.get(self.metrics_url) as resp:
            text = await resp.text()
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}


async def heard_workers(gw: Gateway) -> None:
    """Wait until the gateway heard the scripted prefill and decode heartbeat."""
    deadline = time.monotonic() + 5
    while not (gw.registry.views(m.Role.DECODE) and gw.registry.views(m.Role.PREFILL)):
        assert time.monotonic() < deadline, "gateway heard no heartbeat"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def gateways(nats_url: str) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    """`start(script, served_context=4096, heartbeat_s=0.2, **settings)`: a scripted mesh
    running `script` and a real gateway in front of it (its other settings `settings`),
    once the gateway heard both workers. Everything started is drained and closed on exit."""
    nc = await nats.connect(nats_url)
    started: list[tuple[Gateway, ScriptedMesh]] = []

    async def start(script: Script, served_context: int = 4096, heartbeat_s: float = 0.2,
                    **settings) -> Running:
        mesh = ScriptedMesh(nc, script, served_context, heartbeat_s)
        await mesh.start()
        gw = Gateway(resolve("gateway", {"model": "tiny", "nats_url": nats_url,
                                         "http_host": "127.0.0.1", "http_port": 0,
                                         **settings}, {}))
        await gw.start()
        started.append((gw, mesh))
        await heard_workers(gw)
        return Running(gw, mesh)

    try:
        yield start
    finally:
        for gw, mesh in started:
            await gw.rt.drain("test over")
            await mesh.close()
        await nc.close()
