"""Prefill service: verify the ticket, re-check capacity, compute the prompt's KV, send it.

Per request: ADMITTED (dispatch received, ticket verified) -> PREFILLING (lease held in this
worker's pool, prompt running) -> TRANSFERRED (decode acked the verified commit), or
ABORTED / FAILED. Whenever prefill gives up on a request it tells decode at once with a
`Release` so decode frees its lease within a second (I6): no cleanup path waits out a timeout.

Long prompts: the prompt runs one chunk (`prefill_windows`) per turn, and the
started prompts take turns (`PrefillQueue`, chunk-level round robin), so a short prompt
behind a long one is not held up by all of it. The KV streams as it is computed: the
transfer starts when the lease is taken (an unreachable decode is found before any
compute), each chunk's finished pages go out while the next chunk computes
(`transports.PagesReady`), the commit (with the first token) last. Liveness is progress,
not a deadline: after each chunk, and every `prefill_stall_s / 4` for every request it
holds while its engine is not stuck, prefill sends a `PrefillProgress` to decode and the
gateway; they give up on a request only when progress stops. An abort stops the compute
at the next chunk boundary. Each request's lease is freed when both its compute and its
send have ended (`PrefillJob.settled`), then decode and the client are told.

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
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from pdmesh.kvstore import KVPool, Lease, PoolExhaustedError, PrefixCache
from pdmesh.kvstore.spec import pages_for
from pdmesh.services import faults
from pdmesh.services.engine.grammar import Grammars
from pdmesh.services.engine.model import prefill_windows
from pdmesh.services.engine.sampling import Sampler
from pdmesh.services.prefill.scheduler import PrefillQueue
from pdmesh.services.prefill.tiers import PrefillTiers, make_tiers
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth, tickets
from pdmesh.services.protocol.capacity import prefill_refusal
from pdmesh.services.protocol.errors import TicketError
from pdmesh.services.protocol.lifecycle import Lifecycle, RequestState
from pdmesh.services.runtime import ptrace
from pdmesh.services.runtime.config import PrefillConfig
from pdmesh.services.runtime.service import counter_total
from pdmesh.services.runtime.tracing import end
from pdmesh.services.runtime.worker import WorkerBase, run_worker
from pdmesh.transports import KVTransport, PagesReady, Reason, TransferError, TransferPlan
from pdmesh.transports.framing import transfer_key

# What prefill does with a dispatch before its own gate (production: take it as it came;
# a test mesh injects its fault intake, services/faults.py).
DispatchIntake = Callable[[m.PrefillDispatch, Mapping[str, str] | None],
                          m.PrefillDispatch | None]


def transfer_plan(d: m.PrefillDispatch, deadline_s: float) -> TransferPlan:
    """The decode reservation of a dispatch, as the transport's plan: the one conversion
    (its frames are MACed under the reservation's key, derived from the data key admission
    made for this reservation and sent to this worker and the decode worker only). The
    plan is made before the first token is sampled: the streamed send's commit takes the
    token from `PagesReady.complete()`, so the plan's own `first_token` is never sent."""
    r = d.reservation
    return TransferPlan(reservation_id=r.reservation_id, epoch=r.epoch,
                        dest_page_ids=tuple(r.page_ids), num_tokens=len(d.prompt_ids),
                        page_tokens=r.page_tokens, page_bytes=r.page_bytes,
                        first_token=0, deadline_s=deadline_s,
                        key=transfer_key(bytes.fromhex(d.data_key), r.reservation_id,
                                         r.epoch))


def zero_tail(pool: KVPool, lease: Lease, num_tokens: int) -> None:
    """Zero the unwritten tail of a prompt's last page before any of it is sent, so that no
    byte of an earlier tenant's KV leaves this worker (the pool's default scrub policy does
    not clear freed pages). The prefill never writes there, so it can be done first."""
    n_pages = pages_for(num_tokens, pool.spec.page_tokens)
    tail = num_tokens - (n_pages - 1) * pool.spec.page_tokens
    if tail < pool.spec.page_tokens:  # the last page is this lease's own, never a cached one
        pool.page_tensor(lease, n_pages - 1)[:, :, tail:].zero_()  # guard: tail-zero


