"""Decode service: reserve a lease, accept only a verified transfer, then generate.

Per request: RESERVED (lease held, expectation registered with the transport) ->
TRANSFERRED (commit verified: coverage + length + checksums) -> DECODING -> FINISHED, or
ABORTED / FAILED from any live state. Decode never attends over a page this request did not
write in this lease: the transport only writes into registered live leases, pages are marked
written only on a verified commit, and the engine's read check refuses anything else (I2).

Every exit frees the lease in the same function that ends the request (`_end`). A lease
whose transfer may still be in flight is fenced first, and a lease in the middle of a decode
step is released only after that step (the engine thread may be reading it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from nats.aio.msg import Msg
from prometheus_client import Counter

from kvstore import Lease, PoolExhaustedError
from services import messages as m
from services.capacity import decode_refusal
from services.config import ServiceConfig
from services.engine.runner import DecodeSlot
from services.engine.sampling import Sampler, SamplingParams
from services.errors import TicketError
from services.lifecycle import RequestState, advance
from services.runtime import counter_total
from services.worker import WorkerBase, run_worker
from transports import ExpectedTransfer, TransferError, TransferResult

log = logging.getLogger("pdmesh.decode")


@dataclass(eq=False)
class DecodeRequest:
    ticket: m.AdmittedTicket
    lease: Lease
    reservation_id: str
    sampler: Sampler
    state: RequestState = RequestState.RESERVED
    generated: list[int] = field(default_factory=list)
    seq: int = 0
    in_step: bool = False
    end_after_step: tuple[RequestState, m.FailCode, str] | None = None
    transfer_task: asyncio.Task[None] | None = None
    reserved_at: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return self.ticket.request_id

    @property
    def position(self) -> int:
        """Position of the last generated token (the next one to feed the model)."""
        return self.ticket.prompt_len + len(self.generated) - 1


class DecodeService(WorkerBase):
    role = m.Role.DECODE

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.requests: dict[str, DecodeRequest] = {}
        self.prefill_seen: dict[str, float] = {}  # prefill worker -> last heartbeat
        self._work = asyncio.Event()
        r = self.rt.registry
        self.reservations = Counter("pdmesh_reservations_total", "Decode reservations",
                                    ["outcome"], registry=r)
        self.transfers = Counter("pdmesh_transfers_total", "KV transfers received",
                                 ["outcome"], registry=r)
        self.releases = Counter("pdmesh_releases_total", "Leases freed by cause", ["cause"],
                                registry=r)
        self.tokens_out = Counter("pdmesh_generated_tokens_total", "Tokens generated",
                                  registry=r)

    async def subscribe(self) -> None:
        wid = self.cfg.worker_id
        await self.rt.subscribe(m.reserve_subject(wid), m.ReserveRequest, self._on_reserve)
        await self.rt.subscribe(m.release_subject(wid), m.Release, self._on_release)
        await self.rt.subscribe(m.ABORT_SUBJECT, m.Abort, self._on_abort)
        await self.rt.subscribe(m.heartbeat_subject("prefill", "*"), m.Heartbeat,
                                self._on_prefill_heartbeat, concurrent=False)
        self.rt.spawn(self._decode_loop(), "decode-loop")
        self.rt.every(self.cfg.heartbeat_s, self._watch_prefills, "watch-prefills")

    async def _on_prefill_heartbeat(self, beat: m.Heartbeat, _msg: Msg) -> None:
        self.prefill_seen[beat.worker_id] = time.monotonic()

    async def _watch_prefills(self) -> None:
        """Fail reservations whose prefill worker stopped heartbeating (killed, frozen,
        partitioned) instead of holding the pages until the transfer deadline (I6)."""
        now = time.monotonic()
        for dreq in list(self.requests.values()):
            if dreq.state is not RequestState.RESERVED:
                continue
            seen = self.prefill_seen.get(dreq.ticket.prefill_worker, dreq.reserved_at)
            if now - max(seen, dreq.reserved_at) > self.cfg.worker_ttl_s:
                await self._end(dreq, RequestState.FAILED, m.FailCode.PEER_RELEASED,
                                f"prefill worker {dreq.ticket.prefill_worker} stopped "
                                "heartbeating")

    def active_requests(self) -> int:
        return len(self.requests)

    def counters(self) -> dict[str, float]:
        return {"reservations": counter_total(self.reservations),
                "transfers": counter_total(self.transfers),
                "releases": counter_total(self.releases),
                "generated_tokens": counter_total(self.tokens_out)}

    # -- reserve ------------------------------------------------------------------------
    async def _on_reserve(self, req: m.ReserveRequest, msg: Msg) -> None:
        await self.rt.respond(msg, self.reserve(req))

    def reserve(self, req: m.ReserveRequest) -> m.ReserveReply:
        t = req.ticket
        self.seen_requests.append(t.request_id)
        try:
            self.verifier.verify(t)
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            self.reservations.labels("ticket_refused").inc()
            return m.ReserveReply(ok=False, request_id=t.request_id, error=str(exc),
                                  code=m.FailCode.TICKET_INVALID)
        total = t.prompt_len + t.max_tokens
        refusal = decode_refusal(t.prompt_len, t.max_tokens, self.pool.capacity_tokens,
                                 self.pool.spec.page_size, self.served_context)
        if refusal:
            # Defence in depth: admission applies the same rules and should never send this.
            self.reservations.labels("refused").inc()
            return m.ReserveReply(ok=False, request_id=t.request_id, code=m.FailCode.REFUSED,
                                  error=refusal)
        if t.request_id in self.requests:
            self.reservations.labels("refused").inc()
            return m.ReserveReply(ok=False, request_id=t.request_id,
                                  code=m.FailCode.RESERVE_FAILED, error="duplicate request id")
        try:
            lease = self.pool.allocate(t.request_id, total)
        except PoolExhaustedError as exc:
            self.reservations.labels("pool_full").inc()
            return m.ReserveReply(ok=False, request_id=t.request_id,
                                  code=m.FailCode.RESERVE_FAILED, error=str(exc))
        reservation_id = str(uuid.UUID(lease.lease_id))
        dreq = DecodeRequest(ticket=t, lease=lease, reservation_id=reservation_id,
                             sampler=Sampler(SamplingParams(
                                 temperature=req.sampling.temperature,
                                 top_p=req.sampling.top_p, seed=req.sampling.seed,
                                 max_tokens=t.max_tokens)))
        dreq.sampler.skip(1)  # prefill samples the first token
        self.requests[t.request_id] = dreq
        prompt_pages = self._expect_kv(dreq)
        self.reservations.labels("ok").inc()
        return m.ReserveReply(ok=True, request_id=t.request_id, reservation_id=reservation_id,
                              epoch=lease.epoch, page_ids=list(prompt_pages),
                              page_tokens=self.pool.spec.page_size,
                              page_bytes=self.pool.spec.bytes_per_page,
                              data_address=self.data_address)

    def _expect_kv(self, dreq: DecodeRequest) -> tuple[int, ...]:
        """Register the lease's prompt pages with the transport; return their page ids."""
        t, lease = dreq.ticket, dreq.lease
        n_prompt_pages = -(-t.prompt_len // self.pool.spec.page_size)
        prompt_pages = lease.page_ids[:n_prompt_pages]
        target = ExpectedTransfer(
            reservation_id=dreq.reservation_id, epoch=lease.epoch, page_ids=prompt_pages,
            page_buffers=[self.pool.page_buffer(lease, i) for i in range(n_prompt_pages)],
            page_bytes=self.pool.spec.bytes_per_page, page_tokens=self.pool.spec.page_size,
            num_tokens=t.prompt_len, deadline_s=self.cfg.transfer_deadline_s)
        fut = self.transport.expect(target)
        dreq.transfer_task = self.rt.spawn(self._await_transfer(dreq, fut),
                                           f"transfer:{t.request_id}")
        return prompt_pages

    async def _await_transfer(self, dreq: DecodeRequest,
                              fut: asyncio.Future[TransferResult]) -> None:
        try:
            result = await fut
        except TransferError as exc:
            self.transfers.labels(exc.reason.name.lower()).inc()
            if not dreq.state.is_terminal:
                await self._end(dreq, RequestState.FAILED, m.FailCode.TRANSFER_FAILED,
                                f"KV transfer failed: {exc}")
            return
        if dreq.state.is_terminal:
            return
        # The commit was verified by the transport against this live lease; only now do
        # the pages count as written, so the engine's read check lets decode use them.
        if result.num_tokens != dreq.ticket.prompt_len or result.epoch != dreq.lease.epoch:
            self.transfers.labels("mismatch").inc()
            await self._end(dreq, RequestState.FAILED, m.FailCode.TRANSFER_FAILED,
                            f"commit of {result.num_tokens} tokens, expected "
                            f"{dreq.ticket.prompt_len}")
            return
        page = self.pool.spec.page_size
        remaining = result.num_tokens
        for i in range(len(result.pages_written)):
            self.pool.mark_written(dreq.lease, i, min(page, remaining))
            remaining -= page
        self.transfers.labels("ok").inc()
        self.kv_bytes.labels("in").inc(result.bytes)
        await self._start_decoding(dreq, result.first_token)

    async def _start_decoding(self, dreq: DecodeRequest, first_token: int) -> None:
        """The prompt's KV is in this lease and verified: publish the first token, decode."""
        dreq.state = advance(dreq.request_id, dreq.state, RequestState.TRANSFERRED)
        await self._emit(dreq, first_token)
        if not dreq.state.is_terminal:
            dreq.state = advance(dreq.request_id, dreq.state, RequestState.DECODING)
            self._work.set()

    # -- generation ---------------------------------------------------------------------
    async def _emit(self, dreq: DecodeRequest, token: int) -> None:
        """Record and publish one token; finish the request when it is the last."""
        dreq.generated.append(token)
        self.tokens_out.inc()
        finish: m.FinishReason | None = None
        if token in self.model.tokenizer.eos_token_ids:
            finish = m.FinishReason.STOP
        elif len(dreq.generated) >= dreq.ticket.max_tokens:
            finish = m.FinishReason.LENGTH
        await self.rt.publish(m.tokens_subject(dreq.request_id), m.TokenEvent(
            request_id=dreq.request_id, seq=dreq.seq, token_ids=[token], finish=finish,
            prompt_tokens=dreq.ticket.prompt_len))
        dreq.seq += 1
        if finish is not None:
            await self._release(dreq, RequestState.FINISHED, "finished")

    async def _decode_loop(self) -> None:
        rr = 0  # round-robin start, so more than max_batch requests all make progress
        while True:
            running = [r for r in self.requests.values() if r.state is RequestState.DECODING]
            if not running:
                self._work.clear()
                await self._work.wait()
                continue
            rr %= len(running)
            batch = (running[rr:] + running[:rr])[: self.cfg.max_batch]
            rr += len(batch)
            slots = [DecodeSlot(lease=r.lease, token_id=r.generated[-1], position=r.position)
                     for r in batch]
            for r in batch:
                r.in_step = True
            try:
                logits = await self.compute(self.engine.decode_step, slots)
            except Exception as exc:  # noqa: BLE001 - fail the batch, keep the service
                log.exception("decode step failed")
                for r in batch:
                    r.in_step = False
                    await self._end(r, RequestState.FAILED, m.FailCode.INTERNAL,
                                    f"decode step failed: {exc}")
                continue
            for i, r in enumerate(batch):
                r.in_step = False
                if r.end_after_step is not None:
                    await self._end(r, *r.end_after_step)
                elif not r.state.is_terminal:
                    await self._emit(r, r.sampler.sample(logits[i]))
            await asyncio.sleep(0)  # let transport and NATS callbacks run between steps

    # -- ending -------------------------------------------------------------------------
    async def _on_release(self, rel: m.Release, _msg: Msg) -> None:
        dreq = self.requests.get(rel.request_id)
        if dreq is not None and dreq.reservation_id == rel.reservation_id:
            await self._end(dreq, RequestState.FAILED, rel.code,
                            f"released by peer: {rel.detail}")

    async def _on_abort(self, ab: m.Abort, _msg: Msg) -> None:
        dreq = self.requests.get(ab.request_id)
        if dreq is not None:
            await self._end(dreq, RequestState.ABORTED, ab.code, ab.detail or "aborted")

    async def _end(self, dreq: DecodeRequest, state: RequestState, code: m.FailCode,
                   detail: str) -> None:
        """End a live request as ABORTED/FAILED: tell the client, fence, free the lease."""
        if dreq.state.is_terminal:
            return
        if dreq.in_step:
            dreq.end_after_step = (state, code, detail)
            return
        dreq.state = state  # terminal at once: a second abort or release is a no-op
        await self.rt.publish(m.tokens_subject(dreq.request_id), m.TokenEvent(
            request_id=dreq.request_id, seq=dreq.seq, fail_code=code, detail=detail))
        await self._release(dreq, state, m.FailCode(code).name.lower())

    async def _release(self, dreq: DecodeRequest, state: RequestState, cause: str) -> None:
        dreq.state = state
        # Fence before the pages can be leased again: after this no late frame for this
        # reservation can land in them (the next lease of the same pages is safe).
        await self.transport.fence(dreq.reservation_id)
        if dreq.transfer_task is not None and dreq.transfer_task is not asyncio.current_task():
            dreq.transfer_task.cancel()
        self.pool.release(dreq.lease, cause)
        self.releases.labels(cause).inc()
        self.requests.pop(dreq.request_id, None)


async def serve(cfg: ServiceConfig) -> None:
    await run_worker(DecodeService(cfg))
