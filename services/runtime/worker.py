"""What prefill and decode workers share: model, KV pool, transport, capacity audit, heartbeat.

The capacity audit (invariant I5, `services.protocol.capacity.audit_capacity`) runs once at start on
the real pool: a configured context larger than the pool either stops the worker
(`--on-capacity-mismatch fail`) or is clamped loudly (log at ERROR, `pdmesh:capacity_mismatch`
= 1, `capacity_mismatch` in every heartbeat). Heartbeats carry live pool figures only.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdmesh.kvstore import KVPool, ScrubPolicy
from pdmesh.services.engine.fingerprint import engine_fingerprint
from pdmesh.services.engine.grammar import Grammars
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.runner import Engine, make_pool
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.capacity import audit_capacity
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.protocol.tickets import TicketVerifier
from pdmesh.services.runtime.config import WorkerConfig
from pdmesh.services.runtime.service import (
    ServiceRuntime,
    ServiceState,
    counter_total,
    run_service,
)
from pdmesh.transports import KVTransport, make_service_transport, stop_ucx_notifier

log = logging.getLogger("pdmesh.worker")
T = TypeVar("T")
# The least time between two heartbeats sent out of turn (`heartbeat_soon`): a burst of
# releases costs at most this many a second, 1 / EARLY_HEARTBEAT_S.
EARLY_HEARTBEAT_S = 0.02


def _on_threads(threads: int, fn: Callable[..., T], *args: Any) -> T:
    """On the engine thread: set its torch thread count when `threads` asks for another."""
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return fn(*args)


class DataPlaneCollector:
    """The data plane's own counters (`transport.stats`), read at each scrape of /metrics:
    what the receiver refused and why (a forged or corrupted frame is counted here, not
    only in a log line), the inbound links it ended to stay within its limits, and, for
    nixl, the staging regions held for senders that never released them. Series in the
    README's metrics section."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport

    def collect(self):
        ts = self.transport.stats
        rejected = CounterMetricFamily(
            "pdmesh:data_plane_frames_rejected_total",
            "Data-plane frames the receiver refused, by reason (none of their bytes was "
            "kept)", labels=["reason"])
        for reason, n in sorted(ts.frames_rejected.items(), key=lambda kv: kv[0].name):
            rejected.add_metric([reason.name.lower()], n)
        yield rejected
        for name, doc, value in (
                ("bytes_drained", "Payload bytes of refused frames read and discarded",
                 ts.bytes_drained),
                ("links_refused", "Unbound inbound links ended to stay within the cap",
                 ts.links_refused),
                ("links_timed_out", "Unbound inbound links closed: no header in time",
                 ts.links_timed_out),
                ("accept_errors", "Listener accept() failures (retried with back-off)",
                 ts.accept_errors)):
            yield CounterMetricFamily(f"pdmesh:data_plane_{name}_total", doc, value=value)
        retired = getattr(self.transport, "staging_retired", None)
        if retired is not None:
            yield GaugeMetricFamily(
                "pdmesh:data_plane_staging_retired",
                "nixl staging regions whose sender never said its writes ended: held until "
                "released or retired_s passed", value=retired)


def make_worker_transport(cfg: WorkerConfig) -> KVTransport:
    return make_service_transport(cfg.transport, host=cfg.data_host, port=cfg.data_port,
                                  progress_timeout_s=cfg.transfer_progress_s,
                                  ucx_error_mode=cfg.ucx_error_mode)