def outgoing_pages(pool: KVPool, lease: Lease, num_tokens: int) -> list[memoryview]:
    """The pages a prefill sends for a prompt of `num_tokens`, tail zeroed: read-only views
    (cached pages may be read, pinned, never written) held by the send from its start; the
    transport reads a page only after `release_pages` let it (the pool's read check)."""
    zero_tail(pool, lease, num_tokens)
    return [pool.streaming_view(lease, i)
            for i in range(pages_for(num_tokens, pool.spec.page_tokens))]


def release_pages(pool: KVPool, lease: Lease, pages: PagesReady, num_tokens: int,
                  first_token: int | None = None) -> None:
    """Let the send read the pages holding the first `num_tokens` tokens: whole pages, or
    every page with the first token when the prompt is done. The pool's read check (I2:
    this lease wrote every one of those tokens in this epoch) comes first."""
    pool.check_readable(lease, num_tokens)  # guard: stream-read-check
    if first_token is None:
        pages.advance(num_tokens // pool.spec.page_tokens)
    else:
        pages.complete(first_token)


def sampler_for(sampling: m.Sampling, max_tokens: int, eos_token_ids: Iterable[int],
                grammars: Grammars | None = None) -> Sampler:
    return Sampler.for_request(sampling, max_tokens, eos_token_ids, grammars)


log = logging.getLogger("pdmesh.prefill")

PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                 60, 120, 300)

class TimedPages(PagesReady):
    """The pages a streamed send waits for, timing how long the transport waited for the
    compute: the rest of the send's time is the transfer itself."""

    def __init__(self, total: int, ready: int = 0) -> None:
        super().__init__(total, ready)
        self.waited_s = 0.0

    async def wait(self, n: int) -> None:
        if n <= self.ready:
            return await super().wait(n)
        started = time.monotonic()
        try:
            await super().wait(n)
        finally:
            self.waited_s += time.monotonic() - started


@dataclass(eq=False)
class PrefillJob:
    dispatch: m.PrefillDispatch
    lifecycle: Lifecycle = field(init=False)
    received_at: float = field(default_factory=time.monotonic)
    lease: Lease | None = None
    windows: list[tuple[int, int]] = field(default_factory=list)  # chunks left to compute
    done_tokens: int = 0  # prompt tokens whose KV is computed (cached ones included)
    pages: TimedPages | None = None
    send_task: asyncio.Task[None] | None = None
    started_at: float = 0.0  # first chunk started
    computed_at: float = 0.0  # last chunk done
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # no chunk runs any more
    tier_lookup: bool = False  # its first turn looks the KV tiers up (tiers.py)
    tier_tokens: int = 0  # prompt tokens loaded from a KV tier (checked, then written)
    offered: asyncio.Future[int] | None = None  # blocks being copied to the tiers
    failure: tuple[m.Outcome, str] | None = None  # what to tell decode and the client
    span: Any = None  # its trace span (tracing.py; None: off)

    def __post_init__(self) -> None:
        self.lifecycle = Lifecycle(self.request_id, RequestState.ADMITTED)

    @property
    def request_id(self) -> str:
        return self.dispatch.ticket.request_id

    @property
    def tenant(self) -> str:
        return self.dispatch.ticket.tenant

    @property
    def prompt_len(self) -> int:
        return len(self.dispatch.prompt_ids)


