"""Colocated worker: prefill and decode in one process over one pool, no KV transfer.

It is the single-process engine served behind the same gateway and admission
(`pdmesh up --colocated`), the baseline the load tester compares the disaggregated mesh
against. It is a decode service whose prompt KV comes from its own prefill (`LocalPrefill`,
a `KVIntake`) instead of the data plane, and it heartbeats as both a prefill and a decode
worker, so admission hands it both the reservation and the dispatch. The prompt is
prefilled straight into the reserved lease (the engine marks the pages written), then
decoding continues exactly as on a decode worker. Every other guard is the same: signed
tickets (checked for both roles), prefill's token-range recheck, lease read checks, and the
same request lifecycle and release paths.

Long prompts run one chunk at a time (`prefill_windows`, the same chunks as a prefill
worker), with a `PrefillProgress` to the gateway after each and for every queued dispatch
every `prefill_stall_s / 4`; an abort stops the prefill at the next chunk boundary.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

import torch
from nats.aio.msg import Msg

from pdmesh.services.decode.service import DecodeRequest, DecodeService
from pdmesh.services.engine.model import prefill_windows
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import TicketError
from pdmesh.services.protocol.lifecycle import RequestState
from pdmesh.services.protocol.tickets import TicketVerifier, verify_grant
from pdmesh.services.runtime.config import ColocatedConfig
from pdmesh.services.runtime.worker import run_worker

log = logging.getLogger("pdmesh.colocated")


class LocalPrefill:
    """The colocated worker's KV intake: dispatches are prefilled into the reserved lease,
    one at a time. A dispatch that does not come within `prefill_stall_s` frees the lease."""

    def __init__(self, cfg: ColocatedConfig) -> None:
        # The ticket names this worker twice; each role checks (and burns) it once.
        self.verifier = TicketVerifier(cfg.verify_key, cfg.worker_id, m.Role.PREFILL)
        self._dispatches: collections.deque[m.PrefillDispatch] = collections.deque()
        self._dispatched = asyncio.Event()
        self.svc: DecodeService | None = None
        self._running = ""  # the request being prefilled

    async def attach(self, svc: DecodeService) -> None:
        self.svc = svc
        await svc.rt.subscribe(m.dispatch_subject(svc.cfg.worker_id), m.PrefillDispatch,
                               self._on_dispatch, concurrent=False)
        svc.rt.spawn(self._prefill_loop(svc), "prefill-loop")
        svc.rt.every(svc.cfg.prefill_stall_s / 4, self._keepalive, "prefill-keepalive")

    async def _keepalive(self) -> None:
        """Queued dispatches are held and alive: the gateway keeps waiting for them."""
        svc = self.svc
        assert svc is not None
        for d in list(self._dispatches):
            dreq = svc.requests.get(d.ticket.request_id)
            if dreq is not None and dreq.state is RequestState.RESERVED:
                await self._progress(svc, d, dreq, 0)

    @staticmethod
    async def _progress(svc: DecodeService, d: m.PrefillDispatch, dreq: DecodeRequest,
                        done: int) -> None:
        """The request is held and moving: decode's own liveness check and the gateway's
        wait for the first token both go by it."""
        dreq.progress_at = time.monotonic()
        msg = m.PrefillProgress(request_id=d.ticket.request_id,
                                reservation_id=d.reservation.reservation_id,
                                done_tokens=done, total_tokens=len(d.prompt_ids))
        await svc.tell(dreq, msg)  # MACed under the stream key, as every event of the stream

    def expect(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        svc.rt.spawn(self._dispatch_deadline(svc, dreq), f"deadline:{dreq.request_id}")

    async def _dispatch_deadline(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        await asyncio.sleep(svc.cfg.prefill_stall_s)
        if dreq.state is RequestState.RESERVED and dreq.request_id != self._running and not any(
                d.ticket.request_id == dreq.request_id for d in self._dispatches):
            await svc.end(dreq, m.Outcome(
                code=m.Code.DEADLINE,
                detail=f"no dispatch within {svc.cfg.prefill_stall_s:g}s"))

    async def _on_dispatch(self, d: m.PrefillDispatch, _msg: Msg) -> None:
        svc = self.svc
        assert svc is not None
        dreq = svc.requests.get(d.ticket.request_id)
        try:
            self.verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
            verify_grant(svc.cfg.verify_key, d)
        except TicketError as exc:
            svc.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            if dreq is not None:
                await svc.end(dreq, m.Outcome(code=m.Code.TICKET_INVALID, detail=str(exc)))
            return
        if dreq is None or dreq.reservation_id != d.reservation.reservation_id:
            log.warning("dispatch for %s names no live reservation here", d.ticket.request_id)
            return
        vocab = svc.model.tokenizer.vocab_size
        if min(d.prompt_ids) < 0 or max(d.prompt_ids) >= vocab:  # guard: colocated-token-range
            # The same token-range gate as a prefill worker's (defence in depth).
            await svc.end(dreq, m.Outcome(code=m.Code.PREFILL_REJECTED,
                                          detail=f"token id out of range 0..{vocab - 1}"))
            return
        self._dispatches.append(d)
        self._dispatched.set()
        await self._progress(svc, d, dreq, 0)

    async def _prefill_loop(self, svc: DecodeService) -> None:
        while True:
            if not self._dispatches:
                self._dispatched.clear()
                await self._dispatched.wait()
                continue
            d = self._dispatches.popleft()
            dreq = svc.requests.get(d.ticket.request_id)
            if dreq is None or dreq.state is not RequestState.RESERVED:
                continue  # aborted while queued; its lease is already back
            try:
                self._running = dreq.request_id
                logits = await self._prefill(svc, d, dreq)
            finally:
                self._running = ""
            if logits is None:
                continue
            first = dreq.sampler.sample(logits)  # the request's one sampler (index 0)
            await svc.start_decoding(dreq, first, time.monotonic())

    async def _prefill(self, svc: DecodeService, d: m.PrefillDispatch,
                       dreq: DecodeRequest) -> torch.Tensor | None:
        """Prefill chunk by chunk; the last chunk's logits, or None when it ended."""
        logits = None
        scored, entries = d.sampling.prompt_logprobs, []
        for start, length in prefill_windows(0, len(d.prompt_ids)):
            dreq.pinned = True  # the engine thread writes this lease: defer any release
            chunk_at = time.monotonic()
            piece, after = d.prompt_ids[start:start + length], start + length
            try:
                if scored is None:
                    logits = await svc.compute(svc.engine.prefill, dreq.lease, piece, start,
                                               threads=svc.prefill_threads)
                else:  # the prompt's own logprobs too
                    logits, entries = await svc.compute(
                        svc.engine.prefill_scored, dreq.lease, piece, start, scored,
                        d.prompt_ids[after] if after < len(d.prompt_ids) else None,
                        threads=svc.prefill_threads)
            except Exception as exc:
                log.exception("colocated prefill of %s failed", dreq.request_id)
                dreq.finish(m.Outcome(code=m.Code.INTERNAL, detail=str(exc)))
            svc.rt.tracing.record("prefill.chunk", dreq.span, chunk_at, time.monotonic(),
                                  **{"pdmesh.chunk.start": start, "pdmesh.chunk.tokens": length})
            lease = dreq.unpin()
            if lease is not None:  # ended during the chunk (or by it): stop here
                await svc.conclude(dreq, lease)
                return None
            if entries:
                await svc.tell(dreq, m.PromptLogprobs(request_id=dreq.request_id,
                                                      start=start + 1, logprobs=entries))
            await self._progress(svc, d, dreq, start + length)
        return logits


def build(cfg: ColocatedConfig) -> DecodeService:
    return DecodeService(cfg, intake=LocalPrefill(cfg),
                         advertised_roles=(m.Role.PREFILL, m.Role.DECODE))


async def serve(cfg: ColocatedConfig) -> None:
    await run_worker(build(cfg))
