"""Admission service: decides before anything is allocated, then reserves and dispatches.

Request lifecycle as admission sees it:
  RECEIVED -> (policy.decide) -> REJECTED (terminal: reply 4xx, no worker hears of it)
                              -> ADMITTED -> reserve on decode -> RESERVED -> dispatch prefill
A failed reservation ends the request as REJECTED(SATURATED) after at most one other try; a
dispatch is published only with a reservation in hand. A request is never placed on a worker
its submit avoids (`avoid_workers`), nor on a prefill and a decode whose engine
fingerprints differ (policy.py).

Drain (SIGTERM, POST /drain): admission leaves the submit queue group at once, so NATS hands
new submits to the other admission replicas; the submits it holds carry on (the runtime
waits up to `drain_timeout_s` for them), and those still waiting for capacity at the drain
timeout are answered SATURATED with a Retry-After, not left to the gateway's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client import Counter, Histogram

from pdmesh.kvstore.spec import pages_for
from pdmesh.services import faults
from pdmesh.services.admission.fairqueue import FairQueue, Waiter
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
from pdmesh.services.runtime.service import ServiceRuntime, counter_total, run_service, settle
from pdmesh.services.runtime.tracing import end

log = logging.getLogger("pdmesh.admission")


class AdmissionService:
    def __init__(self, cfg: AdmissionConfig, policy: AdmissionPolicy | None = None) -> None:
        self.cfg = cfg
        # The decision is injected: test meshes with faults allowed pass a policy that can
        # be told to skip the checks (services/faults.py); production uses LivePolicy.
        self.policy = policy or LivePolicy()
        self.rt = ServiceRuntime(cfg)
        self.trace = self.rt.trace  # the protocol trace (None: off)
        self.registry = CapacityRegistry(cfg.worker_ttl_s)
        self.signer = tickets.Signer(cfg.signing_key)  # only admission holds it
        # Waiting submits wake on a heartbeat or when the fair line moves.
        self._wake = asyncio.Event()
        self._beats = 0  # heartbeats seen: a waiter re-asks decodes that refused it after one
        self.line = FairQueue()
        # The submit subscription (in the admission queue group), until a drain starts.
        self._submits: Subscription | None = None
        self._submits_in_flight = 0  # submits being decided or answered now
        self._cutting = False  # the drain timed out: waiting submits are answered now
        self.cut_submits = 0  # submits a drain answered SATURATED while they waited
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
        self._submits = await rt.subscribe(m.SUBMIT_SUBJECT, m.SubmitRequest, self._on_submit,
                                           queue="admission")
        rt.on_drain_start(self._leave_submit_queue)
        rt.track_inflight(lambda: self._submits_in_flight)
        rt.on_handoff(self._cut_waiting)
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
            self._beats += 1
            self._wake.set()  # wake submits waiting for capacity

    def _stats(self) -> m.StatsReply:
        counters = {name: counter_total(c) for name, c in (
            ("rejections", self.rejections), ("tickets_issued", self.tickets_issued),
            ("dispatches", self.dispatches))}
        return m.StatsReply(worker_id=self.cfg.worker_id, role=m.Role.ADMISSION,
                            counters=counters)

    # -- the decision -----------------------------------------------------------------
    async def _on_submit(self, req: m.SubmitRequest, msg: Msg) -> None:
        with self._in_flight(), self.rt.tracing.current(
                "admission.request", msg.headers, kind="server",
                **{"pdmesh.request_id": req.request_id, "pdmesh.tenant": req.tenant,
                   "gen_ai.usage.input_tokens": len(req.prompt_ids),
                   "gen_ai.request.max_tokens": req.max_tokens,
                   "pdmesh.choices": 1 + len(req.choices),
                   "pdmesh.resumes": req.resumes or None}) as span:
            t0 = time.perf_counter()
            reply = await self.handle(req, msg.headers or {})
            outcome = "admitted" if isinstance(reply, m.Admitted) else "rejected"
            self.decision_seconds.labels(outcome).observe(time.perf_counter() - t0)
            if span is not None:
                end(span, **{"pdmesh.verdict": outcome, "pdmesh.outcome": reply.outcome.label
                             if isinstance(reply, m.Rejected) else None})
            await self.rt.respond(msg, reply)

    @property
    def taking_submits(self) -> bool:
        """Whether this admission is in the submit queue group (until a drain starts)."""
        return self._submits is not None

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        """A submit from its arrival to its answer: what a drain waits for."""
        self._submits_in_flight += 1
        try:
            yield
        finally:
            self._submits_in_flight -= 1

    # -- drain ------------------------------------------------------------------------
    async def _leave_submit_queue(self) -> None:
        """Drain start: no new submits here. Draining the subscription (not unsubscribing)
        sends NATS the unsubscribe, then handles the submits already delivered to this
        process, so none is dropped; NATS gives the next ones to the queue group's other
        members."""
        sub, self._submits = self._submits, None
        if sub is not None:
            try:
                await asyncio.wait_for(sub.drain(), SUBMIT_QUEUE_LEAVE_S)
            except (TimeoutError, nats.errors.Error) as exc:
                log.warning("admission %s: leaving the submit queue: %r", self.cfg.worker_id,
                            exc)

    async def _cut_waiting(self) -> int:
        """At the drain timeout: answer every submit still waiting for capacity now
        (SATURATED, with a Retry-After: another admission replica may take it), and let
        those past their decision (reserving, dispatching) finish, for up to a reserve
        timeout. Returns how many were answered so."""
        before = self.cut_submits
        self._cutting = True
        self._wake.set()
        await settle(lambda: self._submits_in_flight, self.cfg.reserve_timeout_s + CUT_GRACE_S)
        return self.cut_submits - before

    async def handle(self, req: m.SubmitRequest,
                     headers: Mapping[str, str] | None = None) -> m.SubmitReply:
        """Admit (reserve + dispatch) or reject: RECEIVED -> ADMITTED or REJECTED, through
        the lifecycle's checks (a reply can only reject with a rejection code)."""
        life = Lifecycle(req.request_id)
        # The gateway makes a stream key per choice: a submit without one has no stream to
        # trust.
        problem = submit_problem(req)
        if problem:
            reply: m.SubmitReply = self._reject(req, Rejected(
                m.Code.INVALID, f"submit refused: {problem}"))
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
        as saturated (429). While it waits it stands in the tenants' fair line (fairqueue.py):
        only the line's first eligible request may take capacity, and a request whose
        tenant holds its KV share is not eligible until the tenant's holdings fall."""
        loop = asyncio.get_running_loop()
        arrived = time.monotonic()
        deadline = loop.time() + self.cfg.queue_timeout_s
        waiter = self.line.enter(req.tenant, float(_need_tokens(req)), req.weight, item=req,
                                 priority=req.priority)
        served = False
        avoid = frozenset(req.avoid_workers)
        tried: set[str] = set()
        beats = self._beats
        attempts = 0  # admission attempts made for this request
        waited = False  # it waited for capacity since its arrival (or its last attempt)
        decision: Admitted | list[Admitted] | Rejected
        refusal = Rejected(m.Code.SATURATED, "no decode worker could reserve the KV pages")
        try:
            while True:
                if self._cutting:  # the drain timed out with this submit still waiting
                    self.cut_submits += 1
                    return self._reject(req, Rejected(
                        m.Code.SATURATED, f"admission {self.cfg.worker_id} is shutting down; "
                        "retry", retry_after_s=RETRY_AFTER_S))
                over = self._over_share(req)
                if over is not None:
                    decision = over
                elif self.line.first(self._eligible) is not waiter:  # guard: fair-line
                    decision = Rejected(m.Code.SATURATED, "the decode KV is busy and other "
                                        "tenants' requests are ahead in the fair queue")
                else:
                    # Cache-aware: each prefill's view says how much of this tenant's
                    # prompt it holds.
                    prefills = self.registry.views(m.Role.PREFILL, cache_salt=req.cache_salt,
                                                   prompt_ids=req.prompt_ids, avoid=avoid)
                    decodes = [d for d in self.registry.views(m.Role.DECODE, avoid=avoid)
                               if d.worker_id not in tried]
                    if not tried or decodes:
                        decision = self.policy.decide(  # guard: admission-decides
                            req, prefills, decodes, headers)
                        if (tried and isinstance(decision, Rejected)
                                and decision.reason is m.Code.NO_WORKERS):
                            # The decodes left pair with no prefill (other fingerprints):
                            # those that do refused just now, as below.
                            decision = refusal
                    else:  # every live decode refused: its refusal is the answer
                        decision = refusal
                    if isinstance(decision, Admitted):
                        decision = self._place_choices(req, decision, prefills, decodes,
                                                       headers)
                    if isinstance(decision, list):
                        if self.trace is not None:
                            self.trace.emit("decide", req=req.request_id, verdict="admit",
                                            reason="", attempt=attempts)
                        if waited:  # the time it stood in the fair line
                            self.rt.tracing.record("admission.queue", self.rt.tracing.active(),
                                                   arrived, time.monotonic())
                            waited = False
                        reply = await self._admit(req, decision, headers, attempts, arrived)
                        attempts += 1
                        if isinstance(reply, m.Admitted):
                            served = True
                            return reply
                        if isinstance(reply, Rejected):  # a decode's own gate: final
                            return self._reject(req, reply)
                        # That decode refused (its pool changed since its heartbeat):
                        # prefer the others until its next heartbeat shows what it has.
                        if reply.worker_id:
                            tried.add(reply.worker_id)
                        decision = refusal = Rejected(
                            m.Code.SATURATED, f"decode worker {reply.worker_id or '(any)'} "
                            f"could not reserve the KV pages: {reply.why}")
                    elif decision.reason is not m.Code.SATURATED:
                        return self._reject(req, _naming_avoided(decision, avoid))
                if loop.time() >= deadline:
                    if waited:
                        self.rt.tracing.record("admission.queue", self.rt.tracing.active(),
                                               arrived, time.monotonic())
                    return self._reject(req, decision)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(),
                                           min(0.25, max(deadline - loop.time(), 0.01)))
                waited = True
                if self._beats != beats:
                    beats = self._beats
                    tried.clear()  # fresh heartbeats: every decode may be asked again
        finally:
            self.line.leave(waiter, served)
            self._wake.set()  # the next in line may go

    def _over_share(self, req: m.SubmitRequest) -> Rejected | None:
        """The rejection of a request whose tenant would hold more than its `kv_share` of
        the live decode KV with it (None: within its share). A tenant holding nothing may
        always have one request, so a share never shrinks the context it can use."""
        if req.kv_share >= 1.0:
            return None
        held = self.registry.tenant_tokens(req.tenant)
        need = _need_tokens(req)
        cap = int(req.kv_share * self.registry.decode_capacity_tokens())
        if held == 0 or held + need <= cap:  # guard: kv-share
            return None
        return Rejected(m.Code.TENANT_LIMIT,
                        f"tenant {req.tenant!r} is at its kv_share limit ({req.kv_share:g} of "
                        f"the decode KV: {cap} tokens): it holds {held} and this request "
                        f"needs {need} more", limit=cap)

    def _eligible(self, waiter: Waiter) -> bool:
        return self._over_share(waiter.item) is None

    def _reject(self, req: m.SubmitRequest, rej: Rejected) -> m.Rejected:
        if self.trace is not None:
            self.trace.emit("decide", req=req.request_id, verdict="reject",
                            reason=rej.reason.label, detail=rej.message)
        self.decisions.labels("rejected").inc()
        self.rejections.labels(rej.reason.label).inc()
        log.info("rejected %s (%s): %s", req.request_id, rej.reason.name, rej.message)
        retry_after = rej.retry_after_s or (
            RETRY_AFTER_S if rej.reason in (m.Code.SATURATED, m.Code.TENANT_LIMIT) else 0.0)
        return m.Rejected(request_id=req.request_id,
                          outcome=m.Outcome(code=rej.reason, detail=rej.message),
                          prompt_len=len(req.prompt_ids), max_tokens=req.max_tokens,
                          limit=rej.limit, retry_after_s=retry_after)

    def _place_choices(self, req: m.SubmitRequest, first: Admitted,
                       prefills: list[WorkerView], decodes: list[WorkerView],
                       headers: Mapping[str, str]) -> list[Admitted] | Rejected:
        """A worker pair for every choice of the submit (choice 0's is `first`), each
        decided on the views less the choices placed before it, or the rejection of the
        first choice that does not fit: all are placed before any is reserved."""
        placed = [first]
        for choice in req.choices:
            prefills = [_charged(v, len(req.prompt_ids)) if v is placed[-1].prefill else v
                        for v in prefills]
            decodes = [_charged(v, len(req.prompt_ids) + req.max_tokens)
                       if v is placed[-1].decode else v for v in decodes]
            decision = self.policy.decide(
                msgspec.structs.replace(req, request_id=choice.request_id), prefills,
                decodes, headers)
            if isinstance(decision, Rejected):
                if decision.reason is m.Code.SATURATED:
                    return Rejected(m.Code.SATURATED, f"the {1 + len(req.choices)} choices "
                                    f"do not fit the decode KV together now: {decision.message}")
                return decision
            placed.append(decision)
        return placed

    async def _admit(self, req: m.SubmitRequest, placed: list[Admitted],
                     headers: Mapping[str, str], attempt: int = 0,
                     arrived: float | None = None) -> m.Admitted | Rejected | Retry:
        """Reserve decode KV for every choice of the submit where `placed` says, then
        dispatch them all. Returns the admitted reply, a final rejection (a decode's own
        capacity gate refused), or `Retry` (a choice could not be reserved now). Whatever
        was reserved for a submit that is not admitted whole is let go before this returns:
        its choices get all or nothing."""
        held: list[_Held] = []
        for choice, decision in zip(_choices(req), placed, strict=True):
            got = await self._reserve(req, choice, decision, headers, attempt)
            if not isinstance(got, _Held):
                await self._cancel(held, "another choice of the submit was not reserved")
                return got
            held.append(got)
        queued_s = None
        for k, h in enumerate(held):
            refused = await self._dispatch(req, h, headers)
            if refused is not None:
                # The choices dispatched before it end when the gateway aborts the request.
                await self._cancel(held[k + 1:], refused.message)
                return refused
            if k == 0 and arrived is not None:
                queued_s = time.monotonic() - arrived
        self.decisions.labels("admitted").inc()
        first, rest = held[0], held[1:]
        return m.Admitted(request_id=req.request_id,
                          decode_worker=first.decision.decode.worker_id,
                          prefill_worker=first.decision.prefill.worker_id,
                          choices=[m.Placement(request_id=h.choice.request_id,
                                               decode_worker=h.decision.decode.worker_id,
                                               prefill_worker=h.decision.prefill.worker_id)
                                   for h in rest], queued_s=queued_s)

    async def _reserve(self, req: m.SubmitRequest, choice: m.SubmitChoice,
                       decision: Admitted, headers: Mapping[str, str],
                       attempt: int) -> _Held | Rejected | Retry:
        """Sign one choice's ticket and reserve its KV on the decision's decode worker."""
        span = self.rt.tracing.span(
            "admission.reserve", kind="client",
            **{"pdmesh.request_id": choice.request_id, "pdmesh.attempt": attempt,
               "pdmesh.decode_worker": decision.decode.worker_id})
        got = await self._reserve_on(req, choice, decision, headers, attempt, span)
        if span is not None:
            end(span, error="" if isinstance(got, _Held) else
                got.message if isinstance(got, Rejected) else got.why)
        return got

    async def _reserve_on(self, req: m.SubmitRequest, choice: m.SubmitChoice,
                          decision: Admitted, headers: Mapping[str, str], attempt: int,
                          span: Any) -> _Held | Rejected | Retry:
        prefill: WorkerView = decision.prefill
        decode: WorkerView = decision.decode
        ticket = self.signer.sign(
            request_id=choice.request_id, tenant=req.tenant,
            cache_salt=req.cache_salt, prompt_len=len(req.prompt_ids),
            max_tokens=req.max_tokens, prefill_worker=prefill.worker_id,
            decode_worker=decode.worker_id, ttl_s=self.cfg.ticket_ttl_s)
        self.tickets_issued.inc()
        # This reservation's data-plane key: made here, known only to the two workers.
        data_key = streamauth.new_key()
        try:
            res = await self.rt.request(m.reserve_subject(decode.worker_id),
                                        m.ReserveRequest(ticket=ticket, sampling=choice.sampling,
                                                         stream_key=choice.stream_key,
                                                         data_key=data_key),
                                        m.ReserveReply, self.cfg.reserve_timeout_s,
                                        headers=self._traced(span, self.policy.reserve_headers(
                                            choice.request_id, headers, attempt)))
        except (TimeoutError, m.MessageError) as exc:
            self.reservations.labels("error").inc()
            log.warning("reserve on %s for %s failed: %s", decode.worker_id,
                        choice.request_id, exc)
            # The decode worker may have reserved after our deadline: tell that worker, and
            # only it, to let go of this ticket's reservation. (A broadcast Abort of the
            # request would also end it where the retry below places it, and the late
            # worker's failure event would end the client's request.)
            await self.rt.publish(m.reserve_subject(decode.worker_id), m.ReserveCancel(
                request_id=choice.request_id, nonce=ticket.nonce,  # guard: reserve-cancel
                outcome=m.Outcome(code=m.Code.RESERVE_FAILED, detail=str(exc))))
            if self.trace is not None:  # no reply: the reservation id is not known here
                self.trace.emit("cancel", req=choice.request_id, lease="",
                                worker=decode.worker_id)
            return Retry(str(exc), decode.worker_id)
        if isinstance(res, m.ReserveRefused):
            self.reservations.labels("refused").inc()
            detail = res.outcome.detail
            log.info("decode %s refused %s: %s", decode.worker_id, choice.request_id, detail)
            if res.outcome.code is m.Code.REFUSED:
                return Rejected(m.Code.EXCEEDS_DECODE_POOL,
                                f"decode worker {decode.worker_id} refuses: {detail}")
            return Retry(detail or "refused", decode.worker_id)
        self.reservations.labels("ok").inc()
        if self.trace is not None:
            self.trace.emit("reserve", req=choice.request_id,
                            lease=res.reservation.reservation_id, worker=decode.worker_id,
                            epoch=res.reservation.epoch)
        self.registry.charge(m.Role.DECODE, decode.worker_id,
                             len(req.prompt_ids) + req.max_tokens, tenant=req.tenant)
        self.registry.charge(m.Role.PREFILL, prefill.worker_id, len(req.prompt_ids))
        return _Held(choice, decision, ticket, data_key, res.reservation)

    def _traced(self, span: Any, headers: dict[str, str] | None) -> dict[str, str] | None:
        """`headers` plus `span`'s trace context (the worker's spans hang below it)."""
        return headers if span is None else self.rt.tracing.headers(span, into=headers)

    async def _cancel(self, held: list[_Held], why: str) -> None:
        """Let go of reservations that will not be dispatched, on the reserve subject of
        each one's decode (admission may publish there; a Release is prefill's)."""
        for h in held:
            await self.rt.publish(m.reserve_subject(h.decision.decode.worker_id),
                                  m.ReserveCancel(  # guard: group-cancel
                request_id=h.choice.request_id, nonce=h.ticket.nonce,
                outcome=m.Outcome(code=m.Code.RESERVE_FAILED, detail=why)))
            if self.trace is not None:
                self.trace.emit("cancel", req=h.choice.request_id,
                                lease=h.reservation.reservation_id,
                                worker=h.decision.decode.worker_id)

    async def _dispatch(self, req: m.SubmitRequest, h: _Held,
                        headers: Mapping[str, str]) -> Rejected | None:
        """Dispatch one reserved choice to its prefill (None), or the rejection of a
        dispatch NATS refuses (its reservation already let go)."""
        span = self.rt.tracing.span(
            "admission.dispatch", kind="producer",
            **{"pdmesh.request_id": h.choice.request_id,
               "pdmesh.prefill_worker": h.decision.prefill.worker_id})
        try:
            await self.rt.publish(m.dispatch_subject(h.decision.prefill.worker_id),
                                  m.PrefillDispatch(
                ticket=h.ticket, prompt_ids=req.prompt_ids, sampling=h.choice.sampling,
                reservation=h.reservation,
                grant=self.signer.grant(h.ticket, req.prompt_ids, h.reservation),
                stream_key=h.choice.stream_key, data_key=h.data_key),
                headers=self._traced(span, self.policy.dispatch_headers(headers)))
        except nats.errors.MaxPayloadError as exc:
            end(span, error=str(exc))
            # A NATS configured below the mesh's max_payload (services/ops/natsauth.py): the
            # submit fitted, its dispatch does not. Decode lets go now, quietly: the client
            # learns why from admission.
            await self.rt.publish(m.reserve_subject(h.decision.decode.worker_id),
                                  m.ReserveCancel(
                request_id=h.choice.request_id, nonce=h.ticket.nonce,  # guard: payload-cancel
                outcome=m.Outcome(code=m.Code.INVALID, detail=str(exc))))
            if self.trace is not None:
                self.trace.emit("cancel", req=h.choice.request_id,
                                lease=h.reservation.reservation_id,
                                worker=h.decision.decode.worker_id)
            return Rejected(m.Code.INVALID, "the prompt's dispatch exceeds this mesh's NATS "
                            f"max_payload ({self.rt.nc.max_payload} bytes): {exc}")
        self.dispatches.inc()
        end(span)
        if self.trace is not None:
            self.trace.emit("dispatch", req=h.choice.request_id,
                            lease=h.reservation.reservation_id,
                            worker=h.decision.prefill.worker_id)
        return None