class PrefillService(WorkerBase):
    role = m.Role.PREFILL

    def __init__(self, cfg: PrefillConfig, transport: KVTransport | None = None,
                 intake: DispatchIntake = faults.accept_dispatch) -> None:
        super().__init__(cfg, transport)
        self.trace = self.rt.trace  # the protocol trace (None: off)
        if self.trace is not None:
            ptrace.attach(self.trace, self.pool)
        self.intake = intake
        self.queue: PrefillQueue[PrefillJob] = PrefillQueue(cfg.prefill_max_active)
        self._work = asyncio.Event()
        self._compute_since = 0.0  # when the running chunk started (0: none running)
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
        model_name = self.model_name
        # What an autoscaler scales prefill on (compose/helm: KEDA): the prompt tokens this
        # worker has still to compute, waiting or under way.
        Gauge("pdmesh:prefill_queued_prompt_tokens", "Prompt tokens queued here and not "
              "computed yet (waiting prompts and the rest of those under way)",
              ["model_name", "worker"], registry=r).labels(
                  model_name, cfg.worker_id).set_function(self.queued_prompt_tokens)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"pdmesh:{name}", doc, ["model_name"], registry=r,
                             buckets=PHASE_BUCKETS).labels(model_name)

        self.queue_seconds = hist("prefill_queue_time_seconds",
                                  "Dispatch received to its first chunk started")
        self.compute_seconds = hist("prefill_compute_time_seconds",
                                    "First chunk started to last chunk computed")
        self.transfer_seconds = hist(
            "kv_transfer_time_seconds", "KV transfer per request: the send's time to decode's "
            "ack, less the time it waited for chunks to be computed")
        self.exposed_seconds = hist(
            "kv_transfer_exposed_time_seconds", "KV transfer left after the last chunk was "
            "computed (what the transfer adds to the time to first token)")
        self.prefix_cache = PrefixCache(self.pool, align_tokens=self.engine.prefix_align_tokens,
                                        on_evict=self.cache_evictions.inc)
        # The cache salts each tenant's tickets carried (`pdmesh cache purge --tenant`).
        self._tenant_salts: dict[str, set[str]] = {}
        self.tiers: PrefillTiers | None = make_tiers(
            cfg, self.pool, self.engine.prefix_align_tokens, self.fingerprint, r, self.trace)

    async def subscribe(self) -> None:
        wid = self.cfg.worker_id
        await self.rt.subscribe(m.dispatch_subject(wid), m.PrefillDispatch, self._on_dispatch,
                                concurrent=False)
        await self.rt.subscribe(m.ABORT_SUBJECT, m.Abort, self._on_abort, concurrent=False)
        await self.rt.subscribe(m.CACHE_PURGE_SUBJECT, m.CachePurge, self._on_purge)
        self.rt.spawn(self._loop(), "prefill-loop")
        self.rt.every(self.cfg.prefill_stall_s / 4, self._keepalive, "prefill-keepalive")

    async def _on_purge(self, req: m.CachePurge, msg: Msg) -> None:
        """Delete one salt's cached KV here: the pool's unpinned pages at once (pages a live
        lease pins go when it ends), then every tier; answer what was removed."""
        salts = ({req.cache_salt} if req.cache_salt else set()) | self._tenant_salts.get(
            req.tenant, set())
        removed: dict[str, int] = {"pool": 0}
        error = ""
        for salt in sorted(salts):
            removed["pool"] += self.prefix_cache.purge(salt)
            if self.tiers is None:
                continue
            try:
                for tier, n in (await self.tiers.purge(salt)).items():
                    removed[tier] = removed.get(tier, 0) + n
            except Exception as exc:  # say so: the operator reruns the purge
                log.exception("purging the KV tiers failed")
                error = f"purging the KV tiers failed: {exc}"
        log.info("cache purge: removed %s", removed)
        await self.rt.respond(msg, m.CachePurged(worker_id=self.cfg.worker_id,
                                                 removed=removed, error=error))

    async def _on_drain(self) -> None:
        await super()._on_drain()
        if self.tiers is not None:
            self.tiers.close()

    def queue_depth(self) -> int:
        """Prompts with compute ahead of a new one (waiting or taking turns): admission's
        prefill cost counts them."""
        return self.queue.depth + self.queue.active

    def active_requests(self) -> int:
        return len(self.queue)

    def queued_prompt_tokens(self) -> int:
        return sum(job.prompt_len - job.done_tokens for job in self.queue.jobs.values()
                   if not job.lifecycle.is_terminal)

    def prefix_summary(self, limit: int) -> list[int]:
        """The pool's cached prefixes first, then those host memory holds (tier 1): a
        request whose prefix sits in this worker's host memory is routed here too."""
        own = self.prefix_cache.summary(limit)
        if self.tiers is None or len(own) >= limit:
            return own
        seen = set(own)
        return own + [h for h in self.tiers.summary(limit) if h not in seen][:limit - len(own)]

    def counters(self) -> dict[str, float]:
        return {"dispatches": counter_total(self.dispatches),
                "bootstraps": counter_total(self.bootstraps),
                "transfers": counter_total(self.transfers),
                "prompt_tokens": counter_total(self.prompt_tokens),
                "prefix_cache_queries": counter_total(self.cache_queries),
                "prefix_cache_hit_tokens": counter_total(self.cache_hits),
                "prefix_cache_evictions": counter_total(self.cache_evictions),
                "prefix_cache_pages": float(self.prefix_cache.num_pages),
                **(self.tiers.counters() if self.tiers is not None else {})}

    # -- intake -------------------------------------------------------------------------
    async def _on_dispatch(self, d: m.PrefillDispatch, msg: Msg) -> None:
        dispatch = self.intake(d, msg.headers)
        if dispatch is None:
            return
        await self.accept(dispatch, msg.headers)

    async def accept(self, d: m.PrefillDispatch,
                     headers: Mapping[str, str] | None = None) -> None:
        """Verify and queue one dispatch, or give it up (decode and the client told).
        `headers`: the dispatch's, whose trace context the job's span continues."""
        rid = d.ticket.request_id
        self.seen_requests.append(rid)
        span = self.rt.tracing.span(
            "prefill.job", headers or {}, kind="consumer",
            **{"pdmesh.request_id": rid, "gen_ai.usage.input_tokens": len(d.prompt_ids),
               "pdmesh.decode_worker": d.ticket.decode_worker}) \
            if self.rt.tracing.enabled else None
        try:
            self.verifier.verify(d.ticket, prompt_len=len(d.prompt_ids))
            problem = self._recheck(d)
            if not problem:  # the grant binds prompt and reservation to the ticket
                tickets.verify_grant(self.cfg.verify_key, d)
        except TicketError as exc:
            self.ticket_refusals.labels(exc.reason.split(" ")[0]).inc()
            await self._give_up(d, m.Outcome(code=m.Code.TICKET_INVALID, detail=str(exc)),
                                "ticket_refused")
            end(span, error=str(exc))
            return
        if problem:
            await self._give_up(d, m.Outcome(code=m.Code.PREFILL_REJECTED, detail=problem),
                                "rejected")
            end(span, error=problem)
            return
        if self.queue.get(rid) is not None:
            log.warning("duplicate dispatch for %s ignored", rid)
            end(span, error="duplicate dispatch")
            return
        job = PrefillJob(d, span=span)
        self.queue.push(job)
        self.dispatches.labels("queued").inc()
        if self.trace is not None:
            self.trace.emit("job", req=rid, lease=d.reservation.reservation_id)
        await self._progress(job)  # decode and the gateway: it is held here
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
        try:
            streamauth.parse_key(d.stream_key)
            streamauth.parse_key(d.data_key)
        except ValueError as exc:
            return f"bad request keys: {exc}"
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
            await self._tell(d, m.release_subject(d.ticket.decode_worker), m.Release(
                request_id=rid, reservation_id=d.reservation.reservation_id,
                outcome=outcome))  # guard: release-on-reject
            await self._tell(d, m.tokens_subject(rid),
                             m.StreamFailed(request_id=rid, outcome=outcome))
        except (nats.errors.Error, OSError) as exc:
            log.error("telling decode and the client about %s failed: %s", rid, exc)

    async def _tell(self, d: m.PrefillDispatch, subject: str, msg: msgspec.Struct) -> None:
        """Publish about `d`'s request on its stream or to its decode worker, MACed under the
        request's stream key (streamauth.py). A dispatch without a valid key (refused by
        `_recheck`) can speak for nobody: nothing is sent."""
        try:
            key = streamauth.parse_key(d.stream_key)
        except ValueError:
            log.warning("no valid stream key for %s: %s not sent", d.ticket.request_id,
                        type(msg).__name__)
            return
        await self.rt.publish_authenticated(subject, msg, key)
        if self.trace is not None and isinstance(msg, m.Release):
            self.trace.emit("release_sent", req=msg.request_id, lease=msg.reservation_id)

    async def hand_off(self) -> int:
        """Drain timeout: end every prompt still here (as an abort would: its chunk stops,
        its send ends, its lease is freed when the engine lets go) and tell decode to free
        the reservation and the gateway to resume the request on another prefill worker."""
        outcome = self.drained_outcome()
        for job in list(self.queue.jobs.values()):
            if job.lifecycle.finish(outcome):
                if job.pages is not None:
                    job.pages.fail(RuntimeError("drained"))
                await self._give_up(job.dispatch, outcome, "drained")
        self._work.set()
        return 0

    async def _on_abort(self, ab: m.Abort, _msg: Msg) -> None:
        job = self.queue.get(ab.request_id)
        if job is not None and job.lifecycle.finish(ab.outcome):
            # Waiting: skipped. Computing: stops at its next chunk boundary. A send waiting
            # for pages ends now (decode heard the abort too and fences its lease).
            if job.pages is not None:
                job.pages.fail(RuntimeError("aborted"))
            self._work.set()

    # -- liveness -----------------------------------------------------------------------
    async def _progress(self, job: PrefillJob) -> None:
        """Tell decode (which holds the reservation) and the gateway (which waits for the
        first token) that this request is held here and moving. Best effort: a lost one is
        covered by the next."""
        d = job.dispatch
        msg = m.PrefillProgress(request_id=job.request_id,
                                reservation_id=d.reservation.reservation_id,
                                done_tokens=job.done_tokens, total_tokens=job.prompt_len)
        try:
            await self._tell(d, m.release_subject(d.ticket.decode_worker), msg)
            await self._tell(d, m.tokens_subject(job.request_id), msg)
        except (nats.errors.Error, OSError) as exc:
            log.warning("progress of %s not sent: %s", job.request_id, exc)

    def engine_stalled(self) -> bool:
        """A chunk has been running for longer than the stall limit: vouch for nothing."""
        since = self._compute_since
        return bool(since) and time.monotonic() - since > self.cfg.prefill_stall_s

    async def _keepalive(self) -> None:
        """Progress for every request held here (waiting, computing, or sending), unless
        the engine is stuck: then decode and the gateway give up on them in time."""
        if self.engine_stalled():
            log.warning("a prefill chunk has run for over %gs: no progress reported",
                        self.cfg.prefill_stall_s)
            return
        for job in list(self.queue.jobs.values()):
            if not job.lifecycle.is_terminal:
                await self._progress(job)

    # -- work ---------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._start_waiting()
            job = self.queue.turn()
            if job is None:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                await self._step(job)
            except Exception as exc:  # a bug must cost this request, not the worker
                log.exception("prefill of %s failed", job.request_id)
                self._fail_job(job, m.Code.INTERNAL, f"prefill failed: {exc}", "error")
                self._stop_compute(job)

    async def _start_waiting(self) -> None:
        """Start waiting jobs while fewer than `prefill_max_active` compute and the pool
        has their pages; a job that cannot get pages waits for a running one to free
        some, and fails at once when none runs (nothing would ever free them)."""
        while (job := self.queue.next_waiting()) is not None:
            if job.lifecycle.is_terminal:  # aborted while waiting: decode heard it too
                self.queue.pop()
                self._done(job)
                self.dispatches.labels("aborted").inc()
                continue
            d = job.dispatch
            try:
                # The prompt's own logprobs need every position computed: no cache hit.
                lease = (self.prefix_cache.allocate(job.request_id, d.ticket.cache_salt,
                                                    d.prompt_ids)
                         if d.sampling.prompt_logprobs is None
                         else self.pool.allocate(job.request_id, len(d.prompt_ids)))
            except PoolExhaustedError as exc:
                if self.queue.active or self._sending():
                    return  # a running or sending prefill frees pages: retried then
                self.queue.pop()
                self._done(job)
                failure = self._fail(job.lifecycle, m.Code.PREFILL_REJECTED, str(exc),
                                     "pool_full")
                if failure is not None:
                    await self._give_up(d, *failure)
                continue
            self.queue.start(job)
            try:
                self._begin(job, lease)
            except Exception as exc:  # a bug must cost this request, not the worker
                log.exception("starting the prefill of %s failed", job.request_id)
                self.pool.release(lease, "internal")
                self._done(job)
                failure = self._fail(job.lifecycle, m.Code.INTERNAL,
                                     f"prefill failed: {exc}", "error")
                if failure is not None:
                    await self._give_up(d, *failure)

    def _done(self, job: PrefillJob) -> None:
        """The job holds nothing here any more: out of the queue; its span ends."""
        self.queue.done(job)
        if job.span is not None:
            outcome = job.lifecycle.outcome
            end(job.span, error=outcome.detail if outcome is not None
                and outcome.code.kind is not m.Kind.FINISHED else "",
                **{"pdmesh.outcome": outcome.label if outcome is not None else None,
                   "pdmesh.cached_tokens": job.lease.cached_tokens + job.tier_tokens
                   if job.lease else None})
            job.span = None

    def _sending(self) -> bool:
        return any(j.send_task is not None and not j.send_task.done()
                   for j in self.queue.jobs.values())

    def _begin(self, job: PrefillJob, lease: Lease) -> None:
        """The job has its lease: start its transfer (pages stream as chunks finish)."""
        job.lease = lease
        cached = lease.cached_tokens
        if job.dispatch.ticket.cache_salt:
            self._tenant_salts.setdefault(job.tenant, set()).add(job.dispatch.ticket.cache_salt)
        self.cache_queries.inc()
        self.cache_hits.inc(cached)
        job.lifecycle.advance(RequestState.PREFILLING)
        self.bootstraps.inc()
        job.done_tokens = cached
        job.windows = prefill_windows(cached, job.prompt_len - cached)
        # The prompt's own logprobs need every position computed: no tier either.
        job.tier_lookup = (self.tiers is not None
                           and job.dispatch.sampling.prompt_logprobs is None)
        buffers = outgoing_pages(self.pool, lease, job.prompt_len)
        job.pages = TimedPages(len(buffers), cached // self.pool.spec.page_tokens)
        job.send_task = self.rt.spawn(self._transfer(job, buffers), f"send:{job.request_id}")

    async def _step(self, job: PrefillJob) -> None:
        """One chunk of the job; after the last, sample the first token and let the commit
        go."""
        life, lease = job.lifecycle, job.lease
        assert lease is not None and job.pages is not None
        if life.is_terminal or not job.windows:  # guard: abort-stops-prefill
            self._stop_compute(job)
            return
        d = job.dispatch
        if not job.started_at:
            job.started_at = time.monotonic()
            self.queue_seconds.observe(job.started_at - job.received_at)
            self.rt.tracing.record("prefill.queue", job.span, job.received_at, job.started_at)
        if job.tier_lookup:  # this turn loads what the tiers hold; the chunks follow
            await self._load_tiers(job)
            return
        start, length = job.windows.pop(0)
        piece = d.prompt_ids[start:start + length]
        self._compute_since = chunk_at = time.monotonic()
        scored = d.sampling.prompt_logprobs
        try:
            if scored is None:
                logits = await self.compute(self.engine.prefill, lease, piece, start)
            else:
                after = start + length
                logits, entries = await self.compute(
                    self.engine.prefill_scored, lease, piece, start, scored,
                    d.prompt_ids[after] if after < len(d.prompt_ids) else None)
        except Exception as exc:
            log.exception("prefill of %s failed", job.request_id)
            self._fail_job(job, m.Code.INTERNAL, f"prefill failed: {exc}", "error")
            self._stop_compute(job)
            return
        finally:
            self._compute_since = 0.0
        self.prompt_tokens.inc(length)
        job.done_tokens = start + length
        if scored is not None and entries:
            try:
                await self._tell(d, m.tokens_subject(job.request_id), m.PromptLogprobs(
                    request_id=job.request_id, start=start + 1, logprobs=entries))
            except (nats.errors.Error, OSError) as exc:  # the client's reply waits, then fails
                log.warning("prompt logprobs of %s not sent: %s", job.request_id, exc)
        self.rt.tracing.record("prefill.chunk", job.span, chunk_at, time.monotonic(),
                               **{"pdmesh.chunk.start": start, "pdmesh.chunk.tokens": length})
        if life.is_terminal:  # guard: abort-stops-prefill.after-chunk
            self._stop_compute(job)
            return
        if job.windows:
            release_pages(self.pool, lease, job.pages, job.done_tokens)
            await self._progress(job)
            return
        self.prefix_cache.insert(d.ticket.cache_salt, d.prompt_ids, lease)
        self._offer_tiers(job)
        sampler = sampler_for(d.sampling, d.ticket.max_tokens,
                              self.model.tokenizer.eos_token_ids, self.grammars)
        first = sampler.sample(logits)
        if d.sampling.logprobs is not None:  # flushed with the cache info below
            await self._tell(d, m.tokens_subject(job.request_id), m.FirstTokenLogprobs(
                request_id=job.request_id, token_id=first,
                logprobs=sampler.take_logprobs(first)))
        await self._report_cached(d, lease.cached_tokens + job.tier_tokens)
        # The prefill ends here (first token sampled, the gateway told): what the transfer
        # takes from now on is what it adds to the time to first token.
        job.computed_at = time.monotonic()
        self.compute_seconds.observe(job.computed_at - job.started_at)
        release_pages(self.pool, lease, job.pages, job.prompt_len, first)
        self._stop_compute(job)

    async def _load_tiers(self, job: PrefillJob) -> None:
        """The job's first turn: the blocks after the pool's match that the KV tiers hold
        and that pass their check are written into its pages; the chunks start after them.
        A tier that fails costs only the cache: the blocks are computed."""
        job.tier_lookup = False
        lease, d = job.lease, job.dispatch
        assert self.tiers is not None and lease is not None and job.pages is not None
        loaded_at = time.monotonic()
        try:
            loaded = await self.tiers.load(lease, d.ticket.cache_salt, d.prompt_ids,
                                           lease.cached_tokens)
        except Exception:  # a bug or a broken store must cost the cache, not the request
            log.exception("loading the KV tiers for %s failed; computing", job.request_id)
            return
        if not loaded:
            return
        job.tier_tokens = loaded
        job.done_tokens = lease.cached_tokens + loaded
        job.windows = prefill_windows(job.done_tokens, job.prompt_len - job.done_tokens)
        self.rt.tracing.record("prefill.tier_load", job.span, loaded_at, time.monotonic(),
                               **{"pdmesh.tier.tokens": loaded})
        if not job.lifecycle.is_terminal:
            release_pages(self.pool, lease, job.pages, job.done_tokens)

    def _offer_tiers(self, job: PrefillJob) -> None:
        """Hand the prompt's whole blocks to the KV tiers (copied while the lease pins
        them; `_offered` waits for the copy before the lease goes)."""
        if self.tiers is None or job.lease is None:
            return
        d = job.dispatch
        try:
            job.offered = self.tiers.offer(job.lease, d.ticket.cache_salt, d.prompt_ids)
        except Exception:  # the request does not depend on the tiers
            log.exception("offering %s to the KV tiers failed", job.request_id)

    async def _offered(self, job: PrefillJob) -> None:
        if job.offered is None:
            return
        try:
            await job.offered
        except Exception as exc:  # noqa: BLE001 - the tiers only lose these blocks
            log.warning("copying %s to the KV tiers failed: %s", job.request_id, exc)
        job.offered = None

    def _stop_compute(self, job: PrefillJob) -> None:
        """No chunk of this job runs any more: out of the turns; a send still waiting for
        pages is told (unless the last chunk completed them)."""
        self.queue.stop(job)
        if job.pages is not None and job.pages.ready < job.pages.total:
            job.pages.fail(RuntimeError("prefill stopped before its last chunk"))
        job.settled.set()

    def _fail_job(self, job: PrefillJob, code: m.Code, detail: str, label: str) -> None:
        job.failure = job.failure or self._fail(job.lifecycle, code, detail, label)

    async def _transfer(self, job: PrefillJob, buffers: list[memoryview]) -> None:
        """Send the job's pages as they are computed, then settle: free the lease once the
        compute is over too, then tell decode and the client how it ended."""
        d, life = job.dispatch, job.lifecycle
        assert job.pages is not None and job.lease is not None
        unreachable = ""  # why decode's data address could not be reached, if it could not
        plan = transfer_plan(d, self.cfg.transfer_deadline_s)
        sent_at = time.monotonic()
        try:
            ack = await self.transport.send(d.reservation.data_address, plan, buffers,
                                            ready=job.pages)
            acked_at = time.monotonic()
            if self.trace is not None:  # the commit went out (and decode acked it)
                self.trace.emit("commit_sent", req=job.request_id, lease=plan.reservation_id,
                                epoch=plan.epoch)
            self.kv_bytes.labels("out").inc(ack.bytes)
            self.transfers.labels("ok").inc()
            busy = max(acked_at - sent_at - job.pages.waited_s, 0.0)
            exposed = max(acked_at - job.computed_at, 0.0)
            self.transfer_seconds.observe(busy)
            self.exposed_seconds.observe(exposed)
            self.rt.tracing.record(
                "kv.transfer", job.span, sent_at, acked_at,
                **{"pdmesh.kv.bytes": ack.bytes, "pdmesh.kv.transport": self.cfg.transport,
                   "pdmesh.kv.pages": len(buffers), "pdmesh.kv.busy_s": busy,
                   "pdmesh.kv.exposed_s": exposed})
            if not life.is_terminal:  # an abort during the send already ended it
                life.advance(RequestState.TRANSFERRED)
                await self._publish_timing(job, busy, exposed)
        except TransferError as exc:
            self.transfers.labels(exc.reason.name.lower()).inc()
            self.rt.tracing.record("kv.transfer", job.span, sent_at, time.monotonic(),
                                   error=str(exc), **{"pdmesh.kv.transport": self.cfg.transport})
            if exc.reason is Reason.PEER_LOST:
                # Decode died or was cut off mid-transfer: the gateway resumes elsewhere.
                job.failure = job.failure or self._fail(
                    life, m.Code.WORKER_LOST, f"decode worker {d.ticket.decode_worker} lost "
                    f"mid-transfer: {exc}", "transfer_failed", worker=d.ticket.decode_worker)
            else:
                self._fail_job(job, m.Code.TRANSFER_FAILED, f"KV transfer failed: {exc}",
                               "transfer_failed")
            if exc.unreachable:  # cannot connect, or cannot take a transfer now
                unreachable = exc.detail
        except Exception as exc:
            log.exception("KV send of %s failed", job.request_id)
            self._fail_job(job, m.Code.INTERNAL, f"KV send failed: {exc}", "error")
        finally:
            # The engine may be writing the lease: wait for the chunk to end (the loop
            # stops the job at its next turn, the job being ended or its send over). Not
            # when the worker shuts down (this task cancelled): the loop is cancelled too
            # and would never say so; the pool goes with the process.
            self._work.set()
            task = asyncio.current_task()
            if task is None or not task.cancelling():
                await job.settled.wait()
                await self._offered(job)  # the tiers' copy reads the lease's pages
                # Release before telling: this worker's pages are back before anyone hears.
                self.pool.release(job.lease, life.outcome.label if life.outcome
                                  else life.state.name.lower())
                self._done(job)
                self._work.set()
                await self._beat_soon()
        if job.failure is not None:
            await self._give_up(d, *job.failure)
        if unreachable:
            await self._report_unreachable(d, unreachable)

    async def _beat_soon(self) -> None:
        """Admission hears the freed pages now, not at the next heartbeat (it charges a
        dispatched prompt to this worker until a heartbeat shows it)."""
        if not self.rt.nc.is_connected:
            return
        try:
            await self.heartbeat_soon()
        except (nats.errors.Error, OSError) as exc:  # the periodic heartbeat follows
            log.warning("early heartbeat not sent: %s", exc)

    async def _publish_timing(self, job: PrefillJob, transfer_s: float,
                              exposed_s: float) -> None:
        try:
            await self._tell(job.dispatch, m.tokens_subject(job.request_id), m.PhaseTiming(
                request_id=job.request_id, queue_s=job.started_at - job.received_at,
                prefill_s=job.computed_at - job.started_at, transfer_s=transfer_s,
                exposed_transfer_s=exposed_s))
        except (nats.errors.Error, OSError) as exc:
            log.warning("phase timing of %s not sent: %s", job.request_id, exc)

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
    def _fail(life: Lifecycle, code: m.Code, detail: str, label: str,
              worker: str = "") -> tuple[m.Outcome, str] | None:
        """End the request as failed; what to tell decode and the client (None when an
        abort had already ended it: they know)."""
        outcome = m.Outcome(code=code, detail=detail, worker=worker)
        return (outcome, label) if life.finish(outcome) else None

    async def _report_cached(self, d: m.PrefillDispatch, cached: int) -> None:
        """Info event for the gateway's usage.prompt_tokens_details.cached_tokens, flushed
        before the KV goes out so that it reaches the gateway before decode's first token
        (the gateway ignores info events after the stream ended)."""
        rid = d.ticket.request_id
        try:
            await self._tell(d, m.tokens_subject(rid), m.PrefixCacheInfo(
                request_id=rid, prompt_tokens=len(d.prompt_ids), cached_tokens=cached))
            await self.rt.nc.flush(timeout=1)
        except (nats.errors.Error, TimeoutError) as exc:  # only the usage figure is at stake
            log.warning("flushing the cache info event of %s failed: %s", rid, exc)


async def serve(cfg: PrefillConfig) -> None:
    transport, intake = faults.prefill_wiring(cfg)
    await run_worker(PrefillService(cfg, transport, intake))
