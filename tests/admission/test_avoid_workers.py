"""A submit's `avoid_workers` (a resumed request's lost workers, whose heartbeats may linger
in the registry up to its TTL): admission never places the request's prefill or decode on
one of them, not on a retry, not for another choice of the submit."""

from __future__ import annotations

import msgspec

from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve


def beat(worker_id: str, role: m.Role, free: int) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, role=role, model="tiny", pool_capacity_tokens=8192,
                       available_tokens=free, page_tokens=16, configured_context=4096,
                       served_context=4096)


class Wire:
    """The admission runtime's NATS calls answered in-process: each decode reserves (or
    refuses, when in `refusing`), and every reserve and dispatch is recorded by worker."""

    def __init__(self, svc: AdmissionService, refusing: frozenset[str] = frozenset()) -> None:
        self.reserves: list[str] = []
        self.dispatches: list[str] = []
        self.refusing = refusing
        svc.rt.request = self.request  # type: ignore[method-assign]
        svc.rt.publish = self.publish  # type: ignore[method-assign]

    async def request(self, subject: str, msg: msgspec.Struct, typ: object, timeout_s: float,
                      headers: dict[str, str] | None = None) -> m.ReserveReply:
        assert isinstance(msg, m.ReserveRequest)
        worker, rid = msg.ticket.decode_worker, msg.ticket.request_id
        assert subject == m.reserve_subject(worker)
        self.reserves.append(worker)
        if worker in self.refusing:
            return m.ReserveRefused(request_id=rid, outcome=m.Outcome(
                code=m.Code.RESERVE_FAILED, detail="pool full now"))
        return m.Reserved(request_id=rid, reservation=m.Reservation(
            reservation_id=f"res-{rid}", epoch=1, page_ids=[0], page_tokens=16, page_bytes=64,
            data_address="tcp://127.0.0.1:9"))

    async def publish(self, subject: str, msg: msgspec.Struct,
                      headers: dict[str, str] | None = None) -> None:
        if isinstance(msg, m.PrefillDispatch):
            self.dispatches.append(msg.ticket.prefill_worker)


def admission(queue_timeout_s: float = 0.5) -> AdmissionService:
    svc = AdmissionService(resolve("admission", {"queue_timeout_s": queue_timeout_s}, {}))
    # The lost workers have the most free KV and the shortest queues: the first choice
    # of every request, were they not avoided.
    for b in (beat("pre-lost", m.Role.PREFILL, 8192), beat("pre-2", m.Role.PREFILL, 1024),
              beat("dec-lost", m.Role.DECODE, 8192), beat("dec-2", m.Role.DECODE, 2048),
              beat("dec-3", m.Role.DECODE, 1024)):
        svc.registry.observe(b)
    return svc


def submit(request_id: str, avoid: list[str], choices: int = 0) -> m.SubmitRequest:
    return m.SubmitRequest(
        request_id=request_id, tenant="alice", cache_salt="s", prompt_ids=[1, 2, 3],
        max_tokens=4, stream_key=streamauth.new_key(), avoid_workers=avoid,
        choices=[m.SubmitChoice(request_id=f"{request_id}.{i}", stream_key=streamauth.new_key())
                 for i in range(1, choices + 1)])


def test_the_registry_leaves_avoided_workers_out_of_both_roles() -> None:
    reg = CapacityRegistry(ttl_s=60)
    for b in (beat("w1", m.Role.PREFILL, 1), beat("w1", m.Role.DECODE, 1),
              beat("w2", m.Role.DECODE, 1)):
        reg.observe(b)
    assert [v.worker_id for v in reg.views(m.Role.PREFILL, avoid={"w1"})] == []
    assert [v.worker_id for v in reg.views(m.Role.DECODE, avoid=("w1",))] == ["w2"]
    assert len(reg.views(m.Role.DECODE)) == 2


async def test_a_resumed_request_is_placed_only_on_other_workers() -> None:
    svc = admission()
    wire = Wire(svc)
    for n in range(8):
        reply = await svc.handle(submit(f"r{n}", ["pre-lost", "dec-lost"]))
        assert isinstance(reply, m.Admitted), reply
        assert reply.prefill_worker == "pre-2" and reply.decode_worker != "dec-lost"
    assert "dec-lost" not in wire.reserves and "pre-lost" not in wire.dispatches
    # The same mesh without the avoid list places on the lost workers (the test's premise).
    reply = await svc.handle(submit("fresh", []))
    assert isinstance(reply, m.Admitted) and reply.decode_worker == "dec-lost"


async def test_every_choice_of_the_submit_avoids_them() -> None:
    svc = admission()
    wire = Wire(svc)
    reply = await svc.handle(submit("multi", ["dec-lost"], choices=3))
    assert isinstance(reply, m.Admitted), reply
    placed = [reply.decode_worker, *(c.decode_worker for c in reply.choices)]
    assert len(placed) == 4 and "dec-lost" not in placed
    assert "dec-lost" not in wire.reserves


async def test_a_decode_that_refuses_does_not_bring_an_avoided_one_back() -> None:
    """dec-2 and dec-3 refuse (their pools changed): the request waits and is rejected
    SATURATED; the avoided decode, free as it looks, is never asked."""
    svc = admission(queue_timeout_s=0.5)
    wire = Wire(svc, refusing=frozenset({"dec-2", "dec-3"}))
    reply = await svc.handle(submit("retry", ["dec-lost"]))
    assert isinstance(reply, m.Rejected) and reply.outcome.code is m.Code.SATURATED, reply
    assert set(wire.reserves) == {"dec-2", "dec-3"} and wire.dispatches == []


async def test_avoiding_every_decode_is_no_workers_saying_so() -> None:
    svc = admission()
    wire = Wire(svc)
    reply = await svc.handle(submit("stuck", ["dec-lost", "dec-2", "dec-3"]))
    assert isinstance(reply, m.Rejected) and reply.outcome.code is m.Code.NO_WORKERS, reply
    assert "avoids dec-2, dec-3, dec-lost" in reply.outcome.detail
    assert wire.reserves == [] and wire.dispatches == []