RETRY_AFTER_S = 1.0  # the Retry-After of a saturated mesh or a tenant at its KV share
SUBMIT_QUEUE_LEAVE_S = 2.0  # a drain's bound on leaving the submit queue group
CUT_GRACE_S = 1.0  # at the drain timeout, beyond a reserve timeout, for answers to go out
MAX_CHOICES = 128  # choices one submit may carry (the gateway's --max-n is far below)


@dataclasses.dataclass(frozen=True)
class _Held:
    """One choice's reservation, not dispatched yet."""

    choice: m.SubmitChoice
    decision: Admitted
    ticket: m.AdmittedTicket
    data_key: str
    reservation: m.Reservation


def _naming_avoided(rej: Rejected, avoid: frozenset[str]) -> Rejected:
    """A NO_WORKERS rejection of a submit that avoids workers says so."""
    if rej.reason is not m.Code.NO_WORKERS or not avoid:
        return rej
    shown = ", ".join(sorted(avoid)[:4]) + (", ..." if len(avoid) > 4 else "")
    return dataclasses.replace(rej, message=f"{rej.message} (this request avoids {shown})")


def _charged(view: WorkerView, num_tokens: int) -> WorkerView:
    """`view` less one more request of `num_tokens` (page-rounded)."""
    taken = pages_for(num_tokens, view.page_tokens) * view.page_tokens
    return dataclasses.replace(view, available_tokens=max(view.available_tokens - taken, 0),
                               queue_depth=view.queue_depth + 1)


