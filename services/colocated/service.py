"""Colocated worker: prefill and decode in one process over one pool, no KV transfer.

It is the single-process engine served behind the same gateway and admission
(`pdmesh up --colocated`), the baseline the load tester compares the disaggregated mesh
against. It heartbeats as both a prefill and a decode worker, so admission hands it both
the reservation and the dispatch; the prompt is prefilled straight into the reserved lease
(the engine marks the pages written), then decoding continues exactly as on a decode worker.
Every other guard is the same: signed tickets (checked for both roles), lease read checks,
and the same request lifecycle and release paths.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from nats.aio.msg import Msg

from services import messages as m
from services.config import ServiceConfig
from services.decode.service import DecodeRequest, DecodeService
from services.engine.sampling import Sampler, SamplingParams
from services.errors import TicketError
from services.lifecycle import RequestState
from services.tickets import TicketVerifier
from services.worker import run_worker

log = logging.getLogger("pdmesh.colocated")


class ColocatedService(DecodeService):
    advertised_roles = (m.Role.PREFILL, m.Role.DECODE)

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        # The ticket names this worker twice; each role checks (and burns) it once.
        self.prefill_verifier = TicketVerifier(cfg.mesh_secret, cfg.worker_id, m.Role.PREFILL)
        self._dispatches: collections.deque[m.PrefillDispatch] = collections.deque()
        self._dispatched = asyncio.Event()

    async def subscribe(self) -> None:
        await super().subscribe()
        await self.rt.subscribe(m.dispatch_subject(self.cfg.worker_id), m.PrefillDispatch,
                                self._on_dispatch, concurrent=False)
        self.rt.spawn(self._prefill_loop(), "prefill-loop")

    def _expect_kv(self, dreq: DecodeRequest) -> tuple[int, ...]:
        """No transfer: the dispatch will prefill straight into this lease. The deadline
        still holds: a dispatch that never comes frees the lease."""
        self.rt.spawn(self._dispatch_deadline(dreq), f"deadline:{dreq.request_id}")
        n_prompt_pages = -(-dreq.ticket.prompt_len // self.pool.spec.page_size)
        return dreq.lease.page_ids[:n_prompt_pages]

    async def _dispatch_deadline(self, dreq: DecodeRequest) -> None:
        await asyncio.sleep(self.cfg.transfer_deadline_s)
        if dreq.state is RequestState.RESERVED:
            await self._end(dreq, RequestState.FAILED, m.FailCode.DEADLINE,
                            "no dispatch within the transfer deadline")

    async def _on_dispatch(self, d: m.PrefillDispatch, _msg: Msg) -> None:
        dreq = self.requests.get(d.ticket.request_id)
        try:
            self.prefill_verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            if dreq is not None:
                await self._end(dreq, RequestState.FAILED, m.FailCode.TICKET_INVALID, str(exc))
            return
        if dreq is None or dreq.reservation_id != d.reservation_id:
            log.warning("dispatch for %s names no live reservation here", d.ticket.request_id)
            return
        self._dispatches.append(d)
        self._dispatched.set()

    async def _prefill_loop(self) -> None:
        while True:
            if not self._dispatches:
                self._dispatched.clear()
                await self._dispatched.wait()
                continue
            d = self._dispatches.popleft()
            dreq = self.requests.get(d.ticket.request_id)
            if dreq is None or dreq.state is not RequestState.RESERVED:
                continue  # aborted while queued; its lease is already back
            dreq.in_step = True  # the engine thread writes this lease: defer any release
            try:
                logits = await self.compute(self.engine.prefill, dreq.lease, d.prompt_ids)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep the service
                log.exception("colocated prefill of %s failed", dreq.request_id)
                dreq.in_step = False
                await self._end(dreq, RequestState.FAILED, m.FailCode.INTERNAL, str(exc))
                continue
            dreq.in_step = False
            if dreq.end_after_step is not None:
                await self._end(dreq, *dreq.end_after_step)
                continue
            first = Sampler(SamplingParams(temperature=d.sampling.temperature,
                                           top_p=d.sampling.top_p, seed=d.sampling.seed,
                                           max_tokens=d.ticket.max_tokens)).sample(logits)
            await self._start_decoding(dreq, first)


async def serve(cfg: ServiceConfig) -> None:
    await run_worker(ColocatedService(cfg))
