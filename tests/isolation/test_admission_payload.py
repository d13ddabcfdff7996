"""Admission on an authenticated NATS whose max_payload is below the mesh's (an operator's
own server): a prompt whose submit fits but whose dispatch does not is rejected with a
clear reason, and the decode reservation admission took for it is freed at once, on a
subject admission's NATS identity may publish to. (It used to publish prefill's `Release`
on the release subject: NATS refused it as a permissions violation, and the lease waited
for decode's prefill-stall timeout.)

The real admission service and a real nats-server with the mesh's per-role permissions;
decode and prefill are played by NATS clients holding their roles' identities (decode
answers the reserve as a worker would and records what reaches its subjects).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import nats

from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.ops import natsauth
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer

SMALL_PAYLOAD = 65536


async def _client(server: NatsServer, ident: natsauth.Identity, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(ident.url(server.url), error_cb=on_error,
                              inbox_prefix=m.inbox_prefix(ident.user),
                              allow_reconnect=False, connect_timeout=2)


async def test_a_dispatch_over_max_payload_frees_the_reservation_at_once(tmp_path: Path) -> None:
    ids = natsauth.mesh_identities([("admission", "adm-1"), ("decode", "dec-1"),
                                    ("prefill", "pre-1"), ("gateway", "gw-1")])
    conf = natsauth.server_config(ids.values())
    assert conf.startswith(f"max_payload: {natsauth.MAX_PAYLOAD_BYTES}\n")
    path = tmp_path / "nats.conf"
    path.write_text(conf.replace(f"max_payload: {natsauth.MAX_PAYLOAD_BYTES}\n",
                                 f"max_payload: {SMALL_PAYLOAD}\n", 1))
    server = NatsServer(config=path).start()
    errors: list[str] = []
    adm_ident = ids["adm-1"]
    cfg = resolve("admission", {"nats_url": server.url, "nats_user": adm_ident.user,
                                "nats_password": adm_ident.password, "worker_id": "adm-1",
                                "http_port": 0, "http_host": "127.0.0.1",
                                "reserve_timeout_s": 2.0}, {})
    admission = AdmissionService(cfg)
    decode = await _client(server, ids["dec-1"], errors)
    prefill = await _client(server, ids["pre-1"], errors)
    gateway = await _client(server, ids["gw-1"], errors)
    heard: list[object] = []
    second = asyncio.Event()
    beats: asyncio.Future | None = None
    try:
        await admission.start()

        async def on_reserve(msg) -> None:
            req = m.Decoder(m.ToReserve).decode(msg.subject, msg.data)
            heard.append(req)
            if len(heard) >= 2:
                second.set()
            if isinstance(req, m.ReserveRequest):
                await msg.respond(m.encode(m.Reserved(
                    request_id=req.ticket.request_id, reservation=m.Reservation(
                        reservation_id="lease-1", epoch=1, page_ids=[3, 4], page_tokens=16,
                        page_bytes=4096, data_address="tcp://127.0.0.1:9"))))

        async def on_release(msg) -> None:
            heard.append(m.Decoder(m.Release).decode(msg.subject, msg.data))
            if len(heard) >= 2:
                second.set()

        await decode.subscribe(m.reserve_subject("dec-1"), cb=on_reserve)
        await decode.subscribe(m.release_subject("dec-1"), cb=on_release)

        async def beat() -> None:
            while True:
                for nc, worker, role in ((prefill, "pre-1", m.Role.PREFILL),
                                         (decode, "dec-1", m.Role.DECODE)):
                    await nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                        worker_id=worker, role=role, model="tiny",
                        pool_capacity_tokens=1 << 20, available_tokens=1 << 20,
                        page_tokens=16, configured_context=1 << 18, served_context=1 << 18,
                        sent_at=time.time())))
                await asyncio.sleep(0.2)

        beats = asyncio.ensure_future(beat())
        deadline = time.monotonic() + 10
        while not (admission.registry.views(m.Role.DECODE)
                   and admission.registry.views(m.Role.PREFILL)):
            assert time.monotonic() < deadline, "admission heard no heartbeat"
            await asyncio.sleep(0.05)

        # A prompt whose submit fits the server's max_payload and whose dispatch (the same
        # prompt plus the signed ticket, the reservation and the grant) does not.
        def submit(n: int) -> m.SubmitRequest:
            return m.SubmitRequest(request_id="req-1", tenant="alice", cache_salt="s",
                                   prompt_ids=[70_000] * n, max_tokens=4,
                                   stream_key=streamauth.new_key())

        # Within 150 bytes of the limit: the dispatch adds the ticket, grant, keys and
        # reservation (over 500 bytes) to the same prompt.
        n = 1000
        while len(m.encode(submit(n + 20))) < SMALL_PAYLOAD - 150:
            n += 20
        assert SMALL_PAYLOAD - 250 < len(m.encode(submit(n))) < SMALL_PAYLOAD - 150
        reply = await gateway.request(m.SUBMIT_SUBJECT, m.encode(submit(n)), timeout=10)
        answer = m.Decoder(m.SubmitReply).decode(reply.subject, reply.data)
        assert isinstance(answer, m.Rejected), answer
        assert answer.outcome.code is m.Code.INVALID
        assert "max_payload" in answer.outcome.detail

        with contextlib.suppress(TimeoutError):  # decode's second message, if it comes
            await asyncio.wait_for(second.wait(), 3)
        assert isinstance(heard[0], m.ReserveRequest)
        assert len(heard) == 2, ("decode never heard that admission let go of its "
                                 f"reservation; NATS errors: {errors}")
        freed = heard[1]
        assert isinstance(freed, m.ReserveCancel), freed
        assert freed.request_id == "req-1" and freed.nonce == heard[0].ticket.nonce
        assert freed.outcome.code is m.Code.INVALID
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        await admission.rt.drain("test over")
        for nc in (decode, prefill, gateway):
            await nc.close()
        server.stop()

