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
"""

from __future__ import annotations

import asyncio
import collections
import logging

from nats.aio.msg import Msg

from pdmesh.services import messages as m
from pdmesh.services.config import ServiceConfig
from pdmesh.services.decode.service import DecodeRequest, DecodeService
from pdmesh.services.errors import TicketError
from pdmesh.services.lifecycle import RequestState
from pdmesh.services.tickets import TicketVerifier, verify_grant
from pdmesh.services.worker import run_worker

log = logging.getLogger("pdmesh.colocated")


class LocalPrefill:
    """The colocated worker's KV intake: dispatches are prefilled into the reserved lease,
    one at a time. A dispatch that never comes frees the lease at the transfer deadline."""

    def __init__(self, cfg: ServiceConfig) -> None:
        # The ticket names this worker twice; each role checks (and burns) it once.
        self.verifier = TicketVerifier(cfg.mesh_secret, cfg.worker_id, m.Role.PREFILL)
        self._dispatches: collections.deque[m.PrefillDispatch] = collections.deque()
        self._dispatched = asyncio.Event()
        self.svc: DecodeService | None = None

    async def attach(self, svc: DecodeService) -> None:
        self.svc = svc
        await svc.rt.subscribe(m.dispatch_subject(svc.cfg.worker_id), m.PrefillDispatch,
                               self._on_dispatch, concurrent=False)
        svc.rt.spawn(self._prefill_loop(svc), "prefill-loop")

    def expect(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        svc.rt.spawn(self._dispatch_deadline(svc, dreq), f"deadline:{dreq.request_id}")

    async def _dispatch_deadline(self, svc: DecodeService, dreq: DecodeRequest) -> None:
        await asyncio.sleep(svc.cfg.transfer_deadline_s)
        if dreq.state is RequestState.RESERVED:
            await svc.end(dreq, m.Outcome(code=m.Code.DEADLINE,
                                          detail="no dispatch within the transfer deadline"))

    async def _on_dispatch(self, d: m.PrefillDispatch, _msg: Msg) -> None:
        svc = self.svc
        assert svc is not None
        dreq = svc.requests.get(d.ticket.request_id)
        try:
            self.verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
            verify_grant(svc.cfg.mesh_secret, d)
        except TicketError as exc:
            svc.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            if dreq is not None:
                await svc.end(dreq, m.Outcome(code=m.Code.TICKET_INVALID, detail=str(exc)))
            return
        if dreq is None or dreq.reservation_id != d.reservation.reservation_id:
            log.warning("dispatch for %s names no live reservation here", d.ticket.request_id)
            return
        vocab = svc.model.tokenizer.vocab_size
        if min(d.prompt_ids) < 0 or max(d.prompt_ids) >= vocab:
            # The same token-range gate as a prefill worker's (defence in depth).
            await svc.end(dreq, m.Outcome(code=m.Code.PREFILL_REJECTED,
                                          detail=f"token id out of range 0..{vocab - 1}"))
            return
        self._dispatches.append(d)
        self._dispatched.set()

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
            dreq.pinned = True  # the engine thread writes this lease: defer any release
            try:
                logits = await svc.compute(svc.engine.prefill, dreq.lease, d.prompt_ids)
            except Exception as exc:
                log.exception("colocated prefill of %s failed", dreq.request_id)
                dreq.finish(m.Outcome(code=m.Code.INTERNAL, detail=str(exc)))
            lease = dreq.unpin()
            if lease is not None:  # ended during the prefill (or by it)
                await svc.conclude(dreq, lease)
                continue
            first = dreq.sampler.sample(logits)  # the request's one sampler (index 0)
            await svc.start_decoding(dreq, first)


def build(cfg: ServiceConfig) -> DecodeService:
    return DecodeService(cfg, intake=LocalPrefill(cfg),
                         advertised_roles=(m.Role.PREFILL, m.Role.DECODE))


async def serve(cfg: ServiceConfig) -> None:
    await run_worker(build(cfg))
