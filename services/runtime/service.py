"""The service runtime every pdmesh service runs on.

It owns: the NATS connection (reconnecting forever once connected), typed subscriptions
(one decoder per subscription, bad messages counted and logged, never fatal), the
service's HTTP port with `/health`, `/ready` and `/metrics` behind the HTTP edge (limits,
timeouts, quiet parser errors: edge.py), periodic heartbeats, every background task
(nothing fire-and-forget: tasks are kept in a set, cancelled and awaited on close), and an
idempotent graceful drain on SIGTERM/SIGINT or `POST /drain`.

Drain: the service stops taking new work at once (`on_drain_start` hooks: a draining
heartbeat, admission's submit subscription gone, the gateway answering 503), waits up to
`drain_timeout_s` for its in-flight requests (`track_inflight`) to finish, hands what is
left on (`on_handoff`: a worker tells the gateway to resume each request elsewhere, the
gateway ends its open streams), then runs the closing hooks (`on_drain`), flushes NATS and
closes. The process then exits 0.

A service whose config has a `metrics_port` (the gateway, whose HTTP port is the public
API) serves `/metrics` and the details of `/health` and `/ready` on that second port
only; its HTTP port answers `/health` and `/ready` with healthy-or-not and ready-or-not.

Lifecycle: STARTING -> READY -> DRAINING -> CLOSED.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import nats
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

import pdmesh.services.runtime.edge as edge
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.runtime.config import ServiceConfig
from pdmesh.services.runtime.ptrace import ProtocolTrace
from pdmesh.services.runtime.tracing import open_tracing

log = logging.getLogger("pdmesh.runtime")
DRAIN_TIMEOUT_S = 3.0  # flushing NATS on shutdown; a dead server must not hold us longer
DRAIN_POLL_S = 0.05  # how often a drain checks whether its in-flight requests are done
T = TypeVar("T")


async def settle(count: Callable[[], int], timeout_s: float) -> int:
    """Wait until `count()` is 0 or `timeout_s` passed; what is left. A drain's waits for
    in-flight work: polled, the counts being each service's own state."""
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout_s
    while (left := count()) and loop.time() < until:  # noqa: ASYNC110
        await asyncio.sleep(min(DRAIN_POLL_S, max(until - loop.time(), 0.0)))
    return left


class NatsRefused(Exception):
    """The NATS server refused this process's credentials while it connected."""


def is_auth_error(exc: BaseException) -> bool:
    """A NATS error that says the credentials were refused (nats-py reports the server's
    -ERR during the connect as a plain `nats.errors.Error`)."""
    return isinstance(exc, nats.errors.AuthorizationError) or (
        isinstance(exc, nats.errors.Error) and "authorization violation" in str(exc).lower())


