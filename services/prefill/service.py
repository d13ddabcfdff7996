"""Prefill service: verify the ticket, re-check capacity, compute the prompt's KV, send it.

Per request: ADMITTED (dispatch received, ticket verified) -> PREFILLING (lease held in this
worker's pool, prompt running) -> TRANSFERRED (decode acked the verified commit), or
ABORTED / FAILED. Whenever prefill gives up on a request it tells decode at once with a
`Release` so decode frees its lease within a second (I6): no cleanup path waits out a timeout.
Prefill runs one prompt at a time in FIFO order; its own lease is freed in `_run`'s finally.

Prefix cache (I7): the lease starts with the longest cached page-aligned prefix of the
prompt *under the ticket's cache salt* (server-side, per tenant; clients cannot set it),
pinned read-only; only the rest is computed. After the prefill the prompt's whole aligned
pages join the cache under that salt. Decode still receives every prompt page, verified.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter

from kvstore import Lease, PoolExhaustedError, PrefixCache
from services import messages as m
from services.capacity import prefill_refusal
from services.config import ServiceConfig
from services.engine.sampling import Sampler, SamplingParams
from services.faults import REQUEST_FAULTS, data_plane_plan
from services.errors import TicketError
from services.lifecycle import RequestState, advance
from services.runtime import counter_total
from services.worker import WorkerBase, run_worker
from transports import TransferAck, TransferError, TransferPlan

log = logging.getLogger("pdmesh.prefill")


@dataclass(eq=False)
class PrefillJob:
    dispatch: m.PrefillDispatch
    state: RequestState = RequestState.ADMITTED

    @property
    def request_id(self) -> str:
        return self.dispatch.ticket.request_id


class _SilentFailure(Exception):
    """Test fault `silent_prefill`: fail without telling decode (its deadline must hold)."""


class PrefillService(WorkerBase):
    role = m.Role.PREFILL

    def __init__(self, cfg: ServiceConfig) -> None:
        super().__init__(cfg)
        self.queue: collections.deque[PrefillJob] = collections.deque()
        self.jobs: dict[str, PrefillJob] = {}
        self._work = asyncio.Event()
        self._freed = asyncio.Event()
        self.request_faults = REQUEST_FAULTS in cfg.fault_set  # test meshes only
        r = self.rt.registry
        self.dispatches = Counter("pdmesh_prefill_dispatches_total", "Dispatches by outcome",
                                  ["outcome"], registry=r)
        self.bootstraps = Counter("pdmesh_bootstraps_total",
                                  "Prefills started (lease taken, prompt run)", registry=r)
        self.transfers = Counter("pdmesh_transfers_sent_total", "KV transfers by outcome",
                                 ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdmesh_prefill_tokens_total",
                                     "Prompt tokens prefilled (computed, not cached)",
                                     registry=r)
        self.cache_queries = Counter("pdmesh_prefix_cache_queries_total",
                                     "Prefills that looked their prompt up in the prefix cache",
                                     registry=r)
        self.cache_hits = Counter("pdmesh_prefix_cache_hits_total",
                                  "Prompt tokens served from the prefix cache", registry=r)
        self.cache_evictions = Counter("pdmesh_prefix_cache_evictions_total",
                                       "Prefix-cache pages evicted", registry=r)
        self.prefix_cache = PrefixCache(self.pool, align_tokens=self.engine.prefix_align_tokens,
                                        on_evict=self.cache_evictions.inc)

    async def subscribe(self) -> None:
        wid = self.cfg.worker_id
        await self.rt.subscribe(m.dispatch_subject(wid), m.PrefillDispatch, self._on_dispatch,
                                concurrent=False)
        await self.rt.subscribe(m.ABORT_SUBJECT, m.Abort, self._on_abort, concurrent=False)
        self.rt.spawn(self._loop(), "prefill-loop")

    def queue_depth(self) -> int:
        return len(self.queue)

    def active_requests(self) -> int:
        return len(self.jobs)

    def counters(self) -> dict[str, float]:
        return {"dispatches": counter_total(self.dispatches),
                "bootstraps": counter_total(self.bootstraps),
                "transfers": counter_total(self.transfers),
                "prompt_tokens": counter_total(self.prompt_tokens),
                "prefix_cache_queries": counter_total(self.cache_queries),
                "prefix_cache_hit_tokens": counter_total(self.cache_hits),
                "prefix_cache_evictions": counter_total(self.cache_evictions),
                "prefix_cache_pages": float(self.prefix_cache.num_pages)}

    # -- intake -------------------------------------------------------------------------
    async def _on_dispatch(self, d: m.PrefillDispatch, _msg: Msg) -> None:
        rid = d.ticket.request_id
        self.seen_requests.append(rid)
        try:
            self.verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            await self._give_up(d, m.FailCode.TICKET_INVALID, str(exc), "ticket_refused")
            return
        problem = self._recheck(d)
        if self.request_faults and d.fault == "prefill_reject":
            problem = "test fault prefill_reject: prefill refuses what admission admitted"
        if problem:
            await self._give_up(d, m.FailCode.PREFILL_REJECTED, problem, "rejected")
            return
        job = PrefillJob(d)
        self.jobs[rid] = job
        self.queue.append(job)
        self.dispatches.labels("queued").inc()
        self._work.set()

    def _recheck(self, d: m.PrefillDispatch) -> str:
        """Prefill's own gate, independent of admission (defence in depth)."""
        n = len(d.prompt_ids)
        vocab = self.model.tokenizer.vocab_size
        refusal = prefill_refusal(n, self.pool.capacity_tokens, self.pool.spec.page_size,
                                  self.served_context)
        if refusal:
            return refusal
        if min(d.prompt_ids) < 0 or max(d.prompt_ids) >= vocab:
            return f"token id out of range 0..{vocab - 1}"
        if len(d.page_ids) != -(-n // d.page_tokens) or d.page_tokens != self.pool.spec.page_size:
            return "reservation does not match the prompt's pages"
        return ""

    async def _give_up(self, d: m.PrefillDispatch, code: m.FailCode, detail: str,
                       outcome: str) -> None:
        """Tell decode to free its reservation now and the client why (I6)."""
        self.dispatches.labels(outcome).inc()
        log.warning("prefill gives up on %s: %s", d.ticket.request_id, detail)
        await self.rt.publish(m.release_subject(d.ticket.decode_worker), m.Release(
            request_id=d.ticket.request_id, reservation_id=d.reservation_id, code=code,
            detail=detail))
        await self.rt.publish(m.tokens_subject(d.ticket.request_id), m.TokenEvent(
            request_id=d.ticket.request_id, seq=0, fail_code=code, detail=detail))

    async def _on_abort(self, ab: m.Abort, _msg: Msg) -> None:
        job = self.jobs.get(ab.request_id)
        if job is not None and not job.state.is_terminal:
            job.state = RequestState.ABORTED  # the loop skips or stops it at the next await

    # -- work ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            if not self.queue:
                self._work.clear()
                await self._work.wait()
                continue
            job = self.queue.popleft()
            try:
                await self._run(job)
            finally:
                self.jobs.pop(job.request_id, None)

    async def _run(self, job: PrefillJob) -> None:
        d = job.dispatch
        if job.state.is_terminal:  # aborted while queued: decode heard the abort too
            self.dispatches.labels("aborted").inc()
            return
        lease = None
        try:
            lease = await self._allocate(job)
            cached = lease.cached_tokens
            self.cache_queries.inc()
            self.cache_hits.inc(cached)
            job.state = advance(job.request_id, job.state, RequestState.PREFILLING)
            self.bootstraps.inc()
            logits = await self.compute(self.engine.prefill, lease, d.prompt_ids[cached:],
                                        cached)
            self.prompt_tokens.inc(len(d.prompt_ids) - cached)
            if job.state.is_terminal:
                return
            self.prefix_cache.insert(d.ticket.cache_salt, d.prompt_ids, lease)
            sampler = Sampler(SamplingParams(temperature=d.sampling.temperature,
                                             top_p=d.sampling.top_p, seed=d.sampling.seed,
                                             max_tokens=d.ticket.max_tokens))
            first = sampler.sample(logits)
            await self._report_cached(d, cached)
            plan = TransferPlan(reservation_id=d.reservation_id, epoch=d.epoch,
                                dest_page_ids=tuple(d.page_ids), num_tokens=len(d.prompt_ids),
                                page_tokens=d.page_tokens, page_bytes=d.page_bytes,
                                first_token=first, deadline_s=self.cfg.transfer_deadline_s)
            # Read-only views: cached pages may be read (pinned) but never written.
            buffers = [self.pool.page_view(lease, i) for i in range(len(d.page_ids))]
            ack = await self._send(d, plan, buffers)
            self.kv_bytes.labels("out").inc(ack.bytes)
            self.transfers.labels("ok").inc()
            if not job.state.is_terminal:  # an abort during the send already ended it
                job.state = advance(job.request_id, job.state, RequestState.TRANSFERRED)
        except _SilentFailure:
            job.state = RequestState.FAILED  # test fault: decode is deliberately not told
        except TransferError as exc:
            self.transfers.labels(exc.reason.name.lower()).inc()
            job.state = RequestState.FAILED
            await self._give_up(d, m.FailCode.TRANSFER_FAILED, f"KV transfer failed: {exc}",
                                "transfer_failed")
        except PoolExhaustedError as exc:
            job.state = RequestState.FAILED
            await self._give_up(d, m.FailCode.PREFILL_REJECTED, str(exc), "pool_full")
        except Exception as exc:  # noqa: BLE001 - fail this request, keep the service
            log.exception("prefill of %s failed", job.request_id)
            job.state = RequestState.FAILED
            await self._give_up(d, m.FailCode.INTERNAL, f"prefill failed: {exc}", "error")
        finally:
            if lease is not None:
                self.pool.release(lease, job.state.name.lower())
                self._freed.set()

    async def _report_cached(self, d: m.PrefillDispatch, cached: int) -> None:
        """Info event (seq -1) for the gateway's usage.prompt_tokens_details.cached_tokens,
        flushed before the KV goes out so that it reaches the gateway before decode's first
        token (the gateway ignores info events after the stream ended)."""
        await self.rt.publish(m.tokens_subject(d.ticket.request_id), m.TokenEvent(
            request_id=d.ticket.request_id, seq=-1, prompt_tokens=len(d.prompt_ids),
            cached_tokens=cached))
        try:
            await self.rt.nc.flush(timeout=1)
        except (nats.errors.Error, TimeoutError) as exc:  # only the usage figure is at stake
            log.warning("flushing the cache info event of %s failed: %s",
                        d.ticket.request_id, exc)

    async def _send(self, d: m.PrefillDispatch, plan: TransferPlan,
                    buffers: list[memoryview]) -> TransferAck:
        """Send the KV; with a test fault enabled for this request, send it wrong."""
        fault = d.fault if self.request_faults else ""
        if not fault:
            return await self.transport.send(d.data_address, plan, buffers)
        if fault == "stub_transfer":
            # The incident: a "rejected" prompt replaced by a 1-token stub, handed off anyway.
            plan = dataclasses.replace(plan, num_tokens=1, dest_page_ids=plan.dest_page_ids[:1])
            buffers = buffers[:1]
        elif fault == "stale_epoch":
            plan = dataclasses.replace(plan, epoch=plan.epoch + 1)
        elif fault == "foreign_reservation":
            plan = dataclasses.replace(plan, reservation_id=str(uuid.uuid4()))
        elif fault == "silent_prefill":
            raise _SilentFailure()
        faults = data_plane_plan(fault, len(buffers), plan.page_bytes)
        # Prefill sends one transfer at a time (its loop is serial), so setting the
        # transport's fault plan around this one send affects no other request.
        self.transport.faults = faults  # type: ignore[attr-defined]
        try:
            return await self.transport.send(d.data_address, plan, buffers)
        finally:
            self.transport.faults = None  # type: ignore[attr-defined]

    async def _allocate(self, job: PrefillJob) -> Lease:
        """Lease pages for the prompt, reusing this tenant's cached prefix (evicting other
        unpinned cached pages when short), waiting (bounded) while other prompts hold them."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.transfer_deadline_s
        while True:
            try:
                d = job.dispatch
                return self.prefix_cache.allocate(job.request_id, d.ticket.cache_salt,
                                                  d.prompt_ids)
            except PoolExhaustedError:
                if loop.time() >= deadline or job.state.is_terminal:
                    raise
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), deadline - loop.time())
                except TimeoutError:
                    pass


async def serve(cfg: ServiceConfig) -> None:
    await run_worker(PrefillService(cfg))
