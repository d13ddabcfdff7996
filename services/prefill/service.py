"""Prefill service: verify the ticket, re-check capacity, compute the prompt's KV, send it.

Per request: ADMITTED (dispatch received, ticket verified) -> PREFILLING (lease held in this
worker's pool, prompt running) -> TRANSFERRED (decode acked the verified commit), or
ABORTED / FAILED. Whenever prefill gives up on a request it tells decode at once with a
`Release` so decode frees its lease within a second (I6): no cleanup path waits out a timeout.
The queueing policy is `PrefillQueue` (FIFO, one prompt at a time); this worker's own lease
is freed in `_run`'s finally.

Prefix cache (I7): the lease starts with the longest cached page-aligned prefix of the
prompt *under the ticket's cache salt* (server-side, per tenant; clients cannot set it),
pinned read-only; only the rest is computed. After the prefill the prompt's whole aligned
pages join the cache under that salt. Decode still receives every prompt page, verified.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from pdmesh.kvstore import KVPool, Lease, PoolExhaustedError, PrefixCache
from pdmesh.kvstore.spec import pages_for
from pdmesh.services import faults, tickets
from pdmesh.services import messages as m
from pdmesh.services.capacity import prefill_refusal
from pdmesh.services.config import ServiceConfig
from pdmesh.services.engine.sampling import Sampler
from pdmesh.services.errors import TicketError
from pdmesh.services.lifecycle import Lifecycle, RequestState
from pdmesh.services.prefill.scheduler import PrefillQueue
from pdmesh.services.runtime import counter_total
from pdmesh.services.worker import WorkerBase, run_worker
from pdmesh.transports import KVTransport, Reason, TransferError, TransferPlan
from pdmesh.transports.framing import transfer_key

# What prefill does with a dispatch before its own gate (production: take it as it came;
# a test mesh injects its fault intake, services/faults.py).
DispatchIntake = Callable[[m.PrefillDispatch, Mapping[str, str] | None],
                          m.PrefillDispatch | None]


def transfer_plan(d: m.PrefillDispatch, first_token: int, deadline_s: float,
                  mesh_secret: str) -> TransferPlan:
    """The decode reservation of a dispatch, as the transport's plan: the one conversion
    (its frames are MACed under the reservation's key, derived from the mesh secret)."""
    r = d.reservation
    return TransferPlan(reservation_id=r.reservation_id, epoch=r.epoch,
                        dest_page_ids=tuple(r.page_ids), num_tokens=len(d.prompt_ids),
                        page_tokens=r.page_tokens, page_bytes=r.page_bytes,
                        first_token=first_token, deadline_s=deadline_s,
                        key=transfer_key(mesh_secret, r.reservation_id, r.epoch))


def outgoing_pages(pool: KVPool, lease: Lease, num_tokens: int) -> list[memoryview]:
    """The pages a prefill sends for a prompt of `num_tokens`: read-only views (cached pages
    may be read, pinned, never written), with the unwritten tail of the last page zeroed
    first, so that no byte of an earlier tenant's KV leaves this worker (the pool's default
    scrub policy does not clear freed pages)."""
    n_pages = pages_for(num_tokens, pool.spec.page_tokens)
    tail = num_tokens - (n_pages - 1) * pool.spec.page_tokens
    if tail < pool.spec.page_tokens:  # the last page is this lease's own, never a cached one
        pool.page_tensor(lease, n_pages - 1)[:, :, tail:].zero_()
    return [pool.page_view(lease, i) for i in range(n_pages)]


def sampler_for(sampling: m.Sampling, max_tokens: int, eos_token_ids: Iterable[int]) -> Sampler:
    return Sampler.for_request(sampling, max_tokens, eos_token_ids)


log = logging.getLogger("pdmesh.prefill")


@dataclass(eq=False)
class PrefillJob:
    dispatch: m.PrefillDispatch
    lifecycle: Lifecycle = field(init=False)

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.request_id, RequestState.ADMITTED)

    @property
    def request_id(self) -> str:
        return self.dispatch.ticket.request_id