def public_url(url: str) -> str:
    """`url` without its userinfo (user and password)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def counter_total(counter: Counter) -> float:
    """Sum of a Prometheus counter over all its label sets."""
    return sum(s.value for metric in counter.collect() for s in metric.samples
               if s.name.endswith("_total"))


class ServiceState(enum.IntEnum):
    STARTING = 0
    READY = 1
    DRAINING = 2
    CLOSED = 3


class ServiceRuntime:
    """Owns the connection, tasks, HTTP endpoints and lifecycle of one service process."""

    def __init__(self, cfg: ServiceConfig, registry: CollectorRegistry | None = None) -> None:
        self.cfg = cfg
        self.role = cfg.role
        self.worker_id = cfg.worker_id
        self.state = ServiceState.STARTING
        # The protocol trace (ptrace.py): None unless --protocol-trace-dir is set.
        trace_dir = getattr(cfg, "protocol_trace_dir", "")
        try:
            self.trace = ProtocolTrace.open(trace_dir, cfg.role)
        except OSError as exc:
            raise StartupError(cfg.role, f"protocol trace directory {trace_dir}",
                               exc.strerror or str(exc)) from None
        if self.trace is not None:
            self.trace.emit("start", role=cfg.role, worker=cfg.worker_id)
        # Request tracing (tracing.py): NOOP unless --otlp-traces-endpoint is set.
        self.tracing = open_tracing(getattr(cfg, "otlp_traces_endpoint", ""), cfg.role,
                                    cfg.worker_id)
        self.registry = registry or CollectorRegistry()
        self.nc: NATS = NATS()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._runners: list[web.AppRunner] = []
        self._restore_loop_handler: Callable[[], None] | None = None
        self._auth_refused: asyncio.Future[BaseException] | None = None
        self._connect_error: BaseException | None = None  # the last one while connecting
        self._closed = asyncio.Event()
        self._drain_lock = asyncio.Lock()
        self._drain_hooks: list[Callable[[], Awaitable[None]]] = []
        self._drain_start_hooks: list[Callable[[], Awaitable[None]]] = []
        self._handoff_hooks: list[Callable[[], Awaitable[int]]] = []
        self._inflight: list[Callable[[], int]] = []
        self._reconnect_hooks: list[Callable[[], None]] = []
        self.http_port = cfg.http_port
        self.edge_limits = edge.EdgeLimits.of(cfg)
        self.edge_metrics = edge.EdgeMetrics(self.registry, self.role)
        self.app = web.Application()  # the HTTP port (the gateway adds its API)
        # The gateway's HTTP port is public: metrics and details go to a port of their own.
        self.metrics_app: web.Application | None = None
        self.metrics_port = getattr(cfg, "metrics_port", None)
        if self.metrics_port is not None:  # guard: metrics-off-api
            self.metrics_app = web.Application()
            self.app.router.add_get("/health", self._health_public)
            self.app.router.add_get("/ready", self._ready_public)
        details = self.metrics_app or self.app
        details.router.add_get("/health", self._health)
        details.router.add_get("/ready", self._ready)
        details.router.add_get("/metrics", self._metrics)
        details.router.add_post("/drain", self._drain_requested)
        self.bad_messages = Counter(
            "pdmesh:bad_messages_total", "Control messages that failed to decode",
            ["service", "subject"], registry=self.registry)
        self.refused_messages = Counter(
            "pdmesh:refused_messages_total", "Well-formed control messages dropped because "
            "their sender may not send them (kind: heartbeat_subject, stream_mac, peer_mac, "
            "stale_progress, over_max_tokens, past_stop, first_token_mismatch)",
            ["service", "kind"], registry=self.registry)
        self.handler_errors = Counter(
            "pdmesh:handler_errors_total", "Handlers that raised unexpectedly",
            ["service", "subject"], registry=self.registry)
        self.state_gauge = Gauge("pdmesh:service_state", "0 starting, 1 ready, 2 draining, "
                                 "3 closed", ["service"], registry=self.registry)
        self.nats_connected = Gauge("pdmesh:nats_connected", "1 while connected to NATS",
                                    ["service"], registry=self.registry)
        self.drain_seconds = Gauge(
            "pdmesh:drain_duration_seconds", "How long the drain under way has run, from its "
            "start to its in-flight requests settling (set when they settle)", ["service"],
            registry=self.registry)
        self.drain_left = Counter(
            "pdmesh:drain_handed_off_total", "Requests still in flight at the drain timeout, "
            "handed on (a worker's to be resumed elsewhere)", ["service"],
            registry=self.registry)
        self.drain_cut = Counter(
            "pdmesh:drain_cut_requests_total", "Requests a drain ended with an error instead "
            "of finishing or handing them on (the gateway's streams open at the timeout)",
            ["service"], registry=self.registry)
        self._set_state(ServiceState.STARTING)

    # -- lifecycle ------------------------------------------------------------------------
    def _set_state(self, state: ServiceState) -> None:
        self.state = state
        self.state_gauge.labels(self.role).set(int(state))

    async def start_http(self, extra: Callable[[web.Application], None] | None = None) -> None:
        """Bind the service's HTTP port (and the metrics port, where the service has one)
        behind the HTTP edge; `extra` may add routes (the gateway adds its API)."""
        if extra is not None:
            extra(self.app)
        if self._restore_loop_handler is None:
            self._restore_loop_handler = edge.install_accept_limiter(self.edge_metrics)
        self.http_port = await self._listen(self.app, "http", self.cfg.http_host,
                                            self.cfg.http_port)
        if self.metrics_app is not None:
            host = self.cfg.metrics_host  # type: ignore[attr-defined]
            self.metrics_port = await self._listen(
                self.metrics_app, "metrics", host, self.cfg.metrics_port,  # type: ignore[attr-defined]
                cap=edge.METRICS_LISTENER_MAX_CONNECTIONS)

    async def _listen(self, app: web.Application, listener: str, host: str, port: int,
                      cap: int | None = None) -> int:
        try:
            runner, bound = await edge.serve(app, host, port, limits=self.edge_limits,
                                             metrics=self.edge_metrics, listener=listener,
                                             cap=cap)
        except OSError as exc:
            what = "HTTP port" if listener == "http" else "metrics port"
            raise StartupError(self.role, f"{what} {host}:{port}",
                               exc.strerror or str(exc)) from None
        self._runners.append(runner)
        return bound

    async def connect(self) -> None:
        """Connect to NATS, retrying until nats_connect_timeout_s, then reconnect forever.
        Credentials the server refuses end the start at once, saying so."""
        tls: ssl.SSLContext | None = None
        if self.cfg.nats_tls_ca:  # multi-host NATS: verify the servers against this CA
            try:
                tls = ssl.create_default_context(cafile=self.cfg.nats_tls_ca)
            except (OSError, ssl.SSLError) as exc:
                raise StartupError(self.role, f"NATS CA {self.cfg.nats_tls_ca}", str(exc)) \
                    from exc
        where = f"NATS at {', '.join(public_url(u) for u in self.cfg.nats_servers)}"
        deadline = time.monotonic() + self.cfg.nats_connect_timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                await self._connect_once(tls, max(deadline - time.monotonic(), 0.1))
                self.nats_connected.labels(self.role).set(1)
                return
            except asyncio.CancelledError:
                raise
            except NatsRefused as exc:
                with contextlib.suppress(Exception):
                    await self.nc.close()
                user = self.cfg.nats_user
                why = (f"the server refused the credentials of NATS user {user!r}" if user
                       else "the server requires credentials and none were given")
                raise StartupError(self.role, where, f"authorization failed: {why} ({exc}); "
                                   "check PDMESH_NATS_USER and PDMESH_NATS_PASSWORD") from None
            except Exception as exc:  # noqa: BLE001 - any failure to connect is retried
                last = self._connect_error or exc
                with contextlib.suppress(Exception):
                    await self.nc.close()
                self.nc = NATS()
                await asyncio.sleep(0.25)
        raise StartupError(self.role, where,
                           f"unreachable for {self.cfg.nats_connect_timeout_s:g}s "
                           f"({type(last).__name__ if last else 'timeout'})")

    async def _connect_once(self, tls: ssl.SSLContext | None, timeout_s: float) -> None:
        """One nats-py connect, within `timeout_s` (TimeoutError). nats-py retries an
        unreachable server, and one that refuses the credentials, forever with unlimited
        reconnects, reporting each failure to the error callback only: a refusal seen
        there ends the attempt as NatsRefused."""
        refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self._auth_refused, self._connect_error = refused, None
        attempt = asyncio.ensure_future(self.nc.connect(
            servers=self.cfg.nats_servers, name=f"{self.role}:{self.worker_id}",
            user=self.cfg.nats_user or None, password=self.cfg.nats_password or None,
            inbox_prefix=m.inbox_prefix(self.cfg.nats_user),
            # With a CA: TLS before anything else, so a server (or a man in the
            # middle) that does not offer TLS never sees the password in clear.
            tls=tls, tls_handshake_first=tls is not None,  # guard: tls-first
            # In the order given: a host's own NATS node first (multi-host), the
            # others only to fail over to.
            dont_randomize=True,
            connect_timeout=1, allow_reconnect=True, max_reconnect_attempts=-1,
            reconnect_time_wait=0.25, ping_interval=5, max_outstanding_pings=2,
            drain_timeout=DRAIN_TIMEOUT_S,
            error_cb=self._on_nats_error, disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect))
        try:
            done, _ = await asyncio.wait({attempt, refused}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._auth_refused = None
            if not attempt.done():
                attempt.cancel()
                await asyncio.gather(attempt, return_exceptions=True)
        if attempt in done:
            attempt.result()
            return
        if refused.done():
            raise NatsRefused(str(refused.result()))
        raise TimeoutError(f"NATS connect took over {timeout_s:g}s")

    async def _on_nats_error(self, exc: Exception) -> None:
        refused = self._auth_refused
        if refused is not None:  # connecting
            self._connect_error = exc
            if is_auth_error(exc) and not refused.done():
                refused.set_result(exc)
        log.debug("%s: nats error: %r", self.role, exc)

    async def _on_disconnect(self) -> None:
        self.nats_connected.labels(self.role).set(0)
        if self.state is ServiceState.READY:
            log.warning("%s: disconnected from NATS; reconnecting", self.role)

    async def _on_reconnect(self) -> None:
        self.nats_connected.labels(self.role).set(1)
        log.warning("%s: reconnected to NATS", self.role)
        for hook in list(self._reconnect_hooks):
            try:
                hook()
            except Exception:
                log.exception("%s: reconnect hook failed", self.role)

    def on_reconnect(self, hook: Callable[[], None]) -> None:
        """Run `hook` (synchronous, quick) after every NATS reconnect."""
        self._reconnect_hooks.append(hook)

    def mark_ready(self) -> None:
        self._set_state(ServiceState.READY)
        if self.metrics_app is not None:
            log.info("%s %s ready (http :%d, metrics %s:%d)", self.role, self.worker_id,
                     self.http_port, self.cfg.metrics_host,  # type: ignore[attr-defined]
                     self.metrics_port)
        else:
            log.info("%s %s ready (http :%d)", self.role, self.worker_id, self.http_port)

    @property
    def is_ready(self) -> bool:
        return self.state is ServiceState.READY and self.nc.is_connected

    # -- tasks ----------------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start an owned task: kept until done, cancelled and awaited on close."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s: task %s failed: %r", self.role, task.get_name(), task.exception(),
                      exc_info=task.exception())

    def every(self, interval_s: float, fn: Callable[[], Awaitable[None]], name: str) -> None:
        """Run `fn` every `interval_s` seconds in an owned task; an exception is logged."""

        async def loop() -> None:
            while True:
                try:
                    await fn()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s: periodic %s failed", self.role, name)
                await asyncio.sleep(interval_s)

        self.spawn(loop(), name)

    # -- messaging ------------------------------------------------------------------------
    async def subscribe(self, subject: str, typ: type[T],
                        handler: Callable[[T, Msg], Awaitable[None]], *, queue: str = "",
                        concurrent: bool = True) -> Any:
        """Subscribe with one typed decoder. Bad input is counted and logged, never fatal.
        Returns the subscription (closed with the connection; a service may drain it
        earlier).

        `concurrent`: each message is handled in its own owned task (handlers may await).
        """
        decoder = m.Decoder(typ)

        async def on_msg(msg: Msg) -> None:
            try:
                obj = decoder.decode(msg.subject, msg.data)
            except m.MessageError as exc:
                self.bad_messages.labels(self.role, subject).inc()
                log.warning("%s: %s", self.role, exc)
                return
            if concurrent:
                self.spawn(self._guarded(handler, obj, msg, subject), f"handle:{msg.subject}")
            else:
                await self._guarded(handler, obj, msg, subject)

        sub = await self.nc.subscribe(subject, queue=queue, cb=on_msg)
        self._subs.append(sub)
        return sub

    async def subscribe_heartbeats(self, subject: str,
                                   handler: Callable[[m.Heartbeat, Msg], Awaitable[None]]
                                   ) -> None:
        """Heartbeats on `subject` (a wildcard of heartbeat subjects), each handled in order.
        The role and worker id are the subject's: NATS lets a worker publish only on its
        own heartbeat subject, so a body naming another worker or role is dropped and
        counted (`refused_messages{kind="heartbeat_subject"}`), never believed."""

        async def bound(beat: m.Heartbeat, msg: Msg) -> None:
            if msg.subject != m.heartbeat_subject(beat.role.value,  # guard: heartbeat-subject
                                                  beat.worker_id):
                self.refuse("heartbeat_subject", f"a heartbeat on {msg.subject} names "
                            f"{beat.role.value} {beat.worker_id}")
                return
            await handler(beat, msg)

        await self.subscribe(subject, m.Heartbeat, bound, concurrent=False)

    def refuse(self, kind: str, detail: str) -> None:
        """Count (and log at debug: a flood must not flood the log) a dropped message."""
        self.refused_messages.labels(self.role, kind).inc()
        log.debug("%s: dropped: %s", self.role, detail)

    async def publish_authenticated(self, subject: str, msg: msgspec.Struct,
                                    key: bytes) -> None:
        """Publish with the MAC of the request's stream key (streamauth.py). msgpack
        encoding is deterministic, so the bytes `publish` sends are the bytes MACed here."""
        await self.publish(subject, msg, headers=streamauth.sign(key, subject, m.encode(msg)))

    async def _guarded(self, handler: Callable[[Any, Msg], Awaitable[None]], obj: Any, msg: Msg,
                       subject: str) -> None:
        try:
            await handler(obj, msg)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.handler_errors.labels(self.role, subject).inc()
            log.exception("%s: handler for %s failed", self.role, msg.subject)

    async def serve_stats(self, provider: Callable[[], m.StatsReply],
                          roles: tuple[str, ...] = ()) -> None:
        """Answer `stats_subject(role, worker_id)` requests (tests and `pdmesh check`) for
        this service's role, or for each role it heartbeats as."""

        async def on_msg(msg: Msg) -> None:
            await self.respond(msg, provider())

        for role in roles or (self.role,):
            self._subs.append(await self.nc.subscribe(m.stats_subject(role, self.worker_id),
                                                      cb=on_msg))

    async def publish(self, subject: str, msg: msgspec.Struct,
                      headers: dict[str, str] | None = None) -> None:
        if self.trace is not None:
            self._trace_tell(msg)
        await self.nc.publish(subject, m.encode(msg), headers=headers)

    def _trace_tell(self, msg: msgspec.Struct) -> None:
        """Trace a stream's terminal event (`tell`) where it leaves the process, whichever
        path sends it, so the trace shows every tell and not only the intended one."""
        if isinstance(msg, m.StreamFailed):
            outcome: m.Outcome | None = msg.outcome
        elif isinstance(msg, m.TokenEvent):
            outcome = msg.finish
        else:
            return
        if outcome is not None and self.trace is not None:
            self.trace.emit("tell", req=msg.request_id, kind=outcome.kind.name.lower(),
                            code=outcome.label)

    async def request(self, subject: str, msg: msgspec.Struct, typ: Any,
                      timeout_s: float, headers: dict[str, str] | None = None) -> Any:
        """NATS request/reply with a typed answer (`typ` may be a tagged union); raises
        TimeoutError / MessageError."""
        try:
            reply = await self.nc.request(subject, m.encode(msg), timeout=timeout_s,
                                          headers=headers)
        except nats.errors.NoRespondersError:
            raise TimeoutError(f"no responders on {subject}") from None
        except nats.errors.TimeoutError:
            raise TimeoutError(f"no reply on {subject} within {timeout_s:g}s") from None
        return m.Decoder(typ).decode(subject, reply.data)

    async def respond(self, msg: Msg, reply: msgspec.Struct) -> None:
        if msg.reply:
            await msg.respond(m.encode(reply))

    # -- HTTP -----------------------------------------------------------------------------
    async def _health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": self.state.name.lower(), "role": self.role,
                                  "worker_id": self.worker_id})

    async def _ready(self, _req: web.Request) -> web.Response:
        ok = self.is_ready and self.extra_ready()
        return web.json_response({"ready": ok, "state": self.state.name.lower(),
                                  "nats_connected": self.nc.is_connected},
                                 status=200 if ok else 503)

    async def _health_public(self, _req: web.Request) -> web.Response:
        """Healthy (serving or starting) or not, and nothing else: a public port's."""
        healthy = self.state < ServiceState.DRAINING
        return web.json_response({"status": "healthy" if healthy else "unhealthy"},
                                 status=200 if healthy else 503)

    async def _ready_public(self, _req: web.Request) -> web.Response:
        ok = self.is_ready and self.extra_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    def extra_ready(self) -> bool:
        """Services may add readiness conditions (the gateway: workers registered)."""
        return True

    async def _metrics(self, _req: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- shutdown -------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: self.spawn(self.drain(f"signal {s.name}"),
                                                                  "drain"))

    async def _drain_requested(self, _req: web.Request) -> web.Response:
        """POST /drain (for orchestrators: a preStop hook): start the graceful drain."""
        if self.state < ServiceState.DRAINING:
            self.spawn(self.drain("POST /drain"), "drain")
        return web.json_response({"state": "draining", "drain_timeout_s":
                                  self.cfg.drain_timeout_s}, status=202)

    def track_inflight(self, count: Callable[[], int]) -> None:
        """`count()` says how many requests this service holds now; a drain waits for the
        sum of all of them to reach 0 (or the drain timeout)."""
        self._inflight.append(count)

    def inflight(self) -> int:
        return sum(count() for count in self._inflight)

    def on_drain_start(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Register what stops new work at the start of a drain (before the wait)."""
        self._drain_start_hooks.append(hook)

    def on_handoff(self, hook: Callable[[], Awaitable[int]]) -> None:
        """Register what hands on the requests still in flight at the drain timeout; it
        returns how many it ended with an error rather than handed on (cut)."""
        self._handoff_hooks.append(hook)

    async def drain(self, why: str = "requested") -> None:
        """Idempotent: stop taking work, let in-flight requests finish (up to the drain
        timeout), hand on the rest, flush NATS, cancel and await every task, close HTTP."""
        async with self._drain_lock:
            if self.state >= ServiceState.DRAINING:
                return
            held = self.inflight()
            log.info("%s %s draining (%s): %d in flight, up to %gs", self.role,
                     self.worker_id, why, held, self.cfg.drain_timeout_s)
            self._set_state(ServiceState.DRAINING)
        started = time.monotonic()
        for hook in list(self._drain_start_hooks):
            try:
                await hook()
            except Exception:  # a failed hook must not stop the drain
                log.exception("%s: drain hook failed", self.role)
        left = await settle(self.inflight, self.cfg.drain_timeout_s) if self._inflight else 0
        cut = 0
        if left:
            self.drain_left.labels(self.role).inc(left)
            for handoff in list(self._handoff_hooks):
                try:
                    cut += await handoff()
                except Exception:  # what it could not hand on is cut
                    log.exception("%s: drain hand-off failed", self.role)
            if cut:
                self.drain_cut.labels(self.role).inc(cut)
        took = time.monotonic() - started
        self.drain_seconds.labels(self.role).set(took)
        log.info("%s %s drained in %.2fs: %d in flight at its start, %d handed on, %d cut",
                 self.role, self.worker_id, took, held, left - cut, cut)
        for hook in list(self._drain_hooks):
            with contextlib.suppress(Exception):
                await hook()
        if self.nc.is_connected:
            # nats-py bounds the drain itself (drain_timeout); cancelling it from outside
            # leaves an unretrieved gather behind.
            with contextlib.suppress(Exception):
                await self.nc.drain()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.nc.close()
        for runner in self._runners:  # the HTTP port first, the metrics port last
            await runner.cleanup()
        if self._restore_loop_handler is not None:
            self._restore_loop_handler()
        if self.tracing.enabled:  # the last spans, exported off the loop (bounded)
            await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)
        self._set_state(ServiceState.CLOSED)
        if self.trace is not None:  # the last line of a clean stop
            self.trace.emit("stop", role=self.role, why=why)
            self.trace.close()
        self._closed.set()

    def on_drain(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Register work to run first on drain (send a final heartbeat, close transports)."""
        self._drain_hooks.append(hook)

    async def wait_closed(self) -> None:
        await self._closed.wait()


async def run_service(rt: ServiceRuntime, start: Callable[[], Awaitable[None]]) -> None:
    """Run one service process: drain on SIGTERM/SIGINT, clean up if start fails."""
    rt.install_signal_handlers()
    try:
        await start()
    except BaseException:
        await rt.drain("start failed")
        raise
    await rt.wait_closed()