def _choices(req: m.SubmitRequest) -> list[m.SubmitChoice]:
    """Every choice of the submit, choice 0 (the submit's own request id) first."""
    return [m.SubmitChoice(request_id=req.request_id, stream_key=req.stream_key,
                           sampling=req.sampling), *req.choices]


def _need_tokens(req: m.SubmitRequest) -> int:
    """The decode KV the submit asks for: prompt + max_tokens for each of its choices."""
    return (len(req.prompt_ids) + req.max_tokens) * (1 + len(req.choices))


def submit_problem(req: m.SubmitRequest) -> str:
    """What is wrong with a submit's own fields ("" when nothing): a gateway's bug, or a
    peer that is not one, answered as an invalid request."""
    if not (0.0 < req.weight < math.inf):
        return f"tenant weight {req.weight!r} is not a positive number"
    if not (0.0 < req.kv_share <= 1.0):
        return f"tenant kv_share {req.kv_share!r} is not in (0, 1]"
    if len(req.choices) >= MAX_CHOICES:
        return f"{1 + len(req.choices)} choices; at most {MAX_CHOICES}"
    ids = [c.request_id for c in _choices(req)]
    if len(set(ids)) != len(ids) or not all(ids):
        return "the choices' request ids are empty or repeated"
    for c in _choices(req):
        try:
            streamauth.parse_key(c.stream_key)
        except ValueError as exc:
            return f"choice {c.request_id} has no valid stream key: {exc}"
    return ""


async def serve(cfg: AdmissionConfig) -> None:
    svc = AdmissionService(cfg, faults.admission_policy(cfg))
    await run_service(svc.rt, svc.start)
