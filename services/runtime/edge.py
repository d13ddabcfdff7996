"""The HTTP edge of a service's ports: what aiohttp leaves unbounded, or says too much about.

Every listener `serve()` binds (a service's HTTP port; the gateway's metrics port too):

- **Parser errors** (a bad request line, a header over 8190 bytes, a chunked body that is
  not chunked) are answered with an OpenAI-shaped JSON error, code `bad_http_request`,
  status 400 (431 for header fields too large), whose text names the kind of error, never
  the bytes that caused it (aiohttp's own answer is text/plain quoting them, and its
  `aiohttp.server` log line quotes them with a traceback). They are counted
  (`pdmesh:http_bad_requests_total{status}`) and logged at DEBUG by exception class only.
- **Client disconnects** while a request is read or answered are counted
  (`pdmesh:http_client_disconnects_total`), not logged as errors (`middleware`).
- **Timeouts**: a connection must send a request's headers within `http_header_timeout_s`
  of its opening, or of the first byte of a later request, and the body within
  `http_body_timeout_s` of the headers; otherwise it is closed
  (`pdmesh:http_timeouts_total{phase}`). aiohttp closes an idle keep-alive connection after
  `http_keepalive_timeout_s`.
- **Connection caps**: at most `http_max_connections` open connections per listener and
  `http_max_connections_per_client` from one client address. A connection over a cap is
  answered at once (503, or 429 for the per-address cap, `too_many_connections`) and closed,
  so it holds its file descriptor for no longer than that
  (`pdmesh:http_connections_refused_total{reason}`). The listener's cap is lowered to fit
  the process's file-descriptor limit, a quarter of it kept for everything else (NATS, the
  KV data plane, files).
- **accept() failures** (EMFILE and its kind) reach the event loop's exception handler once
  per failed accept, with a traceback, and asyncio retries the accept many times a second:
  they are counted (`pdmesh:http_accept_errors_total`) and logged once per
  `LOG_INTERVAL_S` with their number (`install_accept_limiter`).
- Every response says `Server: pdmesh` (not aiohttp's and Python's versions).

Repeated events (refusals, timeouts, accept errors) log one line per `LOG_INTERVAL_S` with
their count, never one per event: a flood must not flood the log.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    InvalidHeader,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("pdmesh.http")
SERVER_NAME = "pdmesh"
LOG_INTERVAL_S = 10.0
METRICS_LISTENER_MAX_CONNECTIONS = 64  # a scraper needs one; not the API port's cap
ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_MESSAGE = "socket.accept() out of system resource"  # asyncio's words
TOO_MANY_HEADERS = "Too many headers received"  # aiohttp's words: no client bytes in them


@dataclass(frozen=True)
class EdgeLimits:
    """The limits of one listener (settings http_*: services/runtime/settings.py)."""

    max_connections: int
    max_connections_per_client: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float

    @classmethod
    def of(cls, cfg: Any) -> EdgeLimits:
        return cls(cfg.http_max_connections, cfg.http_max_connections_per_client,
                   cfg.http_header_timeout_s, cfg.http_body_timeout_s,
                   cfg.http_keepalive_timeout_s)


def fd_budget() -> int | None:
    """The connections a listener may hold within RLIMIT_NOFILE, a quarter of the limit
    (at least 32) kept for the rest of the process; None when there is no limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(1, soft - max(32, soft // 4))


class EdgeMetrics:
    """The edge's series, one set per process (both listeners count into it)."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.service = service
        self.bad_requests = Counter(
            "pdmesh:http_bad_requests_total", "Requests the HTTP parser refused (400 "
            "bad_http_request, 431 header fields too large)", ["service", "status"],
            registry=registry)
        self.disconnects = Counter(
            "pdmesh:http_client_disconnects_total", "Clients that went away while their "
            "request was read or answered", ["service"], registry=registry)
        self.timeouts = Counter(
            "pdmesh:http_timeouts_total", "Connections closed for sending a request's "
            "headers or body too slowly (phase: header, body)", ["service", "phase"],
            registry=registry)
        self.refused = Counter(
            "pdmesh:http_connections_refused_total", "Connections answered and closed at "
            "once over a cap (reason: max_connections, per_client)", ["service", "reason"],
            registry=registry)
        self.open = Gauge("pdmesh:http_connections", "Open HTTP connections by listener",
                          ["service", "listener"], registry=registry)
        self.accept_errors = Counter(
            "pdmesh:http_accept_errors_total", "accept() failures for want of file "
            "descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM)", ["service"],
            registry=registry)


class EveryInterval:
    """One log line per `interval_s` about an event that repeats, with how many happened
    since the previous line (the first occurrence is logged at once)."""

    def __init__(self, level: int, what: str, interval_s: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.level, self.what, self.interval_s, self._clock = level, what, interval_s, clock
        self._last = -float("inf")
        self._count = 0

    def event(self, detail: str = "") -> bool:
        """Count one event; log if the interval is over. Returns whether it logged."""
        self._count += 1
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        since = "" if self._last == -float("inf") else f" in the last {now - self._last:.0f}s"
        log.log(self.level, "%s%s (%d%s)", self.what, f": {detail}" if detail else "",
                self._count, since)
        self._last, self._count = now, 0
        return True


# -- answers ----------------------------------------------------------------------------------
def error_body(message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    """The OpenAI error shape (gateway/schema.py `ApiError` makes the same for the API)."""
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


def error_response(status: int, message: str, code: str,
                   type_: str = "invalid_request_error") -> web.Response:
    resp = web.Response(status=status, body=error_body(message, code, type_),
                        content_type="application/json", headers={"Server": SERVER_NAME})
    resp.force_close()  # after a parser error the connection's framing is lost
    return resp


def parser_error(exc: BaseException | None, header_line_done: bool) -> tuple[int, str]:
    """(status, message) for a parser error, from its class alone: aiohttp's messages
    quote the request's bytes (a body, an Authorization header)."""
    if isinstance(exc, LineTooLong):
        if header_line_done:
            return 431, "a request header field is larger than 8190 bytes"
        return 400, "the request line is longer than 8190 bytes"
    if isinstance(exc, BadHttpMessage) and exc.message == TOO_MANY_HEADERS:
        return 431, "too many request header fields"
    if isinstance(exc, BadStatusLine):
        return 400, "malformed HTTP request line"
    if isinstance(exc, InvalidHeader):
        return 400, "malformed HTTP header"
    if isinstance(exc, PayloadEncodingError):
        return 400, "malformed request body (its Transfer-Encoding or Content-Length)"
    if isinstance(exc, BadHttpMessage) and "chunk" in exc.message.split(":", 1)[0].lower():
        return 400, "malformed chunked request body"
    return 400, "malformed HTTP request"


def _refusal(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response for a connection refused before it sent anything."""
    body = error_body(message, "too_many_connections",
                      "rate_limit_error" if status == 429 else "server_error")
    reason = "Too Many Requests" if status == 429 else "Service Unavailable"
    return (f"HTTP/1.1 {status} {reason}\r\nServer: {SERVER_NAME}\r\n"
            "Content-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


REFUSED = {
    "max_connections": _refusal(503, "the server holds as many connections as it may; "
                                "retry later"),
    "per_client": _refusal(429, "too many open connections from your address"),
}


# -- connections ------------------------------------------------------------------------------
class ConnectionTable:
    """The open connections of one listener, in all and by client address."""

    def __init__(self, limits: EdgeLimits, metrics: EdgeMetrics, listener: str,
                 cap: int | None = None) -> None:
        budget = fd_budget()
        wanted = limits.max_connections if cap is None else min(cap, limits.max_connections)
        self.max_open = wanted if budget is None else min(wanted, budget)
        self.max_per_client = min(limits.max_connections_per_client, self.max_open)
        self.limits, self.metrics, self.listener = limits, metrics, listener
        self.open = 0
        self.by_client: dict[str, int] = {}
        self._gauge = metrics.open.labels(metrics.service, listener)
        self.refusals = EveryInterval(logging.WARNING, f"{metrics.service}: HTTP "
                                      f"({listener}) refused connections over its caps "
                                      f"({self.max_open} open, {self.max_per_client} per "
                                      "client address)")
        self.timeouts = EveryInterval(logging.INFO, f"{metrics.service}: HTTP ({listener}) "
                                      "closed connections that sent a request too slowly")

    def admit(self, client: str) -> str | None:
        """Take a place for a connection from `client`; the reason it may not have one."""
        reason = None
        if self.open >= self.max_open:
            reason = "max_connections"
        elif self.by_client.get(client, 0) >= self.max_per_client:  # guard: edge-client-cap
            reason = "per_client"
        if reason is not None:
            self.metrics.refused.labels(self.metrics.service, reason).inc()
            self.refusals.event(reason)
            return reason
        self.open += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self._gauge.set(self.open)
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        left = self.by_client.get(client, 1) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)
        self._gauge.set(self.open)


class EdgeProtocol(RequestHandler):
    """aiohttp's per-connection protocol with the edge's caps, timeouts and error answers."""

    def __init__(self, manager: web.Server, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.table = table
        self.client = ""
        self.admitted = False
        self.timed_out = ""  # the phase a timeout closed the connection in
        self._timer: asyncio.TimerHandle | None = None
        self._phase = ""
        self._body: StreamReader | None = None  # a request's body still arriving
        self._head_len = 0  # bytes of the current request's head seen so far
        self._line_len: int | None = None  # length of its request line, once it ended

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple | list) and peer else ""
        refused = self.table.admit(self.client)
        if refused is not None:
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(REFUSED[refused])
            transport.close()
            return
        self.admitted = True
        super().connection_made(transport)
        self._arm("header")  # guard: edge-header-timeout

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.admitted:
            return  # refused: aiohttp never saw it
        self.admitted = False
        self.table.release(self.client)
        self._disarm()
        super().connection_lost(exc)

    # -- timeouts -------------------------------------------------------------------------
    def _arm(self, phase: str) -> None:
        self._disarm()
        limits = self.table.limits
        delay = limits.header_timeout_s if phase == "header" else limits.body_timeout_s
        self._phase = phase
        self._timer = self._loop.call_later(delay, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, ""

    def _idle(self) -> bool:
        """Waiting for a request (none queued, none being handled)."""
        return self._waiter is not None and not self._waiter.done()

    def _expired(self) -> None:
        phase = self._phase
        self._timer, self._phase = None, ""
        if self.transport is None or self._force_close:
            return
        if phase == "header" and not self._idle():
            self._arm("header")  # a head pipelined behind a running request waits for it
            return
        if phase == "body" and (self._body is None or self._body.is_eof()):
            return
        self.timed_out = phase
        self.table.metrics.timeouts.labels(self.table.metrics.service, phase).inc()
        self.table.timeouts.event(phase)
        self.force_close()

    def data_received(self, data: bytes) -> None:
        body = self._body
        in_body = body is not None and not body.is_eof()
        if data and not in_body:
            if self._line_len is None and (nl := data.find(b"\n")) >= 0:
                self._line_len = self._head_len + nl
            self._head_len += len(data)
            if not self._phase:
                self._arm("header")  # the first bytes of a request
        queued = len(self._messages)
        super().data_received(data)
        added = [self._messages[i] for i in range(queued, len(self._messages))]
        if not added:
            if in_body and body is not None and body.is_eof():
                self._body = None
                self._disarm()
            return
        msg, payload = added[-1]
        if isinstance(msg, _ErrInfo):
            self._disarm()
            if in_body and body is not None:
                # The body of the request being handled will never end: fail its read
                # (the middleware answers 400) rather than leave it waiting.
                body.set_exception(RequestPayloadError("malformed request body"))
            return
        self._head_len, self._line_len = 0, None
        if payload.is_eof():
            self._body = None
            self._disarm()
        else:
            self._body = payload
            self._arm("body")

    # -- errors ---------------------------------------------------------------------------
    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's error answer, without the request's bytes in it or in any log line."""
        service = self.table.metrics.service
        if status == 500:  # a handler raised past every middleware: a bug of this service
            log.error("%s: unhandled %s on %s %s", service, type(exc).__name__,
                      request.method, request.path, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; the connection is dropped")
        if status == 500:
            return error_response(500, "internal error", "internal_error", "server_error")
        if status == 504:
            return error_response(504, "the request timed out", "deadline", "server_error")
        line_done = self._line_len is not None and self._line_len <= self.max_line_size
        status, text = parser_error(exc, line_done)  # guard: edge-parse-sanitize
        self.table.metrics.bad_requests.labels(service, str(status)).inc()
        log.debug("%s: bad HTTP request from %s: %s", service, request.remote,
                  type(exc).__name__)
        return error_response(status, text, "bad_http_request")


class EdgeServer(web.Server):
    """aiohttp's connection factory, making EdgeProtocols for one listener's table."""

    def __init__(self, handler: Any, *, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.table = table

    def __call__(self) -> RequestHandler:
        return EdgeProtocol(self, self.table, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An AppRunner whose server is an EdgeServer."""

    def __init__(self, app: web.Application, table: ConnectionTable, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.table = table

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        return EdgeServer(base.request_handler, table=self.table,
                          request_factory=base.request_factory,
                          handler_cancellation=base.handler_cancellation, loop=base._loop,
                          **base._kwargs)


# -- the app side -----------------------------------------------------------------------------
def middleware(metrics: EdgeMetrics) -> Any:
    """The innermost middleware: a client gone mid-request is counted, not an error; a body
    the parser could not read is a 400 `bad_http_request`."""

    @web.middleware
    async def edge(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConnectionResetError:
            transport = request.transport
            if transport is not None and not transport.is_closing():
                raise
            if not getattr(request.protocol, "timed_out", ""):  # counted as a timeout
                metrics.disconnects.labels(metrics.service).inc()
            return error_response(400, "the client went away", "client_disconnected")
        except (RequestPayloadError, BadHttpMessage) as exc:
            metrics.bad_requests.labels(metrics.service, "400").inc()
            log.debug("%s: bad request body from %s: %s", metrics.service, request.remote,
                      type(exc).__name__)
            # Ended, so aiohttp does not read on after the answer (the connection closes).
            request.content.feed_eof()
            return error_response(400, "malformed request body", "bad_http_request")

    return edge


async def _server_header(_request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


async def serve(app: web.Application, host: str, port: int, *, limits: EdgeLimits,
                metrics: EdgeMetrics, listener: str, cap: int | None = None
                ) -> tuple[EdgeRunner, int]:
    """Bind `app` on host:port behind the edge; (its runner, the port bound). OSError when
    the port cannot be bound."""
    app.middlewares.append(middleware(metrics))
    app.on_response_prepare.append(_server_header)
    table = ConnectionTable(limits, metrics, listener, cap)
    runner = EdgeRunner(app, table, access_log=None, handle_signals=False,
                        keepalive_timeout=limits.keepalive_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
    return runner, (sockets[0].getsockname()[1] if sockets else port)


def install_accept_limiter(metrics: EdgeMetrics) -> Callable[[], None]:
    """Take over asyncio's accept-error reports on the running loop (counted, one line per
    interval); returns what puts the previous handler back."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    limiter = EveryInterval(logging.WARNING, f"{metrics.service}: accept() failed; "
                            "connections wait in the listen backlog")

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") == ACCEPT_MESSAGE and isinstance(exc, OSError) \
                and exc.errno in ACCEPT_ERRNOS:
            metrics.accept_errors.labels(metrics.service).inc()
            limiter.event(os.strerror(exc.errno or 0))
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)

    return restore
