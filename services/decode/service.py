"""Decode service: reserve a lease, accept only a verified transfer, then generate.

Per request: RESERVED (lease held, expectation registered with the transport) ->
TRANSFERRED (commit verified: coverage + length + checksums) -> DECODING -> FINISHED, or
ABORTED / FAILED from any live state. Decode never attends over a page this request did not
write in this lease: the transport only writes into registered live leases, pages are marked
written only on a verified commit, and the engine's read check refuses anything else (I2).

Every exit goes through `DecodeRequest.finish(outcome)`, which hands back the lease to free
now, or nothing while the engine thread is using the lease (`pinned`: a decode step, or the
colocated prefill): then `unpin()` hands it back after that step. `_conclude` frees it (a
lease whose transfer may still be in flight is fenced first) and only then tells the client.

Batching is `DecodeScheduler`'s (round-robin, up to `max_batch`); where the prompt's KV comes
from is a `KVIntake`: the data plane here (`TransportIntake`), the same process's prefill on a
colocated worker (services/colocated/service.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from pdmesh.kvstore import Lease, PoolExhaustedError
from pdmesh.kvstore.spec import pages_for
from pdmesh.services import faults
from pdmesh.services.decode.scheduler import DecodeScheduler
from pdmesh.services.engine.runner import DecodeSlot
from pdmesh.services.engine.sampling import Sampler
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.protocol.capacity import decode_refusal
from pdmesh.services.protocol.errors import TicketError
from pdmesh.services.protocol.lifecycle import Lifecycle, RequestState
from pdmesh.services.runtime import ptrace, tracing
from pdmesh.services.runtime.config import DecodeConfig
from pdmesh.services.runtime.service import ServiceState, counter_total, settle
from pdmesh.services.runtime.worker import WorkerBase, run_worker
from pdmesh.transports import (
    ExpectedTransfer,
    KVTransport,
    Reason,
    TransferError,
    TransferResult,
)
from pdmesh.transports.framing import transfer_key

log = logging.getLogger("pdmesh.decode")
HANDOFF_STEP_WAIT_S = 10.0  # at a drain's hand-off: the longest a decode step is waited for


@dataclass(eq=False)
class DecodeRequest:
    ticket: m.AdmittedTicket
    lease: Lease
    reservation_id: str
    sampler: Sampler
    lifecycle: Lifecycle = field(init=False)
    generated: list[int] = field(default_factory=list)
    seq: int = 0
    pinned: bool = False  # the engine thread is reading or writing this lease right now
    transfer_task: asyncio.Task[None] | None = None
    reserved_at: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)  # prefill's latest word
    quiet: bool = False  # ends without an event on the token stream (admission answers)
    # The request's keys from its ReserveRequest (streamauth.py; framing.transfer_key).
    stream_key: bytes | None = None
    data_key: bytes = b""
    progress_done: int = 0  # the prompt tokens prefill last reported computed
    span: Any = None  # decode.request, reservation to the last event (tracing.py; None: off)
    gen_span: Any = None  # decode.generate, first token to last
    # The last step's token, recorded but not yet published, and the lease to free with it
    # when it is the last (`_decode_loop` publishes it while the next step runs).
    untold: tuple[m.TokenEvent, Lease | None] | None = None

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.ticket.request_id, RequestState.RESERVED)

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def state(self) -> RequestState:
        return self.lifecycle.state

    @property
    def position(self) -> int:
        """Position of the last generated token (the next one to feed the model)."""
        return self.ticket.prompt_len + len(self.generated) - 1

    @property
    def prompt_page_ids(self) -> tuple[int, ...]:
        return self.lease.page_ids[:pages_for(self.ticket.prompt_len, self.lease.page_tokens)]

    def finish(self, outcome: m.Outcome) -> Lease | None:
        """End the request; the lease the caller must free now (None: already ended, or
        pinned by the engine until `unpin()`)."""
        if not self.lifecycle.finish(outcome):
            return None
        return None if self.pinned else self.lease

    def unpin(self) -> Lease | None:
        """The engine is done with the lease; the lease to free now if the request ended
        meanwhile."""
        self.pinned = False
        return self.lease if self.lifecycle.is_terminal else None


def peer_ending(outcome: m.Outcome, prefix: str) -> m.Outcome:
    """A peer's Release/Abort ends a request as ABORTED or FAILED, whatever code it names
    (a finish or a rejection code from a peer is taken as PEER_RELEASED)."""
    code = outcome.code
    if code.kind not in (m.Kind.ABORTED, m.Kind.FAILED):
        code = m.Code.PEER_RELEASED
    return m.Outcome(code=code, detail=f"{prefix}{outcome.detail or code.label}")


class KVIntake(Protocol):
    """Where a reserved request's prompt KV comes from."""

    async def attach(self, svc: DecodeService) -> None:
        """Subscribe/spawn what this intake needs (called once at start)."""

    def expect(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        """Start waiting for `dreq`'s prompt KV; end it on failure or deadline."""


class TransportIntake:
    """Disaggregated decode: the prompt's KV arrives over the data plane, verified."""

    async def attach(self, svc: DecodeService) -> None:
        return None

    def expect(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        spec = svc.pool.spec
        page_ids = dreq.prompt_page_ids
        target = ExpectedTransfer(
            reservation_id=dreq.reservation_id, epoch=dreq.lease.epoch, page_ids=page_ids,
            page_buffers=[svc.pool.page_buffer(dreq.lease, i) for i in range(len(page_ids))],
            page_bytes=spec.bytes_per_page, page_tokens=spec.page_tokens,
            num_tokens=dreq.ticket.prompt_len, deadline_s=svc.cfg.transfer_deadline_s,
            key=transfer_key(dreq.data_key, dreq.reservation_id, dreq.lease.epoch))
        fut = svc.transport.expect(target)
        dreq.transfer_task = svc.rt.spawn(svc.await_transfer(dreq, fut),
                                          f"transfer:{dreq.request_id}")


class DecodeService(WorkerBase):
    role = m.Role.DECODE

    def __init__(self, cfg: DecodeConfig, transport: KVTransport | None = None,
                 intake: KVIntake | None = None,
                 advertised_roles: tuple[m.Role, ...] = (),
                 reply_delay: Callable[[Mapping[str, str] | None], float] | None = None
                 ) -> None:
        super().__init__(cfg, transport)
        self.trace = self.rt.trace  # the protocol trace (None: off)
        if self.trace is not None:
            ptrace.attach(self.trace, self.pool, self.transport)
        self.advertised_roles = advertised_roles
        # Seconds to wait before answering a reserve request (test meshes only:
        # services/faults.py `reserve_reply_delay`; production: None).
        self.reply_delay = reply_delay
        self.intake: KVIntake = intake or TransportIntake()
        self.requests: dict[str, DecodeRequest] = {}
        self.scheduler: DecodeScheduler[DecodeRequest] = DecodeScheduler(cfg.max_batch)
        self.prefill_seen: dict[str, float] = {}  # prefill worker -> last heartbeat
        self._work = asyncio.Event()
        r = self.rt.registry
        self.reservations = Counter("pdmesh:reservations_total", "Decode reservations",
                                    ["outcome"], registry=r)
        self.transfers = Counter("pdmesh:transfers_total", "KV transfers received",
                                 ["outcome"], registry=r)
        self.releases = Counter("pdmesh:releases_total", "Leases freed by cause", ["cause"],
                                registry=r)
        self.tokens_out = Counter("pdmesh:generated_tokens_total", "Tokens generated",
                                  registry=r)
        self.structured_loops = Counter(
            "pdmesh:structured_loops_total", "Constrained requests ended here whose loop "
            "guard fired (services/engine/grammar.py)", registry=r)
        # What an autoscaler scales decode on (compose/helm: KEDA), beside
        # pdmesh:kv_cache_usage_perc: requests generating here, and those reserved here
        # whose prompt's KV has not arrived yet.
        for state, doc in (("running", "Requests generating here"),
                           ("waiting", "Requests reserved here whose prompt's KV has not "
                            "arrived yet")):
            Gauge(f"pdmesh:decode_requests_{state}", doc, ["model_name", "worker"],
                  registry=r).labels(self.model_name, cfg.worker_id).set_function(
                      lambda running=(state == "running"): self._count_requests(running))

    async def subscribe(self) -> None:
        wid = self.cfg.worker_id
        await self.rt.subscribe(m.reserve_subject(wid), m.ToReserve, self._on_reserve)
        await self.rt.subscribe(m.release_subject(wid), m.ToDecode, self._on_release)
        await self.rt.subscribe(m.ABORT_SUBJECT, m.Abort, self._on_abort)
        await self.rt.subscribe_heartbeats(m.heartbeat_subject("prefill", "*"),
                                           self._on_prefill_heartbeat)
        await self.intake.attach(self)
        self.rt.spawn(self._decode_loop(), "decode-loop")
        self.rt.every(self.cfg.heartbeat_s, self._watch_prefills, "watch-prefills")

    async def _on_prefill_heartbeat(self, beat: m.Heartbeat, _msg: Msg) -> None:
        self.prefill_seen[beat.worker_id] = time.monotonic()

    async def _watch_prefills(self) -> None:
        """Fail reservations whose prefill worker stopped heartbeating (killed, frozen,
        partitioned: within the worker TTL) or stopped reporting progress for the request
        (`prefill_stall_s`): liveness by progress, not a fixed deadline, so a long prompt
        that keeps computing is never cut, and a stuck one never holds its pages (I6)."""
        now = time.monotonic()
        # Forget prefills not heard of within the TTL: the map stays bounded by the live
        # prefills (a forgotten one counts from the reservation, which decides the same).
        for worker_id in [w for w, t in self.prefill_seen.items()
                          if now - t > self.cfg.worker_ttl_s]:
            del self.prefill_seen[worker_id]
        for dreq in list(self.requests.values()):
            if dreq.state is not RequestState.RESERVED:
                continue
            seen = self.prefill_seen.get(dreq.ticket.prefill_worker, dreq.reserved_at)
            if now - max(seen, dreq.reserved_at) > self.cfg.worker_ttl_s:
                await self.end(dreq, m.Outcome(
                    code=m.Code.WORKER_LOST, worker=dreq.ticket.prefill_worker,
                    detail=f"prefill worker {dreq.ticket.prefill_worker} stopped heartbeating"))
            elif now - dreq.progress_at > self.cfg.prefill_stall_s:  # guard: progress-liveness
                await self.end(dreq, m.Outcome(
                    code=m.Code.DEADLINE,
                    detail=f"prefill worker {dreq.ticket.prefill_worker} reported no progress "
                    f"for {self.cfg.prefill_stall_s:g}s"))

    def _count_requests(self, running: bool) -> int:
        return sum((r.state is RequestState.DECODING) == running
                   for r in self.requests.values())

    def active_requests(self) -> int:
        return len(self.requests)

    def tenant_tokens(self) -> dict[str, int]:
        held: dict[str, int] = {}
        for dreq in self.requests.values():
            tenant = dreq.ticket.tenant
            held[tenant] = held.get(tenant, 0) + len(dreq.lease.page_ids) * dreq.lease.page_tokens
        return held

    def counters(self) -> dict[str, float]:
        return {"reservations": counter_total(self.reservations),
                "transfers": counter_total(self.transfers),
                "releases": counter_total(self.releases),
                "generated_tokens": counter_total(self.tokens_out)}

    # -- reserve ------------------------------------------------------------------------
    async def _on_reserve(self, req: m.ToReserve, msg: Msg) -> None:
        if isinstance(req, m.ReserveCancel):
            await self._on_cancel(req)
            return
        reply = self.reserve(req)
        if self.reply_delay is not None:  # test meshes only (services/faults.py)
            await asyncio.sleep(self.reply_delay(msg.headers))
        await self.rt.respond(msg, reply)
        if self.rt.tracing.enabled and isinstance(reply, m.Reserved):
            self._trace_reserved(reply, msg.headers or {})
        if self.trace is not None and isinstance(reply, m.Reserved):
            r = reply.reservation
            self.trace.emit("reserve_in", req=reply.request_id, lease=r.reservation_id,
                            epoch=r.epoch)

    def _trace_reserved(self, reply: m.Reserved, headers: Mapping[str, str]) -> None:
        """The request's span here, continuing admission's reserve span."""
        dreq = self.requests.get(reply.request_id)
        if dreq is not None and dreq.span is None:
            t = dreq.ticket
            dreq.span = self.rt.tracing.span(
                "decode.request", headers, kind="server", start=dreq.reserved_at,
                **{"pdmesh.request_id": t.request_id, "pdmesh.prefill_worker": t.prefill_worker,
                   "gen_ai.usage.input_tokens": t.prompt_len,
                   "gen_ai.request.max_tokens": t.max_tokens,
                   "pdmesh.kv.pages": len(reply.reservation.page_ids)})

    async def _on_cancel(self, c: m.ReserveCancel) -> None:
        """Admission gave up on a reservation it asked for (no reply in time, or a dispatch
        it could not send): free it. The
        request is admission's to answer (it was sent elsewhere, or rejected): no event on
        its token stream, where a failure would end the request the other worker serves."""
        dreq = self.requests.get(c.request_id)
        if dreq is None or dreq.ticket.nonce != c.nonce or dreq.state is not RequestState.RESERVED:
            return
        dreq.quiet = True  # guard: reserve-cancel-quiet
        await self.end(dreq, c.outcome)

    def _refuse(self, t: m.AdmittedTicket, label: str, code: m.Code,
                detail: str) -> m.ReserveRefused:
        self.reservations.labels(label).inc()
        return m.ReserveRefused(request_id=t.request_id,
                                outcome=m.Outcome(code=code, detail=detail))

    def reserve(self, req: m.ReserveRequest) -> m.ReserveReply:
        t = req.ticket
        self.seen_requests.append(t.request_id)
        if self.rt.state >= ServiceState.DRAINING:
            # Sent before admission heard the draining heartbeat: it reserves elsewhere.
            return self._refuse(t, "draining", m.Code.SATURATED,
                                f"decode worker {self.cfg.worker_id} is draining")
        try:
            self.verifier.verify(t)
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            return self._refuse(t, "ticket_refused", m.Code.TICKET_INVALID, str(exc))
        refusal = decode_refusal(t.prompt_len, t.max_tokens, self.pool.capacity_tokens,
                                 self.pool.spec.page_tokens, self.served_context)
        if refusal:
            # Defence in depth: admission applies the same rules and should never send this.
            return self._refuse(t, "refused", m.Code.REFUSED, refusal)
        if t.request_id in self.requests:
            return self._refuse(t, "refused", m.Code.RESERVE_FAILED, "duplicate request id")
        try:
            stream_key = streamauth.parse_key(req.stream_key)
            data_key = streamauth.parse_key(req.data_key)
        except ValueError as exc:
            # Admission's to make: not the static capacity gate (REFUSED is final there).
            return self._refuse(t, "bad_keys", m.Code.TICKET_INVALID, f"bad request keys: {exc}")
        try:
            sampler = Sampler.for_request(req.sampling, t.max_tokens,
                                          self.model.tokenizer.eos_token_ids, self.grammars)
        except ValueError as exc:  # the gateway validates; a bad Sampling still harms none
            return self._refuse(t, "refused", m.Code.REFUSED, f"bad sampling: {exc}")
        try:
            lease = self.pool.allocate(t.request_id, t.prompt_len + t.max_tokens)
        except PoolExhaustedError as exc:
            return self._refuse(t, "pool_full", m.Code.RESERVE_FAILED, str(exc))
        dreq = DecodeRequest(ticket=t, lease=lease, reservation_id=lease.lease_id,
                             sampler=sampler, stream_key=stream_key, data_key=data_key)
        self.requests[t.request_id] = dreq
        self.intake.expect(self, dreq)
        self.reservations.labels("ok").inc()
        spec = self.pool.spec
        return m.Reserved(request_id=t.request_id, reservation=m.Reservation(
            reservation_id=dreq.reservation_id, epoch=lease.epoch,
            page_ids=list(dreq.prompt_page_ids), page_tokens=spec.page_tokens,
            page_bytes=spec.bytes_per_page, data_address=self.data_address))

    async def await_transfer(self, dreq: DecodeRequest,
                             fut: asyncio.Future[TransferResult]) -> None:
        try:
            result = await fut
            committed_at = time.monotonic()
        except TransferError as exc:
            self.transfers.labels(exc.reason.name.lower()).inc()
            if exc.reason is not Reason.ABORTED:
                log.warning("KV transfer for %s failed: %s", dreq.request_id, exc)
            if exc.reason is Reason.PEER_LOST:  # prefill died or was cut off: resumable
                await self.end(dreq, m.Outcome(
                    code=m.Code.WORKER_LOST, worker=dreq.ticket.prefill_worker,
                    detail=f"prefill worker {dreq.ticket.prefill_worker} lost mid-transfer: "
                    f"{exc}"))
                return
            await self.end(dreq, m.Outcome(code=m.Code.TRANSFER_FAILED,
                                           detail=f"KV transfer failed: {exc}"))
            return
        if dreq.lifecycle.is_terminal:
            return
        # The commit was verified by the transport against this live lease; only now do
        # the pages count as written, so the engine's read check lets decode use them.
        if result.num_tokens != dreq.ticket.prompt_len or result.epoch != dreq.lease.epoch:
            self.transfers.labels("mismatch").inc()
            await self.end(dreq, m.Outcome(
                code=m.Code.TRANSFER_FAILED, detail=f"commit of {result.num_tokens} tokens, "
                f"expected {dreq.ticket.prompt_len}"))
            return
        vocab = self.model.tokenizer.vocab_size
        if not 0 <= result.first_token < vocab:  # guard: first-token-range
            # Checked here, before it can reach a batch: a bad id would fail the whole
            # decode step (other tenants' requests included) or wrap around silently.
            self.transfers.labels("bad_first_token").inc()
            await self.end(dreq, m.Outcome(
                code=m.Code.TRANSFER_FAILED,
                detail=f"first token id {result.first_token} outside 0..{vocab - 1}"))
            return
        constraint = dreq.sampler.constraint
        allowed = constraint.allowed() if constraint is not None else None
        if allowed is not None and not (  # guard: first-token-grammar
                result.first_token < len(allowed) and allowed[result.first_token]):
            # A structured output's first token (prefill's) outside the request's grammar:
            # the reply would not satisfy it, and the grammar state could not follow.
            self.transfers.labels("bad_first_token").inc()
            await self.end(dreq, m.Outcome(
                code=m.Code.TRANSFER_FAILED, detail=f"first token id {result.first_token} "
                "is outside the request's structured output"))
            return
        page = self.pool.spec.page_tokens
        remaining = result.num_tokens
        for i in range(len(result.pages_written)):
            self.pool.mark_written(dreq.lease, i, min(page, remaining))
            remaining -= page
        self.transfers.labels("ok").inc()
        self.kv_bytes.labels("in").inc(result.bytes)
        self.rt.tracing.record("decode.kv_wait", dreq.span, dreq.reserved_at, committed_at,
                               **{"pdmesh.kv.bytes": result.bytes,
                                  "pdmesh.kv.transport": self.cfg.transport})
        await self.start_decoding(dreq, result.first_token, committed_at)

    async def start_decoding(self, dreq: DecodeRequest, first_token: int,
                             since: float | None = None) -> None:
        """The prompt's KV is in this lease and verified (at `since`): publish the first
        token, decode."""
        dreq.lifecycle.advance(RequestState.TRANSFERRED)
        if dreq.span is not None:
            dreq.gen_span = self.rt.tracing.span("decode.generate", dreq.span)
            tracing.event(dreq.gen_span, "first_token")  # (a 1-token reply ends in _emit)
        await self._emit(dreq, first_token, since)
        if not dreq.lifecycle.is_terminal:
            dreq.lifecycle.advance(RequestState.DECODING)
            self.scheduler.add(dreq)
            self._work.set()

    # -- generation ---------------------------------------------------------------------
    async def _emit(self, dreq: DecodeRequest, token: int,
                    committed_at: float | None = None) -> None:
        """Record and publish one token; finish the request when it is the last. The first
        carries decode's own share of the time to first token (from `committed_at`)."""
        event, lease = self._record(dreq, token, committed_at)
        await self._tell_token(dreq, event, lease)

    def _record(self, dreq: DecodeRequest, token: int, committed_at: float | None = None
                ) -> tuple[m.TokenEvent, Lease | None]:
        """Record one token: its event, and the lease to free when it ends the request."""
        dreq.generated.append(token)
        self.tokens_out.inc()
        finish: m.Outcome | None = None
        if dreq.sampler.accept(token):  # eos (unless ignore_eos) or a stop_token_id
            finish = m.FINISHED_STOP
        elif len(dreq.generated) >= dreq.ticket.max_tokens:
            finish = m.FINISHED_LENGTH
        event = m.TokenEvent(request_id=dreq.request_id, seq=dreq.seq, token_ids=[token],
                             finish=finish, prompt_tokens=dreq.ticket.prompt_len,
                             logprobs=dreq.sampler.take_logprobs(token),
                             decode_first_token_s=None if committed_at is None
                             else time.monotonic() - committed_at)
        dreq.seq += 1
        return event, dreq.finish(finish) if finish is not None else None

    async def _tell_token(self, dreq: DecodeRequest, event: m.TokenEvent,
                          lease: Lease | None) -> None:
        if lease is not None:
            await self.conclude(dreq, lease, event)
        else:
            await self.tell(dreq, event)

    async def _tell_untold(self, batch: list[DecodeRequest]) -> None:
        """Publish the tokens of the last step that are not out yet (in batch order)."""
        for r in batch:
            if r.untold is not None:
                (event, lease), r.untold = r.untold, None
                await self._tell_token(r, event, lease)

    async def _decode_loop(self) -> None:
        """One engine step after another. A step's tokens are sampled and recorded as soon
        as it ends, so the next step starts at once; their events are published while that
        next step runs (a request ended meanwhile gets its last token out before its end:
        `conclude`)."""
        told: list[DecodeRequest] = []  # the last step's requests, their tokens not yet out
        while True:
            batch = self.scheduler.next_batch()
            if not batch:
                if told:
                    await self._tell_untold(told)
                    told = []
                    continue
                self._work.clear()
                await self._work.wait()
                continue
            slots = [DecodeSlot(lease=r.lease, token_id=r.generated[-1], position=r.position)
                     for r in batch]
            for r in batch:
                r.pinned = True
            step = asyncio.ensure_future(self.compute(self.engine.decode_step, slots,
                                                      threads=self.decode_threads))
            await asyncio.sleep(0)  # the step is on the engine thread: meanwhile, ...
            if told:  # ... the last step's tokens go out, ...
                await self._tell_untold(told)
                told = []
            for r in batch:
                r.sampler.prepare()  # ... and the structured outputs' grammar masks
            try:
                logits = await step
            except Exception as exc:
                log.exception("decode step failed")
                logits = None
                for r in batch:
                    r.finish(m.Outcome(code=m.Code.INTERNAL,
                                       detail=f"decode step failed: {exc}"))
            for i, r in enumerate(batch):
                lease = r.unpin()
                if lease is not None:  # ended during the step (or by it)
                    await self.conclude(r, lease)
                elif logits is not None:
                    event, lease = self._record(r, r.sampler.sample(logits[i]))
                    if lease is not None:  # its last token: not in the next step
                        self.scheduler.discard(r)
                    r.untold = (event, lease)
                    told.append(r)

    # -- ending -------------------------------------------------------------------------
    async def _on_release(self, msg: m.ToDecode, raw: Msg) -> None:
        """A Release or PrefillProgress from the request's prefill: believed only with the
        request's stream MAC (another prefill may publish here too, NATS cannot tell them
        apart). Progress keeps the reservation only while it is real: the reported
        computed tokens grow, or none is computed yet (queued); a prefill that repeats
        itself mid-prompt lets the stall limit free the pages."""
        dreq = self.requests.get(msg.request_id)
        if dreq is None:
            return
        if not streamauth.verify(dreq.stream_key, raw.subject, raw.data, raw.headers):
            self.rt.refuse("peer_mac", f"{type(msg).__name__} for {msg.request_id} without "
                           "the request's MAC")
            return
        if dreq.reservation_id != msg.reservation_id:  # an earlier reservation's
            return
        if isinstance(msg, m.PrefillProgress):
            done, last = msg.done_tokens, dreq.progress_done
            if done > last or done == last == 0:  # guard: progress-advances
                dreq.progress_done = done
                dreq.progress_at = time.monotonic()
            else:
                self.rt.refuse("stale_progress", f"progress of {msg.request_id} at {done} "
                               f"after {dreq.progress_done}")
            return
        await self.end(dreq, peer_ending(msg.outcome, "released by peer: "))

    async def hand_off(self) -> int:
        """Drain timeout: free every lease still held (fenced as always) and tell each
        request's gateway to resume it on another decode worker from the tokens it got.
        A request inside the engine's step right now is concluded (and its gateway told)
        when the step ends: wait for that, since the closing drain then cancels the loop
        that would do it. How many could not be told (cut)."""
        outcome = self.drained_outcome()
        for dreq in list(self.requests.values()):
            await self.end(dreq, outcome)
        # The decode loop concludes them after the step.
        return await settle(lambda: len(self.requests),  # guard: handoff-waits-step
                            HANDOFF_STEP_WAIT_S)

    async def _on_abort(self, ab: m.Abort, _msg: Msg) -> None:
        dreq = self.requests.get(ab.request_id)
        if dreq is not None:
            await self.end(dreq, peer_ending(ab.outcome, ""))

    async def end(self, dreq: DecodeRequest, outcome: m.Outcome) -> None:
        """End a live request as ABORTED/FAILED: free the lease (after the engine's step if
        it is pinned), then tell the client. A second end is a no-op."""
        lease = dreq.finish(outcome)
        if lease is not None:
            await self.conclude(dreq, lease)

    async def conclude(self, dreq: DecodeRequest, lease: Lease,
                        event: m.TokenEvent | None = None) -> None:
        """Free an ended request's lease, then publish its last event (the final token, or
        the failure). Release before telling: a failed publish cannot leak the lease."""
        outcome = dreq.lifecycle.outcome
        assert outcome is not None
        self.scheduler.discard(dreq)  # guard: release-before-telling
        # Fence before the pages can be leased again: after this no late frame for this
        # reservation can land in them (the next lease of the same pages is safe).
        try:
            await self.transport.fence(dreq.reservation_id)  # guard: decode-fences
            quarantine = ""
        except TransferError as exc:  # a write may still land: never lease these pages again
            quarantine = str(exc)
        if dreq.transfer_task is not None and dreq.transfer_task is not asyncio.current_task():
            dreq.transfer_task.cancel()
        if quarantine:
            log.error("lease of %s quarantined (%d pages out of service): %s",
                      dreq.request_id, dreq.lease.num_pages, quarantine)
            self.pool.quarantine(lease, outcome.label)  # guard: quarantine
        else:
            self.pool.release(lease, outcome.label)
        self.releases.labels(outcome.label).inc()
        constraint = dreq.sampler.constraint
        if constraint is not None and constraint.loops:
            self.structured_loops.inc()
        if dreq.untold is not None and event is None:  # its last token before its end
            untold, dreq.untold = dreq.untold[0], None
            await self.tell(dreq, untold)
        self.requests.pop(dreq.request_id, None)
        if self.rt.nc.is_connected:  # admission counts the freed pages (the tenant's too)
            try:                     # before the end is heard: a conversation's next turn
                await self.heartbeat_soon()  # is not queued behind a stale heartbeat
            except (nats.errors.Error, OSError) as exc:  # the periodic heartbeat follows
                log.warning("early heartbeat not sent: %s", exc)
        if dreq.span is not None:
            self._trace_end(dreq, outcome, quarantine)
        if not dreq.quiet:  # the protocol trace's `tell` is written where it is published
            await self.tell(dreq, event or m.StreamFailed(request_id=dreq.request_id,
                                                          outcome=outcome))

    @staticmethod
    def _trace_end(dreq: DecodeRequest, outcome: m.Outcome, quarantine: str) -> None:
        failed = "" if outcome.code.kind is m.Kind.FINISHED else outcome.detail
        if dreq.gen_span is not None:
            tracing.event(dreq.gen_span, "last_token", tokens=len(dreq.generated))
            tracing.end(dreq.gen_span, error=failed, **{"gen_ai.usage.output_tokens":
                                                len(dreq.generated)})
        tracing.end(dreq.span, error=failed, **{"pdmesh.outcome": outcome.label,
                                        "gen_ai.usage.output_tokens": len(dreq.generated),
                                        "pdmesh.quarantined": quarantine or None})
        dreq.span = dreq.gen_span = None

    async def tell(self, dreq: DecodeRequest, event: m.StreamEvent) -> None:
        """Publish one event on the request's stream, MACed under its stream key."""
        if dreq.stream_key is None:
            log.error("no stream key for %s: event not sent", event.request_id)
            return
        try:
            await self.rt.publish_authenticated(m.tokens_subject(event.request_id), event,
                                                dreq.stream_key)
        except (nats.errors.Error, OSError) as exc:
            log.error("publishing to the stream of %s failed: %s", event.request_id, exc)


async def serve(cfg: DecodeConfig) -> None:
    await run_worker(DecodeService(cfg, reply_delay=faults.reserve_reply_delay(cfg)))
