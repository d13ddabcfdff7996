"""Admission pairs a prefill and a decode only when their engine fingerprints are equal (an
empty one only with another empty one); with no such pair the submit is rejected as
NO_WORKERS naming the mismatch, and no worker hears of it (I1)."""

from __future__ import annotations

import asyncio
import time

import nats
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh.services.admission.policy import Admitted, Rejected, WorkerView, decide
from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer

A = "sha256:aaaaaaaaaaaa|native-step:111111111111|torch-2.13.0+cpu|float32|cpu-avx2"
B = "sha256:bbbbbbbbbbbb|native-step:111111111111|torch-2.13.0+cpu|float32|cpu-avx2"


def view(worker_id: str, fingerprint: str, free: int = 4096) -> WorkerView:
    return WorkerView(worker_id=worker_id, capacity_tokens=4096, available_tokens=free,
                      page_tokens=16, served_context=4096, fingerprint=fingerprint)


def test_a_decode_of_another_fingerprint_is_never_chosen_however_free() -> None:
    prefills = [view("p-a", A)]
    decodes = [view("d-a", A, free=256), view("d-b", B, free=4096)]
    for n in range(20):
        got = decide(10, 10, prefills, decodes, spread=f"r{n}")
        assert isinstance(got, Admitted) and got.decode.worker_id == "d-a", got


def test_no_pair_of_equal_fingerprints_is_no_workers_naming_the_mismatch() -> None:
    got = decide(10, 10, [view("p-a", A)], [view("d-b", B)])
    assert isinstance(got, Rejected) and got.reason is m.Code.NO_WORKERS
    assert "fingerprint mismatch" in got.message
    assert A in got.message and B in got.message


def test_an_unannounced_fingerprint_pairs_only_with_another() -> None:
    got = decide(10, 10, [view("p-old", "")], [view("d-a", A)])
    assert isinstance(got, Rejected) and got.reason is m.Code.NO_WORKERS
    assert "(none announced)" in got.message
    got = decide(10, 10, [view("p-old", "")], [view("d-a", A), view("d-old", "", free=64)])
    assert isinstance(got, Admitted) and got.decode.worker_id == "d-old"


def test_with_two_builds_the_pair_with_the_most_free_decode_kv_wins() -> None:
    prefills = [view("p-a", A), view("p-b", B)]
    decodes = [view("d-a", A, free=512), view("d-b", B, free=2048)]
    got = decide(10, 10, prefills, decodes)
    assert isinstance(got, Admitted)
    assert (got.prefill.worker_id, got.decode.worker_id) == ("p-b", "d-b")


def test_a_busy_build_waits_rather_than_a_static_refusal_of_another() -> None:
    """Build A is busy now (SATURATED: the caller waits), build B's context is too short
    for the request: the answer is SATURATED, not context_length_exceeded."""
    prefills = [view("p-a", A), WorkerView("p-b", 1024, 1024, 16, 1024, fingerprint=B)]
    decodes = [view("d-a", A, free=0), WorkerView("d-b", 1024, 1024, 16, 1024, fingerprint=B)]
    got = decide(2000, 100, prefills, decodes)
    assert isinstance(got, Rejected) and got.reason is m.Code.SATURATED, got


FINGERPRINTS = st.sampled_from(["", A, B])


@settings(max_examples=300, deadline=None)
@given(prefill_prints=st.lists(FINGERPRINTS, min_size=1, max_size=4),
       decode_prints=st.lists(FINGERPRINTS, min_size=1, max_size=4),
       frees=st.lists(st.integers(0, 4096), min_size=4, max_size=4))
def test_every_admitted_pair_shares_its_fingerprint(prefill_prints: list[str],
                                                    decode_prints: list[str],
                                                    frees: list[int]) -> None:
    prefills = [view(f"p{i}", fp) for i, fp in enumerate(prefill_prints)]
    decodes = [view(f"d{i}", fp, frees[i]) for i, fp in enumerate(decode_prints)]
    got = decide(10, 10, prefills, decodes)
    shared = set(prefill_prints) & set(decode_prints)
    if isinstance(got, Admitted):
        assert got.prefill.fingerprint == got.decode.fingerprint
    elif not shared:
        assert got.reason is m.Code.NO_WORKERS and "fingerprint mismatch" in got.message
    else:
        assert got.reason is m.Code.SATURATED  # a pair exists: only its load stopped it


def test_the_registry_carries_each_workers_fingerprint() -> None:
    reg = CapacityRegistry(ttl_s=60)
    reg.observe(m.Heartbeat(worker_id="d1", role=m.Role.DECODE, model="tiny",
                            pool_capacity_tokens=4096, available_tokens=4096, page_tokens=16,
                            served_context=4096, fingerprint=A))
    assert [v.fingerprint for v in reg.views(m.Role.DECODE)] == [A]