class WorkerBase:
    """Prefill and decode services extend this; it owns engine, pool and transport."""

    role: m.Role
    # Roles announced in heartbeats; a colocated worker announces prefill and decode.
    advertised_roles: tuple[m.Role, ...] = ()

    def __init__(self, cfg: WorkerConfig, transport: KVTransport | None = None) -> None:
        self.cfg = cfg
        decode_threads = getattr(cfg, "decode_torch_threads", 0)
        # The engine's threads for prefill work and for decode steps (a colocated worker
        # runs both: `compute(..., threads=)` switches between them on the engine thread).
        self.prefill_threads = cfg.torch_threads or torch.get_num_threads()
        self.decode_threads = decode_threads or self.prefill_threads
        threads = decode_threads or cfg.torch_threads
        if threads:
            # Workers sharing a host should split its cores: oversubscribed torch threads
            # spin against each other (thread count does not change the results).
            torch.set_num_threads(threads)
        self.rt = ServiceRuntime(cfg)
        self.model = load_model(cfg.model)
        self.pool: KVPool = make_pool(self.model, num_pages=cfg.kv_pages,
                                      page_tokens=cfg.page_tokens,
                                      scrub=ScrubPolicy[cfg.scrub.upper()])
        self.engine = Engine(self.model, self.pool)
        # Structured outputs: the grammar engine's view of the vocabulary, built on the
        # first constrained request (prefill and decode mask alike: sampling.py).
        self.grammars = Grammars(self.model.tokenizer, self.model.config.vocab_size)
        # What decides this worker's bits: admission pairs only equal ones (rolling upgrades).
        self.fingerprint = engine_fingerprint(self.model, self.engine, spec=cfg.model)
        model_context = self.model.config.max_context
        if cfg.max_context > model_context:
            # The engine cannot attend past its positions (RoPE table): advertising more
            # would admit prompts it then fails (a 502 after admission, not a 400).
            raise ValueError(f"--max-context {cfg.max_context} exceeds the {model_context} "
                             f"positions model {cfg.model!r} supports; lower it")
        # Unset, the context is what both the model and the pool hold: the pool's default
        # size then never makes a mismatch of its own (only a --max-context over the pool
        # is one, caught below).
        self.configured_context = cfg.max_context or min(model_context,
                                                         self.pool.capacity_tokens)
        if not cfg.max_context and self.pool.capacity_tokens < model_context:
            log.info("%s %s: serving a context of %d tokens, the KV pool's (model %s "
                     "supports %d; --kv-tokens and --max-context raise it)", cfg.role,
                     cfg.worker_id, self.configured_context, self.model.name, model_context)
        self.served_context, self.mismatch = audit_capacity(
            self.configured_context, self.pool.capacity_tokens, cfg.on_capacity_mismatch,
            cfg.role)
        # Injected by tests and by the fault wiring of a test mesh (services/faults.py).
        self.transport: KVTransport = transport or make_worker_transport(cfg)
        self.data_address = ""
        self.verifier = TicketVerifier(cfg.verify_key, cfg.worker_id, self.role)
        # One thread runs the engine so torch work never blocks the event loop and engine
        # calls never overlap (the pool is mutated only on the event loop thread).
        self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.seen_requests: collections.deque[str] = collections.deque(maxlen=2048)
        self._last_heartbeat = 0.0  # time.monotonic() of the last one sent
        self._early_heartbeat: asyncio.Task[None] | None = None  # one due (heartbeat_soon)
        r = self.rt.registry
        Gauge("pdmesh:capacity_mismatch", "1 when configured context > real pool capacity",
              registry=r).set(1 if self.mismatch else 0)
        self.pool_pages = Gauge("pdmesh:kv_pool_pages", "KV pool pages by state", ["state"],
                                registry=r)
        self.ticket_refusals = Counter("pdmesh:tickets_refused_total", "Tickets refused",
                                       ["reason"], registry=r)
        self.kv_bytes = Counter("pdmesh:kv_transfer_bytes_total", "KV bytes moved",
                                ["direction"], registry=r)
        r.register(DataPlaneCollector(self.transport))
        # vLLM's meaning: the fraction of the KV pool in use (cached-but-evictable is free).
        self.model_name = (cfg.served_model_names[0] if cfg.served_model_names
                           else self.model.name)  # the `model_name` label, as vLLM's
        self.kv_usage = Gauge("pdmesh:kv_cache_usage_perc", "KV pool in use (0..1)",
                              ["model_name", "worker"], registry=r).labels(
                                  self.model_name, cfg.worker_id)

    async def start(self) -> None:
        rt = self.rt
        await rt.start_http()
        await rt.connect()
        try:
            self.data_address = await self._start_transport()
        except OSError as exc:
            raise StartupError(self.cfg.role, f"data plane {self.cfg.data_host}:"
                               f"{self.cfg.data_port}", exc.strerror or str(exc)) from None
        # Structured outputs' vocabulary view (0.2 s for SmolLM2), before any request: the
        # reserve and the last chunk compile grammars on the event loop.
        await asyncio.get_running_loop().run_in_executor(None, self.grammars.warm)
        await self.subscribe()
        await rt.serve_stats(self.stats, roles=tuple(
            r.value for r in self.advertised_roles or (self.role,)))
        rt.on_drain_start(self._on_drain_start)
        rt.track_inflight(self.active_requests)
        rt.on_handoff(self.hand_off)
        rt.on_drain(self._on_drain)
        rt.every(self.cfg.heartbeat_s, self.heartbeat, "heartbeat")
        rt.extra_ready = self.data_plane_ready  # type: ignore[method-assign]
        rt.mark_ready()
        await self.heartbeat()

    def data_plane_ready(self) -> bool:
        """Whether the data plane can accept (False while its listener cannot, e.g. out of
        file descriptors): /ready and the heartbeat's `ready` follow it, so admission stops
        routing here until it can again."""
        return bool(getattr(self.transport, "accepting", True))  # guard: ready-data-plane

    async def _start_transport(self) -> str:
        """Listen, then advertise the address peers can dial (never a wildcard)."""
        address = await self.transport.start()
        scheme, rest = address.split("://", 1)
        return f"{scheme}://{self.cfg.data_advertise_host}:{rest.rsplit(':', 1)[1]}"

    async def subscribe(self) -> None:
        """Subclasses subscribe to their subjects here."""
        raise NotImplementedError

    async def _on_drain_start(self) -> None:
        """Admission stops routing here at once (its requests in flight carry on)."""
        await self.heartbeat(draining=True)

    async def hand_off(self) -> int:
        """At the drain timeout: hand every request still here to the gateway to resume
        elsewhere (`Code.WORKER_DRAINED`); how many could not be (cut). Subclasses."""
        return 0

    def drained_outcome(self) -> m.Outcome:
        return m.Outcome(code=m.Code.WORKER_DRAINED, worker=self.cfg.worker_id, detail=(
            f"{self.role.value} worker {self.cfg.worker_id} drained with the request in "
            f"flight (--drain-timeout-s {self.cfg.drain_timeout_s:g})"))

    async def _on_drain(self) -> None:
        await self.heartbeat(draining=True)
        await self.transport.close()
        self._compute.shutdown(wait=False, cancel_futures=True)

    async def compute(self, fn: Callable[..., T], *args: Any, threads: int = 0) -> T:
        """fn(*args) on the engine thread; with `threads`, on that many torch threads
        (`prefill_threads` or `decode_threads`)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._compute, _on_threads, threads, fn, *args)

    def queue_depth(self) -> int:
        return 0

    def active_requests(self) -> int:
        return len(self.pool.live_leases())

    def tenant_tokens(self) -> dict[str, int]:
        """KV tokens held per tenant, for the decode heartbeat (prefill: none)."""
        return {}

    async def heartbeat_soon(self) -> None:
        """A heartbeat now, out of turn: capacity just freed (a released lease) that
        admission should count before anyone hears that the request ended, or a
        conversation's next turn waits up to a heartbeat interval in admission's queue.
        At most one per EARLY_HEARTBEAT_S; one due sooner goes out that much later."""
        wait = self._last_heartbeat + EARLY_HEARTBEAT_S - time.monotonic()
        if wait <= 0:
            await self.heartbeat()
        elif self._early_heartbeat is None or self._early_heartbeat.done():
            self._early_heartbeat = self.rt.spawn(self._heartbeat_after(wait),
                                                  "early-heartbeat")

    async def _heartbeat_after(self, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        await self.heartbeat()

    async def heartbeat(self, draining: bool = False) -> None:
        self._last_heartbeat = time.monotonic()
        draining = draining or self.rt.state >= ServiceState.DRAINING
        pool = self.pool
        self.pool_pages.labels("free").set(pool.num_free_pages)
        self.pool_pages.labels("leased").set(pool.num_leased_pages)
        self.pool_pages.labels("cached").set(pool.num_cached_pages)
        capacity = pool.capacity_tokens
        self.kv_usage.set(1 - pool.available_tokens / capacity if capacity else 0.0)
        if not self.rt.nc.is_connected:
            return
        cache = getattr(self, "prefix_cache", None)  # prefill workers only
        summary_limit = 512  # prefix hashes per heartbeat (~4.5 KiB of msgpack)
        for role in self.advertised_roles or (self.role,):
            await self.rt.publish(m.heartbeat_subject(role.value, self.cfg.worker_id),
                                  m.Heartbeat(
            worker_id=self.cfg.worker_id, role=role, model=self.model.name,
            data_address=self.data_address,
            http_address=f"http://{self.cfg.http_host}:{self.rt.http_port}",
            # Unpinned cached pages count as free: an allocation evicts them on demand.
            pool_capacity_tokens=pool.capacity_tokens, available_tokens=pool.available_tokens,
            page_tokens=pool.spec.page_tokens, configured_context=self.configured_context,
            served_context=self.served_context, capacity_mismatch=self.mismatch,
            queue_depth=self.queue_depth(), active_requests=self.active_requests(),
            ready=not draining and self.data_plane_ready(), draining=draining,
            sent_at=time.time(),
            prefix_hashes=self.prefix_summary(summary_limit),
            prefix_align_tokens=cache.align_tokens if cache else 0,
            prefix_cached_tokens=cache.num_pages * pool.spec.page_tokens if cache else 0,
            tenant_tokens=self.tenant_tokens() if role is m.Role.DECODE else {},
            fingerprint=self.fingerprint))

    def prefix_summary(self, limit: int) -> list[int]:
        """The cached prefixes the heartbeat advertises for routing (prefill workers: the
        prefix cache's, and those of its KV tiers)."""
        cache = getattr(self, "prefix_cache", None)
        return cache.summary(limit) if cache else []

    def counters(self) -> dict[str, float]:
        return {}

    def stats(self) -> m.StatsReply:
        integrity_error = ""
        try:
            self.pool.check_integrity()
        except Exception as exc:  # noqa: BLE001 - reported, not raised: this is a probe
            integrity_error = str(exc)
        counters = self.counters()
        counters["tickets_refused"] = counter_total(self.ticket_refusals)
        ts = self.transport.stats
        counters.update({"transport_transfers_committed": ts.transfers_committed,
                         "transport_transfers_failed": ts.transfers_failed,
                         "transport_bytes_drained": ts.bytes_drained})
        for reason, n in ts.frames_rejected.items():
            counters[f"frames_rejected_{reason.name.lower()}"] = n
        leases = self.pool.live_leases()
        return m.StatsReply(
            worker_id=self.cfg.worker_id, role=self.role, counters=counters,
            leased_pages=self.pool.num_leased_pages, free_pages=self.pool.num_free_pages,
            total_pages=self.pool.num_pages, live_leases=len(leases),
            integrity_ok=not integrity_error, integrity_error=integrity_error,
            request_ids=list(self.seen_requests),
            leased_requests=[lease.request_id for lease in leases], pid=os.getpid(),
            cached_pages=self.pool.num_cached_pages)


async def run_worker(worker: WorkerBase) -> None:
    try:
        await run_service(worker.rt, worker.start)
    finally:
        stop_ucx_notifier()  # its transport has closed (drained) by now
