"""Containment: a worker with valid NATS credentials reaches only the requests it serves.

An in-process lab on a real nats-server with the mesh's real per-identity permissions
(`natsauth.server_config`), the real AdmissionService and Gateway, and the two workers of
each request played by NATS clients with their own identities (an honest decode `dec-1`
that answers with the request's MAC, an honest prefill `pre-1`). `pre-2` is a second prefill
worker: valid credentials, permitted to publish on the token stream and decode's release
subject, but it serves none of these requests. It may not read any reply, and nothing it
writes (an answer, a heartbeat naming another worker) is believed. The gateway also holds the
request's own decode to `max_tokens`, to the request's stop tokens and to prefill's first
token.

The real-mesh version (`pdmesh up` processes, a real second prefill) is
tests/isolation/test_containment_mesh.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import nats
import pytest

from pdmesh.gateway import mesh as gateway_mesh
from pdmesh.gateway.app import Gateway
from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.ops import natsauth
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import resolve
from tests.support.meshproc import NatsServer

pytestmark = pytest.mark.slow
TOKENS = list(range(100, 112))  # what the honest decode answers with (tiny: 258 ids)
INJECTED = list(range(150, 178))  # what pre-2 tries to put in alice's answer
REPORTED_LP = -0.25  # the logprob prefill reports for the first token


@dataclass
class Lab:
    server: NatsServer
    ids: dict[str, natsauth.Identity]
    admission: AdmissionService
    gateway: Gateway
    clients: dict[str, nats.NATS]
    errors: list[str]
    reserves: list[m.ReserveRequest] = field(default_factory=list)
    reserved: asyncio.Event = field(default_factory=asyncio.Event)
    # How the honest decode answers a reservation: (reserve request) -> events to publish.
    answer: Callable[[m.ReserveRequest], list[m.StreamEvent]] | None = None
    # How the honest prefill reports the first token it sampled (FirstTokenLogprobs): (that
    # token, seconds after the dispatch); decode answers 0.4 s after the reservation.
    first_report: tuple[int, float] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.rt.http_port}"

    def violations(self, user: str) -> list[str]:
        return [e for e in self.errors if e.startswith(user + ":") and "ermission" in e]

    async def post(self, body: dict, key: str = "sk-dev-alice") -> tuple[int, dict]:
        async with aiohttp.ClientSession() as http, http.post(
                self.base + "/v1/completions", json={"model": "tiny", **body},
                headers={"Authorization": f"Bearer {key}"},
                timeout=aiohttp.ClientTimeout(total=20)) as resp:
            return resp.status, await resp.json()

    def refused(self, service: AdmissionService | Gateway, kind: str) -> float:
        return service.rt.refused_messages.labels(service.rt.role, kind)._value.get()


async def _client(server: NatsServer, ident: natsauth.Identity, errors: list[str]) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(f"{ident.user}: {exc}")

    return await nats.connect(ident.url(server.url), error_cb=on_error,
                              inbox_prefix=m.inbox_prefix(ident.user),
                              allow_reconnect=False, connect_timeout=2)


def _honest_answer(req: m.ReserveRequest) -> list[m.StreamEvent]:
    rid = req.ticket.request_id
    return [m.TokenEvent(request_id=rid, seq=i, token_ids=[t], prompt_tokens=3,
                         finish=m.FINISHED_LENGTH if i == len(TOKENS) - 1 else None)
            for i, t in enumerate(TOKENS)]


@contextlib.asynccontextmanager
async def lab(tmp_path: Path) -> AsyncIterator[Lab]:
    ids = natsauth.mesh_identities([("admission", "adm-1"), ("decode", "dec-1"),
                                    ("decode", "dec-2"), ("prefill", "pre-1"),
                                    ("prefill", "pre-2"), ("gateway", "gw-1")])
    (tmp_path / "nats.conf").write_text(natsauth.server_config(ids.values()))
    server = NatsServer(config=tmp_path / "nats.conf").start()
    errors: list[str] = []
    common = {"nats_url": server.url, "http_port": 0, "http_host": "127.0.0.1",
              "queue_timeout_s": 1.0}
    a, g = ids["adm-1"], ids["gw-1"]
    admission = AdmissionService(resolve("admission", {
        **common, "nats_user": a.user, "nats_password": a.password, "worker_id": "adm-1"}, {}))
    gateway = Gateway(resolve("gateway", {
        **common, "model": "tiny", "nats_user": g.user, "nats_password": g.password,
        "worker_id": "gw-1", "prefill_stall_s": 5.0}, {}))
    clients = {name: await _client(server, ids[name], errors)
               for name in ("dec-1", "dec-2", "pre-1", "pre-2", "tools")}
    state = Lab(server, ids, admission, gateway, clients, errors)
    tasks: list[asyncio.Task] = []
    dec, pre = clients["dec-1"], clients["pre-1"]

    async def on_reserve(msg) -> None:
        req = m.Decoder(m.ToReserve).decode(msg.subject, msg.data)
        if not isinstance(req, m.ReserveRequest):
            return
        state.reserves.append(req)
        state.reserved.set()
        rid = req.ticket.request_id
        await msg.respond(m.encode(m.Reserved(request_id=rid, reservation=m.Reservation(
            reservation_id=f"res-{rid}", epoch=7, page_ids=[3], page_tokens=16,
            page_bytes=4096, data_address="tcp://127.0.0.1:9"))))

        async def answer() -> None:  # after pre-2 had its chance to go first
            await asyncio.sleep(0.4)
            key = streamauth.parse_key(req.stream_key)
            for ev in (state.answer or _honest_answer)(req):
                subject = m.tokens_subject(rid)
                data = m.encode(ev)
                await dec.publish(subject, data, headers=streamauth.sign(key, subject, data))

        tasks.append(asyncio.ensure_future(answer()))

    async def on_dispatch(msg) -> None:
        d = m.Decoder(m.PrefillDispatch).decode(msg.subject, msg.data)
        if state.first_report is not None:
            token, after_s = state.first_report
            subject, key = m.tokens_subject(d.ticket.request_id), streamauth.parse_key(
                d.stream_key)
            data = m.encode(m.FirstTokenLogprobs(request_id=d.ticket.request_id,
                                                 token_id=token,
                                                 logprobs=[(REPORTED_LP, [(token, REPORTED_LP)])]))

            async def report() -> None:
                await asyncio.sleep(after_s)
                await pre.publish(subject, data, headers=streamauth.sign(key, subject, data))

            tasks.append(asyncio.ensure_future(report()))

    await dec.subscribe(m.reserve_subject("dec-1"), cb=on_reserve)
    await pre.subscribe(m.dispatch_subject("pre-1"), cb=on_dispatch)

    async def beats() -> None:
        while True:
            for nc, worker, role in ((pre, "pre-1", m.Role.PREFILL),
                                     (dec, "dec-1", m.Role.DECODE)):
                await nc.publish(m.heartbeat_subject(role, worker), m.encode(m.Heartbeat(
                    worker_id=worker, role=role, model="tiny", pool_capacity_tokens=1 << 16,
                    available_tokens=1 << 16, page_tokens=16, configured_context=4096,
                    served_context=4096, sent_at=time.time())))
            await asyncio.sleep(0.2)

    tasks.append(asyncio.ensure_future(beats()))
    try:
        await admission.start()
        await gateway.start()
        deadline = time.monotonic() + 10
        while not (admission.registry.views(m.Role.DECODE)
                   and gateway.registry.views(m.Role.DECODE)):
            assert time.monotonic() < deadline, "no heartbeat reached admission and gateway"
            await asyncio.sleep(0.05)
        yield state
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gateway.rt.drain("test over")
        await admission.rt.drain("test over")
        for nc in clients.values():
            with contextlib.suppress(Exception):
                await nc.close()
        server.stop()


async def test_no_identity_reads_another_identitys_replies(tmp_path: Path) -> None:
    """Every identity may read its own inbox only: `_INBOX.>` and another user's inbox are
    permission violations, and a request served meanwhile shows them nothing."""
    async with lab(tmp_path) as lb:
        seen: dict[str, list[str]] = {}
        for name in ("pre-2", "dec-2", "tools"):
            nc = lb.clients[name]
            sink = seen.setdefault(name, [])

            async def record(msg, sink=sink) -> None:
                sink.append(msg.subject)

            await nc.subscribe("_INBOX.>", cb=record)
            await nc.subscribe(f"{m.inbox_prefix('gw-1')}.>", cb=record)
            await nc.subscribe(f"{m.inbox_prefix('adm-1')}.>", cb=record)
            await nc.flush()
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS)})
        assert status == 200, body
        await asyncio.sleep(0.3)
        for name in ("pre-2", "dec-2", "tools"):
            assert seen[name] == [], (name, seen[name])
            assert len(lb.violations(name)) >= 3, (name, lb.errors)


async def test_a_worker_that_does_not_serve_a_request_cannot_write_its_answer(
        tmp_path: Path) -> None:
    """pre-2 knows alice's request id (from a log, a guess) and publishes a finished answer
    on its stream first: the gateway drops it and counts it; alice gets decode's tokens."""
    async with lab(tmp_path) as lb:
        evil = lb.clients["pre-2"]
        injected: list[str] = []

        async def inject_when_reserved() -> None:
            await lb.reserved.wait()
            rid = lb.reserves[0].ticket.request_id
            subject = m.tokens_subject(rid)
            for key in (None, streamauth.new_key()):  # no MAC, then a MAC under its own key
                data = m.encode(m.TokenEvent(request_id=rid, seq=0, token_ids=INJECTED,
                                             finish=m.FINISHED_STOP, prompt_tokens=3))
                headers = (None if key is None
                           else streamauth.sign(streamauth.parse_key(key), subject, data))
                await evil.publish(subject, data, headers=headers)
            await evil.publish(subject, m.encode(m.StreamFailed(
                request_id=rid, outcome=m.Outcome(code=m.Code.ABORTED, detail="forged"))))
            await evil.flush()
            injected.append(rid)

        task = asyncio.ensure_future(inject_when_reserved())
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS)})
        await task
        assert injected
        assert status == 200, body
        assert body["choices"][0]["text"] == lb.gateway.tokenizer.decode(TOKENS)
        assert body["usage"]["completion_tokens"] == len(TOKENS)
        assert lb.refused(lb.gateway, "stream_mac") == 3
        assert not lb.violations("pre-2")  # NATS allowed it: the MAC is what refused it


