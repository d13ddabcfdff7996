"""Tenants share the decode KV: the real admission and gateway in front of a scripted decode
pool that reserves, cancels and frees pages as the real one does, and a scripted prefill
that keeps each request in prefill until it is aborted.

- A tenant sending requests without max_tokens (each reserving the default 4,096) can hold
  at most its kv_share of the pool; another tenant's request is admitted at once.
- Past its share a tenant gets 429 `tenant_kv_share` with Retry-After.
- An `n` > 1 request is reserved whole or not at all: while it waits it holds nothing.
- Admission's line is fair: with the pool full, the next pages go to the tenant that has
  waited with less, not to the one that queued first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import nats
import pytest

from pdmesh.gateway.app import Gateway
from pdmesh.kvstore.spec import pages_for
from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer

pytestmark = pytest.mark.mesh

CAP, PAGE = 32768, 16  # one decode worker's default --kv-tokens and --page-tokens
PREFILL, DECODE = "pre-1", "dec-1"


class ScriptedPool:
    """Decode's reserve/cancel/abort and prefill's progress over NATS, with page counts."""

    def __init__(self, nc: nats.NATS, advertised_tokens: int = CAP) -> None:
        self.nc = nc
        self.advertised_tokens = advertised_tokens  # the pool its heartbeats claim
        self.held: dict[str, tuple[str, int]] = {}  # request id -> (tenant, pages)
        self.reserves: list[str] = []  # request ids, in the order reserves arrived
        self.held_at_reserve: list[int] = []  # len(held) as each reserve arrived
        self.peak_pages = 0
        self.tasks: set[asyncio.Task] = set()

    @property
    def used_pages(self) -> int:
        return sum(p for _, p in self.held.values())

    def tenant_tokens(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tenant, pages in self.held.values():
            out[tenant] = out.get(tenant, 0) + pages * PAGE
        return out

    async def start(self) -> None:
        reserves, aborts = m.Decoder(m.ToReserve), m.Decoder(m.Abort)
        dispatches = m.Decoder(m.PrefillDispatch)

        async def on_reserve(msg) -> None:
            req = reserves.decode(msg.subject, msg.data)
            if isinstance(req, m.ReserveCancel):
                self.held.pop(req.request_id, None)
                return
            t = req.ticket
            self.reserves.append(t.request_id)
            self.held_at_reserve.append(len(self.held))
            need = pages_for(t.prompt_len + t.max_tokens, PAGE)
            if (self.used_pages + need) * PAGE > CAP:
                await msg.respond(m.encode(m.ReserveRefused(
                    request_id=t.request_id,
                    outcome=m.Outcome(code=m.Code.RESERVE_FAILED, detail="pool full"))))
                return
            self.held[t.request_id] = (t.tenant, need)
            self.peak_pages = max(self.peak_pages, self.used_pages)
            await msg.respond(m.encode(m.Reserved(request_id=t.request_id,
                                                  reservation=m.Reservation(
                reservation_id=str(uuid.uuid4()), epoch=1,
                page_ids=list(range(pages_for(t.prompt_len, PAGE))), page_tokens=PAGE,
                page_bytes=64, data_address="tcp://127.0.0.1:9"))))

        async def on_abort(msg) -> None:
            self.held.pop(aborts.decode(msg.subject, msg.data).request_id, None)

        async def on_dispatch(msg) -> None:
            d = dispatches.decode(msg.subject, msg.data)
            self._own(self._in_prefill(d))

        await self.nc.subscribe(m.reserve_subject(DECODE), cb=on_reserve)
        await self.nc.subscribe(m.ABORT_SUBJECT, cb=on_abort)
        await self.nc.subscribe(m.dispatch_subject(PREFILL), cb=on_dispatch)
        self._own(self._heartbeats())

    def _own(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _in_prefill(self, d: m.PrefillDispatch) -> None:
        """A long prompt: progress every 0.2 s (MACed) for as long as decode holds it."""
        rid, key = d.ticket.request_id, streamauth.parse_key(d.stream_key)
        while rid in self.held:
            subject = m.tokens_subject(rid)
            data = m.encode(m.PrefillProgress(
                request_id=rid, reservation_id=d.reservation.reservation_id,
                done_tokens=0, total_tokens=9))
            await self.nc.publish(subject, data, headers=streamauth.sign(key, subject, data))
            await asyncio.sleep(0.2)

    async def _heartbeats(self) -> None:
        while True:
            for worker, role in ((PREFILL, m.Role.PREFILL), (DECODE, m.Role.DECODE)):
                decode = role is m.Role.DECODE
                await self.nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                    worker_id=worker, role=role, model="tiny",
                    pool_capacity_tokens=self.advertised_tokens,
                    available_tokens=self.advertised_tokens - self.used_pages * PAGE,
                    page_tokens=PAGE, configured_context=8192, served_context=8192,
                    tenant_tokens=self.tenant_tokens() if decode else {},
                    sent_at=time.time())))
            await asyncio.sleep(0.2)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Mesh:
    def __init__(self, pool: ScriptedPool, gw: Gateway, adm: AdmissionService) -> None:
        self.pool, self.gw, self.adm = pool, gw, adm
        self.base = f"http://127.0.0.1:{gw.rt.http_port}"

    async def post(self, key: str, body: dict, timeout_s: float = 30
                   ) -> tuple[int, dict, dict[str, str], float]:
        """status, the JSON body (or {} for a stream), headers, seconds to the answer."""
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http, http.post(
                self.base + "/v1/completions", json={"model": "tiny", **body},
                headers={"Authorization": f"Bearer {key}"},
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            data = {} if resp.content_type == "text/event-stream" else await resp.json()
            return resp.status, data, dict(resp.headers), time.monotonic() - t0

    def hold(self, key: str, body: dict) -> asyncio.Task:
        """A streaming request read until cancelled (it stays in prefill): its status."""
        async def read() -> int:
            async with aiohttp.ClientSession() as http, http.post(
                    self.base + "/v1/completions", json={"model": "tiny", "stream": True,
                                                         **body},
                    headers={"Authorization": f"Bearer {key}"},
                    timeout=aiohttp.ClientTimeout(total=60)) as resp:
                await resp.read()
                return resp.status
        return asyncio.ensure_future(read())

    async def until(self, cond, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "condition not reached"
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def mesh(nats_url: str, tmp_path: Path, tenants: str | None = None,
               queue_timeout_s: float = 3.0, advertised_tokens: int = CAP
               ) -> AsyncIterator[Mesh]:
    nc = await nats.connect(nats_url)
    pool = ScriptedPool(nc, advertised_tokens)
    await pool.start()
    settings = {"nats_url": nats_url, "http_host": "127.0.0.1", "http_port": 0,
                "queue_timeout_s": queue_timeout_s}
    gw_settings = {**settings, "model": "tiny"}
    if tenants is not None:
        path = tmp_path / "tenants.toml"
        path.write_text(tenants)
        gw_settings["tenants_file"] = str(path)
    adm = AdmissionService(resolve("admission", settings, {}))
    gw = Gateway(resolve("gateway", gw_settings, {}))
    await adm.start()
    await gw.start()
    running = Mesh(pool, gw, adm)
    try:
        await running.until(lambda: gw.registry.views(m.Role.DECODE)
                            and adm.registry.views(m.Role.DECODE))
        yield running
    finally:
        await gw.rt.drain("test over")
        await adm.rt.drain("test over")
        await pool.close()
        await nc.close()


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_tenant_without_max_tokens_cannot_take_the_pool_from_another(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """The dev tenants' defaults (kv_share 0.5): alice's eight streams asking the default
    4,096 tokens each hold half the pool, and bob's request is admitted at once (before the
    limit, alice filled the pool and bob got 429 after 3 s)."""
    async with mesh(nats_server.url, tmp_path) as run:
        alice = [run.hold("sk-dev-alice", {"prompt": f"doc {i}"}) for i in range(8)]
        try:
            await run.until(lambda: len(run.pool.reserves) >= 3)
            await asyncio.sleep(1.0)  # the rest stay queued at admission
            assert run.pool.used_pages * PAGE <= CAP // 2
            status, body, _, took = await run.post(  # the stream's headers: admitted
                "sk-dev-bob", {"prompt": "hi", "max_tokens": 4, "stream": True}, 20)
            assert status == 200, body
            assert took < 1.5
            assert run.pool.tenant_tokens().get("alice", 0) <= CAP // 2
        finally:
            await _cancel(alice)


async def test_past_its_share_a_tenant_gets_429_naming_the_limit(
        nats_server: NatsServer, tmp_path: Path) -> None:
    async with mesh(nats_server.url, tmp_path, queue_timeout_s=1.0) as run:
        alice = [run.hold("sk-dev-alice", {"prompt": f"doc {i}", "max_tokens": 4000})
                 for i in range(4)]
        try:
            await run.until(lambda: len(run.pool.held) >= 4)
            status, body, headers, took = await run.post(
                "sk-dev-alice", {"prompt": "one more", "max_tokens": 4000})
            assert status == 429
            assert body["error"]["code"] == "tenant_kv_share"
            assert "kv_share" in body["error"]["message"]
            assert body["error"]["type"] == "rate_limit_error"
            assert int(headers["Retry-After"]) >= 1
            assert 0.9 < took < 3.0  # it waited its queue_timeout_s for its share to free
            assert len(run.pool.held) == 4  # nothing of it was reserved
        finally:
            await _cancel(alice)


async def test_n_choices_are_reserved_all_together_or_not_at_all(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """Eight choices of 4,096 + prompt tokens do not fit a 32,768-token pool together: the
    request waits holding nothing, then gets 429; nothing is left held (before, it held
    seven reservations while the eighth waited)."""
    async with mesh(nats_server.url, tmp_path, queue_timeout_s=1.5) as run:
        task = asyncio.ensure_future(run.post(
            "sk-dev-carol", {"prompt": "eight of them", "n": 8, "max_tokens": 4090}))
        peak = 0
        while not task.done():
            peak = max(peak, len(run.pool.held))
            await asyncio.sleep(0.02)
        status, body, headers, _ = task.result()
        assert status == 429, body
        assert body["error"]["code"] == "mesh_saturated"
        assert "Retry-After" in headers
        assert peak == 0 and run.pool.peak_pages == 0
        assert run.pool.held == {}
        # Seven fit: all seven are reserved, in one admission.
        seven = run.hold("sk-dev-carol", {"prompt": "seven", "n": 7, "max_tokens": 4090})
        try:
            await run.until(lambda: len(run.pool.held) == 7)
        finally:
            await _cancel([seven])
        await run.until(lambda: not run.pool.held)


async def test_choices_reserved_before_one_that_fails_are_let_go_at_once(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """The decode's heartbeats claim twice the pool it has: eight choices look as if they
    fit, and the real pool refuses the eighth reservation. The seven reserved before it are
    cancelled before admission tries again, so between attempts the submit holds nothing."""
    async with mesh(nats_server.url, tmp_path, queue_timeout_s=1.5,
                    advertised_tokens=2 * CAP) as run:
        status, body, _, _ = await run.post(
            "sk-dev-carol", {"prompt": "eight of them", "n": 8, "max_tokens": 4090})
        assert status == 429, body
        # What decode held as each reservation arrived: every attempt is 0, 1, .. 7 (the
        # eighth refused); a retry holding the last attempt's seven would start at 7.
        seen = run.pool.held_at_reserve
        assert len(seen) >= 16, f"admission tried fewer than twice: {seen}"
        assert seen == [i % 8 for i in range(len(seen))], \
            f"the reserved choices stayed held between attempts: {seen}"
        await run.until(lambda: not run.pool.held)


async def test_admission_serves_the_tenant_that_waited_with_less_first(
        nats_server: NatsServer, tmp_path: Path) -> None:
    """The pool is full of carol's requests (kv_share 1 for everyone here); alice queues
    three more, then bob one. As carol's pages free one request at a time, bob's request
    gets the first ones, not alice's third."""
    tenants = """
[defaults]
kv_share = 1.0

[[tenant]]
id = "alice"
api_keys = ["sk-dev-alice"]

[[tenant]]
id = "bob"
api_keys = ["sk-dev-bob"]

[[tenant]]
id = "carol"
api_keys = ["sk-dev-carol"]
"""
    async with mesh(nats_server.url, tmp_path, tenants, queue_timeout_s=20.0) as run:
        big = {"max_tokens": 8000}
        carol = [run.hold("sk-dev-carol", {"prompt": f"c{i}", **big}) for i in range(4)]
        waiting: list[asyncio.Task] = []
        try:
            await run.until(lambda: len(run.pool.held) == 4)
            waiting += [run.hold("sk-dev-alice", {"prompt": f"a{i}", **big}) for i in range(3)]
            await run.until(lambda: len(run.adm.line) == 3)
            waiting.append(run.hold("sk-dev-bob", {"prompt": "b", **big}))
            await run.until(lambda: len(run.adm.line) == 4)
            served: list[str] = []
            for task in carol:  # one of carol's ends: its pages go to the next in line
                before = set(run.pool.held)
                task.cancel()
                await run.until(lambda b=before: set(run.pool.held) - b)
                served += [run.pool.held[r][0] for r in set(run.pool.held) - before]
            # SFQ: alice's first (tagged before bob came), bob's, then alice's others.
            assert served[:2] == ["alice", "bob"], served
        finally:
            await _cancel(carol + waiting)
