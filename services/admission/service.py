"""Admission service: decides before anything is allocated, then reserves and dispatches.

Request lifecycle as admission sees it:
  RECEIVED -> (policy.decide) -> REJECTED (terminal: reply 4xx, no worker hears of it)
                              -> ADMITTED -> reserve on decode -> RESERVED -> dispatch prefill
A failed reservation ends the request as REJECTED(SATURATED) after at most one other try; a
dispatch is published only with a reservation in hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from pdmesh.services import faults
from pdmesh.services.admission.policy import (
    AdmissionPolicy,
    Admitted,
    LivePolicy,
    Rejected,
    Retry,
    WorkerView,
)
from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth, tickets
from pdmesh.services.protocol.lifecycle import Lifecycle, RequestState
from pdmesh.services.runtime.config import AdmissionConfig
from pdmesh.services.runtime.service import ServiceRuntime, counter_total, run_service

log = logging.getLogger("pdmesh.admission")


class AdmissionService:
    def __init__(self, cfg: AdmissionConfig, policy: AdmissionPolicy | None = None) -> None:
        self.cfg = cfg
        # The decision is injected: test meshes with faults allowed pass a policy that can
        # be told to skip the checks (services/faults.py); production uses LivePolicy.
        self.policy = policy or LivePolicy()
        self.rt = ServiceRuntime(cfg)
        self.registry = CapacityRegistry(cfg.worker_ttl_s)
        self.signer = tickets.Signer(cfg.signing_key)  # only admission holds it
        self._capacity_changed = asyncio.Event()
        r = self.rt.registry
        self.decisions = Counter("pdmesh:admission_decisions_total", "Admission decisions",
                                 ["outcome"], registry=r)
        self.rejections = Counter("pdmesh:rejections_total", "Rejections by reason",
                                  ["reason"], registry=r)
        self.tickets_issued = Counter("pdmesh:tickets_issued_total", "Signed tickets",
                                      registry=r)
        self.reservations = Counter("pdmesh:admission_reservations_total",
                                    "Reservation attempts by outcome", ["outcome"], registry=r)
        self.dispatches = Counter("pdmesh:dispatches_total", "Prefill dispatches sent",
                                  registry=r)
        self.decision_seconds = Histogram(
            "pdmesh:admission_decision_seconds", "Time to answer a submit",
            ["outcome"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))

    async def start(self) -> None:
        rt = self.rt
        await rt.start_http()
        await rt.connect()
        await rt.subscribe_heartbeats(m.HEARTBEAT_WILDCARD, self._on_heartbeat)
        await rt.subscribe(m.SUBMIT_SUBJECT, m.SubmitRequest, self._on_submit,
                           queue="admission")
        # Every admission instance hears these (no queue group): each keeps its own registry.
        await rt.subscribe(m.UNREACHABLE_SUBJECT, m.DataPlaneUnreachable, self._on_unreachable,
                           concurrent=False)
        await rt.serve_stats(self._stats)
        rt.every(self.cfg.heartbeat_s, self._expire, "expire-workers")
        rt.mark_ready()

    async def _expire(self) -> None:
        for w in self.registry.expire():
            log.warning("worker %s stopped heartbeating; removed from the registry", w)

    async def _on_unreachable(self, report: m.DataPlaneUnreachable, _msg: Msg) -> None:
        log.warning("worker %s set aside: %s cannot reach its data plane at %s (%s)",
                    report.worker_id, report.reporter, report.data_address, report.detail)
        self.registry.set_aside(report.worker_id, report.data_address)

    async def _on_heartbeat(self, beat: m.Heartbeat, _msg: Msg) -> None:
        if beat.role in (m.Role.PREFILL, m.Role.DECODE):
            if beat.capacity_mismatch and self.registry.get(beat.worker_id) is None:
                # Once per worker joining (not every heartbeat): the worker logs it too.
                log.warning("worker %s serves a clamped context: configured %d > pool %d",
                            beat.worker_id, beat.configured_context, beat.pool_capacity_tokens)
            self.registry.observe(beat)
            self._capacity_changed.set()  # wake submits waiting for capacity

    def _stats(self) -> m.StatsReply:
        counters = {name: counter_total(c) for name, c in (
            ("rejections", self.rejections), ("tickets_issued", self.tickets_issued),
            ("dispatches", self.dispatches))}
        return m.StatsReply(worker_id=self.cfg.worker_id, role=m.Role.ADMISSION,
                            counters=counters)

    # -- the decision -----------------------------------------------------------------
    async def _on_submit(self, req: m.SubmitRequest, msg: Msg) -> None:
        t0 = time.perf_counter()
        reply = await self.handle(req, msg.headers or {})
        outcome = "admitted" if isinstance(reply, m.Admitted) else "rejected"
        self.decision_seconds.labels(outcome).observe(time.perf_counter() - t0)
        await self.rt.respond(msg, reply)

    async def handle(self, req: m.SubmitRequest,
                     headers: Mapping[str, str] | None = None) -> m.SubmitReply:
        """Admit (reserve + dispatch) or reject: RECEIVED -> ADMITTED or REJECTED, through
        the lifecycle's checks (a reply can only reject with a rejection code)."""
        life = Lifecycle(req.request_id)
        try:
            streamauth.parse_key(req.stream_key)
        except ValueError as exc:
            # The gateway makes one per request: a submit without it has no stream to trust.
            reply: m.SubmitReply = self._reject(req, Rejected(
                m.Code.INVALID, f"submit without a valid stream key: {exc}"))
        else:
            reply = await self._decide(req, headers or {})
        if isinstance(reply, m.Rejected):
            life.finish(reply.outcome)
        else:
            life.advance(RequestState.ADMITTED)
        return reply

    async def _decide(self, req: m.SubmitRequest,
                      headers: Mapping[str, str]) -> m.SubmitReply:
        """Static limits reject at once; a mesh that is only busy right now is waited on for
        up to `queue_timeout_s`, as a serving engine queues, before the request is rejected
        as saturated (429)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.queue_timeout_s
        tried: set[str] = set()
        attempts = 0  # reserve requests made for this request
        decision: Admitted | Rejected
        while True:
            # Cache-aware: each prefill's view says how much of this tenant's prompt it holds.
            prefills = self.registry.views(m.Role.PREFILL, cache_salt=req.cache_salt,
                                           prompt_ids=req.prompt_ids)
            decodes = [d for d in self.registry.views(m.Role.DECODE) if d.worker_id not in tried]
            if tried and not decodes:
                pass  # every live decode refused this request: keep its refusal as the answer
            else:
                decision = self.policy.decide(  # guard: admission-decides
                    req, prefills, decodes, headers)
            if isinstance(decision, Admitted):
                reply = await self._reserve_and_dispatch(req, decision, headers, attempts)
                attempts += 1
                if isinstance(reply, m.Admitted):
                    return reply
                if isinstance(reply, Rejected):  # the decode's own gate: final, no queueing
                    return self._reject(req, reply)
                # That decode refused (its pool changed since its heartbeat): prefer the
                # others until its next heartbeat shows what it really has.
                tried.add(decision.decode.worker_id)
                decision = Rejected(m.Code.SATURATED,
                                    f"decode worker {decision.decode.worker_id} could not "
                                    f"reserve the KV pages: {reply.why}")
            elif decision.reason is not m.Code.SATURATED:
                return self._reject(req, decision)
            if loop.time() >= deadline:
                return self._reject(req, decision)
            self._capacity_changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._capacity_changed.wait(),
                                       min(0.25, max(deadline - loop.time(), 0.01)))
            if self._capacity_changed.is_set():
                tried.clear()  # fresh heartbeats: every decode may be asked again

    def _reject(self, req: m.SubmitRequest, rej: Rejected) -> m.Rejected:
        self.decisions.labels("rejected").inc()
        self.rejections.labels(rej.reason.label).inc()
        log.info("rejected %s (%s): %s", req.request_id, rej.reason.name, rej.message)
        return m.Rejected(request_id=req.request_id,
                          outcome=m.Outcome(code=rej.reason, detail=rej.message),
                          prompt_len=len(req.prompt_ids), max_tokens=req.max_tokens,
                          limit=rej.limit)

    async def _reserve_and_dispatch(self, req: m.SubmitRequest, decision: Admitted,
                                    headers: Mapping[str, str],
                                    attempt: int = 0) -> m.Admitted | Rejected | Retry:
        """Only an `Admitted` decision reaches here (the type says so): reserve on decode,
        then dispatch. Returns the admitted reply, a final rejection (the decode's own
        capacity gate refused it), or `Retry` (that decode did not reserve now)."""
        prefill: WorkerView = decision.prefill
        decode: WorkerView = decision.decode
        ticket = self.signer.sign(
            request_id=req.request_id, tenant=req.tenant,
            cache_salt=req.cache_salt, prompt_len=len(req.prompt_ids),
            max_tokens=req.max_tokens, prefill_worker=prefill.worker_id,
            decode_worker=decode.worker_id, ttl_s=self.cfg.ticket_ttl_s)
        self.tickets_issued.inc()
        # This reservation's data-plane key: made here, known only to the two workers.
        data_key = streamauth.new_key()
        try:
            res = await self.rt.request(m.reserve_subject(decode.worker_id),
                                        m.ReserveRequest(ticket=ticket, sampling=req.sampling,
                                                         stream_key=req.stream_key,
                                                         data_key=data_key),
                                        m.ReserveReply, self.cfg.reserve_timeout_s,
                                        headers=self.policy.reserve_headers(
                                            req.request_id, headers, attempt))
        except (TimeoutError, m.MessageError) as exc:
            self.reservations.labels("error").inc()
            log.warning("reserve on %s for %s failed: %s", decode.worker_id, req.request_id, exc)
            # The decode worker may have reserved after our deadline: tell that worker, and
            # only it, to let go of this ticket's reservation. (A broadcast Abort of the
            # request would also end it where the retry below places it, and the late
            # worker's failure event would end the client's request.)
            await self.rt.publish(m.reserve_subject(decode.worker_id), m.ReserveCancel(
                request_id=req.request_id, nonce=ticket.nonce,  # guard: reserve-cancel
                outcome=m.Outcome(code=m.Code.RESERVE_FAILED, detail=str(exc))))
            return Retry(str(exc))
        if isinstance(res, m.ReserveRefused):
            self.reservations.labels("refused").inc()
            detail = res.outcome.detail
            log.info("decode %s refused %s: %s", decode.worker_id, req.request_id, detail)
            if res.outcome.code is m.Code.REFUSED:
                return Rejected(m.Code.EXCEEDS_DECODE_POOL,
                                f"decode worker {decode.worker_id} refuses: {detail}")
            return Retry(detail or "refused")
        self.reservations.labels("ok").inc()
        self.registry.charge(m.Role.DECODE, decode.worker_id,
                             len(req.prompt_ids) + req.max_tokens)
        self.registry.charge(m.Role.PREFILL, prefill.worker_id, len(req.prompt_ids))
        try:
            await self.rt.publish(m.dispatch_subject(prefill.worker_id), m.PrefillDispatch(
                ticket=ticket, prompt_ids=req.prompt_ids, sampling=req.sampling,
                reservation=res.reservation,
                grant=self.signer.grant(ticket, req.prompt_ids, res.reservation),
                stream_key=req.stream_key, data_key=data_key),
                headers=self.policy.dispatch_headers(headers))
        except nats.errors.MaxPayloadError as exc:
            # A NATS configured below the mesh's max_payload (services/ops/natsauth.py): the
            # submit fitted, its dispatch does not. Decode lets go now, quietly: the client
            # learns why from admission. On the reserve subject, which admission may publish
            # to (a Release on the release subject is prefill's: NATS refused admission's).
            await self.rt.publish(m.reserve_subject(decode.worker_id), m.ReserveCancel(
                request_id=req.request_id, nonce=ticket.nonce,  # guard: payload-cancel
                outcome=m.Outcome(code=m.Code.INVALID, detail=str(exc))))
            return Rejected(m.Code.INVALID, "the prompt's dispatch exceeds this mesh's NATS "
                            f"max_payload ({self.rt.nc.max_payload} bytes): {exc}")
        self.dispatches.inc()
        self.decisions.labels("admitted").inc()
        return m.Admitted(request_id=req.request_id, decode_worker=decode.worker_id,
                          prefill_worker=prefill.worker_id)


async def serve(cfg: AdmissionConfig) -> None:
    svc = AdmissionService(cfg, faults.admission_policy(cfg))
    await run_service(svc.rt, svc.start)