async def test_a_heartbeat_naming_another_worker_is_not_believed(tmp_path: Path) -> None:
    """pre-2, on its own permitted heartbeat subject, says dec-1 is draining: admission and
    the gateway keep dec-1 and count the lie; requests are still served."""
    async with lab(tmp_path) as lb:
        evil = lb.clients["pre-2"]
        for _ in range(10):
            await evil.publish(m.heartbeat_subject("prefill", "pre-2"), m.encode(m.Heartbeat(
                worker_id="dec-1", role=m.Role.DECODE, model="tiny", draining=True,
                ready=False, sent_at=time.time())))
        await evil.flush()
        await asyncio.sleep(0.3)
        assert [v.worker_id for v in lb.admission.registry.views(m.Role.DECODE)] == ["dec-1"]
        assert lb.gateway.registry.get("dec-1") is not None
        assert lb.refused(lb.admission, "heartbeat_subject") == 10
        assert lb.refused(lb.gateway, "heartbeat_subject") == 10
        status, body = await lb.post({"prompt": "hi", "max_tokens": len(TOKENS)})
        assert status == 200, body


async def test_the_gateway_holds_decode_to_max_tokens(tmp_path: Path) -> None:
    """The request's own decode sends 28 tokens for max_tokens=8: the client gets 8, ending
    with `length`, and the excess is counted."""
    async with lab(tmp_path) as lb:
        lb.answer = lambda req: [m.TokenEvent(request_id=req.ticket.request_id, seq=0,
                                              token_ids=INJECTED, finish=m.FINISHED_STOP,
                                              prompt_tokens=3)]
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": 8})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"] == lb.gateway.tokenizer.decode(INJECTED[:8])
        assert body["choices"][0]["finish_reason"] == "length"
        assert lb.refused(lb.gateway, "over_max_tokens") == 1