class PrefillService(WorkerBase):
    role = m.Role.PREFILL

    def __init__(self, cfg: ServiceConfig, transport: KVTransport | None = None,
                 intake: DispatchIntake = faults.accept_dispatch) -> None:
        super().__init__(cfg, transport)
        self.intake = intake
        self.queue: PrefillQueue[PrefillJob] = PrefillQueue()
        self._work = asyncio.Event()
        self._freed = asyncio.Event()
        r = self.rt.registry
        self.dispatches = Counter("pdmesh:prefill_dispatches_total", "Dispatches by outcome",
                                  ["outcome"], registry=r)
        self.bootstraps = Counter("pdmesh:bootstraps_total",
                                  "Prefills started (lease taken, prompt run)", registry=r)
        self.transfers = Counter("pdmesh:transfers_sent_total", "KV transfers by outcome",
                                 ["outcome"], registry=r)
        self.prompt_tokens = Counter("pdmesh:prefill_tokens_total",
                                     "Prompt tokens prefilled (computed, not cached)",
                                     registry=r)
        self.cache_queries = Counter("pdmesh:prefix_cache_queries_total",
                                     "Prefills that looked their prompt up in the prefix cache",
                                     registry=r)
        self.cache_hits = Counter("pdmesh:prefix_cache_hits_total",
                                  "Prompt tokens served from the prefix cache", registry=r)
        self.cache_evictions = Counter("pdmesh:prefix_cache_evictions_total",
                                       "Prefix-cache pages evicted", registry=r)
        self.transfer_seconds = Histogram(
            "pdmesh:kv_transfer_time_seconds", "KV send to decode's ack, per request",
            ["model_name"], registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        ).labels(cfg.served_model_names[0] if cfg.served_model_names else self.model.name)
        self.prefix_cache = PrefixCache(self.pool, align_tokens=self.engine.prefix_align_tokens,
                                        on_evict=self.cache_evictions.inc)

    async def subscribe(self) -> None:
        wid = self.cfg.worker_id
        await self.rt.subscribe(m.dispatch_subject(wid), m.PrefillDispatch, self._on_dispatch,
                                concurrent=False)
        await self.rt.subscribe(m.ABORT_SUBJECT, m.Abort, self._on_abort, concurrent=False)
        self.rt.spawn(self._loop(), "prefill-loop")

    def queue_depth(self) -> int:
        return self.queue.depth

    def active_requests(self) -> int:
        return len(self.queue)

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
    async def _on_dispatch(self, d: m.PrefillDispatch, msg: Msg) -> None:
        dispatch = self.intake(d, msg.headers)
        if dispatch is None:
            return
        await self.accept(dispatch)

    async def accept(self, d: m.PrefillDispatch) -> None:
        """Verify and queue one dispatch, or give it up (decode and the client told)."""
        rid = d.ticket.request_id
        self.seen_requests.append(rid)
        try:
            self.verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
            problem = self._recheck(d)
            if not problem:  # the grant binds prompt and reservation to the ticket
                tickets.verify_grant(self.cfg.mesh_secret, d)
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            await self._give_up(d, m.Outcome(code=m.Code.TICKET_INVALID, detail=str(exc)),
                                "ticket_refused")
            return
        if problem:
            await self._give_up(d, m.Outcome(code=m.Code.PREFILL_REJECTED, detail=problem),
                                "rejected")
            return
        if self.queue.get(rid) is not None:
            log.warning("duplicate dispatch for %s ignored", rid)
            return
        self.queue.push(PrefillJob(d))
        self.dispatches.labels("queued").inc()
        self._work.set()

    def _recheck(self, d: m.PrefillDispatch) -> str:
        """Prefill's own gate, independent of admission (defence in depth)."""
        n = len(d.prompt_ids)
        vocab = self.model.tokenizer.vocab_size
        refusal = prefill_refusal(n, self.pool.capacity_tokens, self.pool.spec.page_tokens,
                                  self.served_context)
        if refusal:
            return refusal
        if min(d.prompt_ids) < 0 or max(d.prompt_ids) >= vocab:
            return f"token id out of range 0..{vocab - 1}"
        r = d.reservation
        if r.page_tokens != self.pool.spec.page_tokens or len(r.page_ids) != pages_for(
                n, r.page_tokens):
            return "reservation does not match the prompt's pages"
        return ""

    async def _give_up(self, d: m.PrefillDispatch, outcome: m.Outcome, label: str) -> None:
        """Tell decode to free its reservation now and the client why (I6). A failed
        publish is logged, never raised: the prefill loop must outlive it."""
        self.dispatches.labels(label).inc()
        rid = d.ticket.request_id
        log.warning("prefill gives up on %s: %s", rid, outcome.detail)
        try:
            await self.rt.publish(m.release_subject(d.ticket.decode_worker), m.Release(
                request_id=rid, reservation_id=d.reservation.reservation_id, outcome=outcome))
            await self.rt.publish(m.tokens_subject(rid),
                                  m.StreamFailed(request_id=rid, outcome=outcome))
        except (nats.errors.Error, OSError) as exc:
            log.error("telling decode and the client about %s failed: %s", rid, exc)

    async def _on_abort(self, ab: m.Abort, _msg: Msg) -> None:
        job = self.queue.get(ab.request_id)
        if job is not None:
            # The loop skips it (queued) or stops it at its next await (running).
            job.lifecycle.finish(ab.outcome)

    # -- work ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            job = self.queue.pop()
            if job is None:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                await self._run(job)
            finally:
                self.queue.done(job)

    async def _run(self, job: PrefillJob) -> None:
        d, life = job.dispatch, job.lifecycle
        if life.is_terminal:  # aborted while queued: decode heard the abort too
            self.dispatches.labels("aborted").inc()
            return
        lease = None
        failure: tuple[m.Outcome, str] | None = None
        unreachable = ""  # why decode's data address could not be reached, if it could not
        try:
            lease = await self._allocate(job)
            cached = lease.cached_tokens
            self.cache_queries.inc()
            self.cache_hits.inc(cached)
            life.advance(RequestState.PREFILLING)
            self.bootstraps.inc()
            logits = await self.compute(self.engine.prefill, lease, d.prompt_ids[cached:],
                                        cached)
            self.prompt_tokens.inc(len(d.prompt_ids) - cached)
            if life.is_terminal:
                return
            self.prefix_cache.insert(d.ticket.cache_salt, d.prompt_ids, lease)
            sampler = sampler_for(d.sampling, d.ticket.max_tokens,
                                  self.model.tokenizer.eos_token_ids)
            first = sampler.sample(logits)
            if d.sampling.logprobs is not None:  # flushed with the cache info below
                await self.rt.publish(m.tokens_subject(job.request_id), m.FirstTokenLogprobs(
                    request_id=job.request_id, token_id=first,
                    logprobs=sampler.take_logprobs(first)))
            await self._report_cached(d, cached)
            plan = transfer_plan(d, first, self.cfg.transfer_deadline_s, self.cfg.mesh_secret)
            # Read-only views: cached pages may be read (pinned) but never written.
            buffers = outgoing_pages(self.pool, lease, plan.num_tokens)
            sent_at = time.monotonic()
            ack = await self.transport.send(d.reservation.data_address, plan, buffers)
            self.transfer_seconds.observe(time.monotonic() - sent_at)
            self.kv_bytes.labels("out").inc(ack.bytes)
            self.transfers.labels("ok").inc()
            if not life.is_terminal:  # an abort during the send already ended it
                life.advance(RequestState.TRANSFERRED)
        except TransferError as exc:
            self.transfers.labels(exc.reason.name.lower()).inc()
            failure = self._fail(life, m.Code.TRANSFER_FAILED, f"KV transfer failed: {exc}",
                                 "transfer_failed")
            if exc.reason is Reason.PEER_LOST and exc.detail.startswith("connect "):
                unreachable = exc.detail  # the transports' connect failure
        except PoolExhaustedError as exc:
            failure = self._fail(life, m.Code.PREFILL_REJECTED, str(exc), "pool_full")
        except Exception as exc:
            log.exception("prefill of %s failed", job.request_id)
            failure = self._fail(life, m.Code.INTERNAL, f"prefill failed: {exc}", "error")
        finally:
            # Release before telling: this worker's pages are back before anyone hears.
            if lease is not None:
                self.pool.release(lease, life.outcome.label if life.outcome
                                  else life.state.name.lower())
                self._freed.set()
        if failure is not None:
            await self._give_up(d, *failure)
        if unreachable:
            await self._report_unreachable(d, unreachable)

    async def _report_unreachable(self, d: m.PrefillDispatch, detail: str) -> None:
        """Tell admission that decode's advertised data address cannot be reached from here,
        so that it routes around that worker instead of failing request after request."""
        log.warning("decode %s unreachable at %s: %s", d.ticket.decode_worker,
                    d.reservation.data_address, detail)
        try:
            await self.rt.publish(m.UNREACHABLE_SUBJECT, m.DataPlaneUnreachable(
                worker_id=d.ticket.decode_worker, data_address=d.reservation.data_address,
                reporter=self.cfg.worker_id, detail=detail))
        except (nats.errors.Error, OSError) as exc:
            log.error("reporting unreachable decode %s failed: %s", d.ticket.decode_worker, exc)

    @staticmethod
    def _fail(life: Lifecycle, code: m.Code, detail: str,
              label: str) -> tuple[m.Outcome, str] | None:
        """End the request as failed; what to tell decode and the client (None when an
        abort had already ended it: they know)."""
        outcome = m.Outcome(code=code, detail=detail)
        return (outcome, label) if life.finish(outcome) else None

    async def _report_cached(self, d: m.PrefillDispatch, cached: int) -> None:
        """Info event for the gateway's usage.prompt_tokens_details.cached_tokens, flushed
        before the KV goes out so that it reaches the gateway before decode's first token
        (the gateway ignores info events after the stream ended)."""
        rid = d.ticket.request_id
        try:
            await self.rt.publish(m.tokens_subject(rid), m.PrefixCacheInfo(
                request_id=rid, prompt_tokens=len(d.prompt_ids), cached_tokens=cached))
            await self.rt.nc.flush(timeout=1)
        except (nats.errors.Error, TimeoutError) as exc:  # only the usage figure is at stake
            log.warning("flushing the cache info event of %s failed: %s", rid, exc)

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
                if loop.time() >= deadline or job.lifecycle.is_terminal:
                    raise
                self._freed.clear()
                try:
                    await asyncio.wait_for(self._freed.wait(), deadline - loop.time())
                except TimeoutError:
                    pass


async def serve(cfg: ServiceConfig) -> None:
    transport, intake = faults.prefill_wiring(cfg)
    await run_worker(PrefillService(cfg, transport, intake))