# -- the real admission service on a real nats-server, workers played by a NATS client ----
class Workers:
    """pre-1, dec-1 and dec-2 heartbeat with the fingerprints in `prints`; each decode
    answers a reserve and records it."""

    def __init__(self, nc: nats.NATS, prints: dict[str, str]) -> None:
        self.nc, self.prints = nc, prints
        self.reserves: list[str] = []
        self.dispatches: list[str] = []
        self.beats: asyncio.Task | None = None

    async def start(self) -> None:
        reserves = m.Decoder(m.ToReserve)

        async def on_reserve(msg) -> None:
            req = reserves.decode(msg.subject, msg.data)
            if isinstance(req, m.ReserveRequest):
                self.reserves.append(req.ticket.decode_worker)
                await msg.respond(m.encode(m.Reserved(
                    request_id=req.ticket.request_id, reservation=m.Reservation(
                        reservation_id=f"res-{req.ticket.request_id}", epoch=1,
                        page_ids=[0], page_tokens=16, page_bytes=64,
                        data_address="tcp://127.0.0.1:9"))))

        async def on_dispatch(msg) -> None:
            self.dispatches.append(msg.subject)

        for worker in ("dec-1", "dec-2"):
            await self.nc.subscribe(m.reserve_subject(worker), cb=on_reserve)
        await self.nc.subscribe(m.dispatch_subject("pre-1"), cb=on_dispatch)
        self.beats = asyncio.ensure_future(self._beat())

    async def _beat(self) -> None:
        while True:
            for worker, fingerprint in self.prints.items():
                role = m.Role.PREFILL if worker.startswith("pre") else m.Role.DECODE
                # dec-1 has the more free KV: chosen whenever fingerprints are ignored.
                free = 8192 if worker == "dec-1" else 2048
                await self.nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                    worker_id=worker, role=role, model="tiny", pool_capacity_tokens=8192,
                    available_tokens=free, page_tokens=16, configured_context=4096,
                    served_context=4096, sent_at=time.time(), fingerprint=fingerprint)))
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.beats is not None:
            self.beats.cancel()
            await asyncio.gather(self.beats, return_exceptions=True)


def submit(request_id: str) -> bytes:
    return m.encode(m.SubmitRequest(request_id=request_id, tenant="alice", cache_salt="s",
                                    prompt_ids=[1, 2, 3], max_tokens=4,
                                    stream_key=streamauth.new_key()))


async def test_admission_on_nats_pairs_only_equal_fingerprints(nats_server: NatsServer) -> None:
    adm = AdmissionService(resolve("admission", {
        "nats_url": nats_server.url, "http_host": "127.0.0.1", "http_port": 0,
        "queue_timeout_s": 2.0}, {}))
    nc = await nats.connect(nats_server.url)
    workers = Workers(nc, {"pre-1": A, "dec-1": B, "dec-2": A})
    replies = m.Decoder(m.SubmitReply)
    try:
        await workers.start()
        await adm.start()
        deadline = time.monotonic() + 10
        while len(adm.registry.views(m.Role.DECODE)) < 2:
            assert time.monotonic() < deadline, "admission heard no heartbeats"
            await asyncio.sleep(0.05)
        for n in range(3):
            msg = await nc.request(m.SUBMIT_SUBJECT, submit(f"req-{n}"), timeout=10)
            reply = replies.decode(msg.subject, msg.data)
            assert isinstance(reply, m.Admitted) and reply.decode_worker == "dec-2", reply
        assert workers.reserves == ["dec-2"] * 3

        workers.prints["dec-2"] = B  # now no decode shares pre-1's fingerprint
        while {v.fingerprint for v in adm.registry.views(m.Role.DECODE)} != {B}:
            assert time.monotonic() < deadline + 10, "the new heartbeats did not arrive"
            await asyncio.sleep(0.05)
        dispatched = len(workers.dispatches)
        msg = await nc.request(m.SUBMIT_SUBJECT, submit("req-mismatch"), timeout=10)
        reply = replies.decode(msg.subject, msg.data)
        assert isinstance(reply, m.Rejected), reply
        assert reply.outcome.code is m.Code.NO_WORKERS
        assert "fingerprint mismatch" in reply.outcome.detail
        await asyncio.sleep(0.2)
        assert workers.reserves == ["dec-2"] * 3 and len(workers.dispatches) == dispatched
    finally:
        await adm.rt.drain("test over")
        await workers.close()
        await nc.close()