@pytest.mark.parametrize("report_after_s", [0.0, 0.8], ids=["report-first", "report-late"])
async def test_decode_must_start_with_the_token_prefill_sampled(tmp_path: Path,
                                                                report_after_s: float) -> None:
    """Prefill reports first token T+1 with its logprobs, decode's seq 0 carries T: the
    request fails instead of answering with a first token nobody sampled, also when
    prefill's report comes after decode's token."""
    async with lab(tmp_path) as lb:
        lb.first_report = (TOKENS[0] + 1, report_after_s)
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS),
                                      "logprobs": 1})
        assert status >= 500, body
        assert lb.refused(lb.gateway, "first_token_mismatch") == 1


async def test_a_first_token_report_after_decodes_token_still_gives_its_logprobs(
        tmp_path: Path) -> None:
    """Prefill's report of the first token (its logprobs) arrives after decode's seq 0
    (different workers, different connections): the reply still carries the first token's
    logprobs (lm-eval's loglikelihood reads the sum of those it gets)."""
    async with lab(tmp_path) as lb:
        lb.first_report = (TOKENS[0], 0.8)
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS),
                                      "logprobs": 1})
        assert status == 200, body
        lp = body["choices"][0]["logprobs"]
        # the lab's decode sends no logprobs for its own tokens: only the reported one
        assert lp["token_logprobs"] == [REPORTED_LP], lp


async def test_a_first_token_report_that_never_comes_fails_the_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Logprobs asked for and prefill never reports the first token: a clear 5xx after
    FIRST_REPORT_WAIT_S, not a reply whose logprobs silently lack the first token."""
    monkeypatch.setattr(gateway_mesh, "FIRST_REPORT_WAIT_S", 1.0)
    async with lab(tmp_path) as lb:
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS),
                                      "logprobs": 1})
        assert status == 502, body
        assert "first token" in body["error"]["message"], body


async def test_the_gateway_ends_the_stream_at_a_stop_token(tmp_path: Path) -> None:
    """The request's own decode goes on past one of the request's `stop_token_ids`: the client
    gets the tokens up to it and `stop`, and the overstep is counted."""
    async with lab(tmp_path) as lb:
        stop_at = 4
        status, body = await lb.post({"prompt": "What is 2+2?", "max_tokens": len(TOKENS),
                                      "stop_token_ids": [TOKENS[stop_at]]})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == stop_at + 1
        assert body["choices"][0]["finish_reason"] == "stop"
        assert lb.refused(lb.gateway, "past_stop") == 1
