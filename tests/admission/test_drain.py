"""Admission's graceful drain (what SIGTERM runs: `rt.drain()`): it leaves the submit queue
group at once, so other admission replicas take new submits; it waits up to its drain
timeout for the submits it holds; at the timeout a submit still waiting for capacity is
answered SATURATED with a Retry-After instead of being left to the gateway's timeout, and
one past its decision (reserving) finishes.

The real admission service on a real nats-server; the workers are played by a NATS client
(pre-1 and dec-1 heartbeat, dec-1 answers reserves)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats
import pytest

from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve
from pdmesh.services.runtime.service import ServiceState
from tests.support.meshproc import NatsServer

pytestmark = pytest.mark.mesh


class Workers:
    """pre-1 and dec-1 over NATS: heartbeats every 0.1 s, dec-1 with `decode_free` tokens
    free (0: every submit waits), reserves answered after `reserve_delay_s`."""

    def __init__(self, nc: nats.NATS) -> None:
        self.nc = nc
        self.decode_free = 0
        self.reserve_delay_s = 0.0
        self.reserves: list[str] = []
        self.dispatches: list[str] = []
        self.tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        reserves, dispatches = m.Decoder(m.ToReserve), m.Decoder(m.PrefillDispatch)

        async def on_reserve(msg) -> None:
            req = reserves.decode(msg.subject, msg.data)
            if not isinstance(req, m.ReserveRequest):
                return
            await asyncio.sleep(self.reserve_delay_s)
            rid = req.ticket.request_id
            self.reserves.append(rid)
            await msg.respond(m.encode(m.Reserved(request_id=rid, reservation=m.Reservation(
                reservation_id=f"res-{rid}", epoch=1, page_ids=[0], page_tokens=16,
                page_bytes=64, data_address="tcp://127.0.0.1:9"))))

        async def on_dispatch(msg) -> None:
            self.dispatches.append(dispatches.decode(msg.subject, msg.data).ticket.request_id)

        await self.nc.subscribe(m.reserve_subject("dec-1"), cb=on_reserve)
        await self.nc.subscribe(m.dispatch_subject("pre-1"), cb=on_dispatch)
        self._own(self._beat())

    def _own(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _beat(self) -> None:
        while True:
            for worker, role, free in (("pre-1", m.Role.PREFILL, 8192),
                                       ("dec-1", m.Role.DECODE, self.decode_free)):
                await self.nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                    worker_id=worker, role=role, model="tiny", pool_capacity_tokens=8192,
                    available_tokens=free, page_tokens=16, configured_context=4096,
                    served_context=4096, sent_at=time.time())))
            await asyncio.sleep(0.1)

    def submit(self, request_id: str) -> asyncio.Task:
        """Send a submit as the gateway does; the task's result is admission's reply."""
        async def ask() -> m.SubmitReply:
            data = m.encode(m.SubmitRequest(request_id=request_id, tenant="alice",
                                            cache_salt="s", prompt_ids=[1, 2, 3], max_tokens=4,
                                            stream_key=streamauth.new_key()))
            msg = await self.nc.request(m.SUBMIT_SUBJECT, data, timeout=20)
            return m.Decoder(m.SubmitReply).decode(msg.subject, msg.data)

        return self._own(ask())

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def running(nats_url: str) -> AsyncIterator[Workers]:
    nc = await nats.connect(nats_url)
    workers = Workers(nc)
    await workers.start()
    try:
        yield workers
    finally:
        await workers.close()
        await nc.close()


async def admission(nats_url: str, worker_id: str, drain_timeout_s: float) -> AdmissionService:
    svc = AdmissionService(resolve("admission", {
        "nats_url": nats_url, "http_host": "127.0.0.1", "http_port": 0, "worker_id": worker_id,
        "queue_timeout_s": 30.0, "drain_timeout_s": drain_timeout_s}, {}))
    await svc.start()
    await until(lambda: svc.registry.views(m.Role.DECODE))
    return svc


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def cut_total(svc: AdmissionService) -> float:
    return svc.rt.drain_cut.labels(svc.rt.role)._value.get()


async def test_a_submit_still_waiting_at_the_drain_timeout_is_answered_saturated(
        nats_server: NatsServer) -> None:
    async with running(nats_server.url) as workers:
        svc = await admission(nats_server.url, "adm-1", drain_timeout_s=0.5)
        try:
            waiting = workers.submit("waits")
            await until(lambda: svc.rt.inflight() == 1)
            t0 = time.monotonic()
            await svc.rt.drain("SIGTERM")
            took = time.monotonic() - t0
            reply = await asyncio.wait_for(waiting, 5)
            assert isinstance(reply, m.Rejected), reply
            assert reply.outcome.code is m.Code.SATURATED and reply.retry_after_s >= 1.0
            assert "shutting down" in reply.outcome.detail
            assert 0.5 <= took < 5.0  # the drain timeout, then the answer: not queue_timeout_s
            assert svc.cut_submits == 1 and cut_total(svc) == 1
            assert workers.reserves == [] and workers.dispatches == []
        finally:
            await svc.rt.drain("test over")


LATER = 8  # submits sent once adm-1 drains


async def test_a_draining_admission_leaves_new_submits_to_the_other_replica(
        nats_server: NatsServer) -> None:
    async with running(nats_server.url) as workers:
        first = await admission(nats_server.url, "adm-1", drain_timeout_s=3.0)
        waiting = workers.submit("held-by-adm-1")
        await until(lambda: first.rt.inflight() == 1)
        second = await admission(nats_server.url, "adm-2", drain_timeout_s=0.3)
        drain = asyncio.ensure_future(first.rt.drain("SIGTERM"))
        try:
            await until(lambda: first.rt.state is ServiceState.DRAINING
                        and not first.taking_submits)
            later = [workers.submit(f"later-{n}") for n in range(LATER)]
            await until(lambda: first.rt.inflight() + second.rt.inflight() == 1 + LATER)
            # None of them reached adm-1 (in one queue group, each would with odds 1/2).
            assert (first.rt.inflight(), second.rt.inflight()) == (1, LATER)
            workers.decode_free = 8192  # capacity: every waiting submit is admitted
            for reply in await asyncio.wait_for(asyncio.gather(waiting, *later), 10):
                assert isinstance(reply, m.Admitted), reply
            await asyncio.wait_for(drain, 5)
            assert first.cut_submits == 0 and cut_total(first) == 0
            assert sorted(workers.dispatches) == sorted(
                ["held-by-adm-1", *(f"later-{n}" for n in range(LATER))])
        finally:
            await asyncio.gather(drain, return_exceptions=True)
            await first.rt.drain("test over")
            await second.rt.drain("test over")


async def test_a_submit_reserving_at_the_drain_timeout_finishes(nats_server: NatsServer) -> None:
    """Past its decision (its reserve on the wire) a submit is not cut: the hand-off lets it
    finish, so a reservation is never left without its dispatch."""
    async with running(nats_server.url) as workers:
        svc = await admission(nats_server.url, "adm-1", drain_timeout_s=0.3)
        try:
            workers.decode_free, workers.reserve_delay_s = 8192, 1.0
            reserving = workers.submit("reserving")
            await until(lambda: svc.rt.inflight() == 1)
            await svc.rt.drain("SIGTERM")
            reply = await asyncio.wait_for(reserving, 5)
            assert isinstance(reply, m.Admitted), reply
            assert workers.dispatches == ["reserving"]
            assert svc.cut_submits == 0 and cut_total(svc) == 0
        finally:
            await svc.rt.drain("test over")
