"""Request tracing with OpenTelemetry: one trace per request across every process.

Off unless `--otlp-traces-endpoint` (`PDMESH_OTLP_TRACES_ENDPOINT`) names an OTLP/HTTP
receiver; then each service exports its spans there (a batch processor on its own thread),
named `pdmesh-<role>` with the worker id as `service.instance.id`. Off, a `Tracing` is
`NOOP`: every method returns at once and the OpenTelemetry SDK is never imported.

The context crosses processes as W3C `traceparent` (and `tracestate`) headers on the NATS
messages of the request path: the gateway's submit, admission's reserve and dispatch. A
client's own `traceparent` is continued by the gateway's HTTP span. The span tree of one
request (docs/DESIGN.md, "Request tracing"):

    POST /v1/chat/completions            gateway (parent: the client's traceparent, if any)
      admission.request                  admission: decide, then reserve and dispatch
        admission.queue                  waited for capacity (only when it waited)
        admission.reserve                one per choice: the decode reservation
          decode.request                 decode: reservation to the last event
            decode.kv_wait               reserved -> the prompt's KV committed
            decode.generate              first token -> last token (events: first_token)
        admission.dispatch               one per choice: the job sent to prefill
          prefill.job                    prefill: dispatch received -> transfer acked
            prefill.queue                received -> first chunk started
            prefill.chunk                one per chunk
            kv.transfer                  first page sent -> decode's ack (bytes, exposed)

Spans carry no prompt or output text: request ids, token counts, worker ids, outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("pdmesh.tracing")

# Propagation headers (W3C Trace Context): what a traced message carries.
TRACE_HEADERS = ("traceparent", "tracestate")
EXPORT_TIMEOUT_S = 5.0  # one OTLP export
SCHEDULE_DELAY_MS = 500  # the batch processor's export interval
SHUTDOWN_TIMEOUT_MS = 3000  # a stopping service waits this long for its last spans


def wall_ns(monotonic_t: float) -> int:
    """The wall-clock time (ns since the epoch, OTLP's clock) of a `time.monotonic()`."""
    return time.time_ns() - int((time.monotonic() - monotonic_t) * 1e9)


class Tracing:
    """A service's tracer. `enabled` is False for `NOOP` (no endpoint)."""

    enabled = False

    def span(self, name: str, parent: Any = None, **attrs: Any) -> Any:
        """Start a span (not made current); `parent`: a span, or headers to continue."""
        return None

    def record(self, name: str, parent: Any, start: float, end: float, error: str = "",
               **attrs: Any) -> None:
        """A finished child span of `parent` (None: none) from monotonic `start` to `end`;
        `error` marks it failed."""

    @contextlib.contextmanager
    def current(self, name: str, parent: Any = None, **attrs: Any) -> Iterator[Any]:
        """A span made current for the block (its children find it): ended at its end."""
        yield None

    def headers(self, span: Any = None,
                into: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """`into` plus the propagation headers of `span` (default: the current span)."""
        return dict(into) if into is not None else None

    def active(self) -> Any:
        """The current span (None: tracing off)."""
        return None

    def shutdown(self) -> None:
        """Export what is left (bounded) and stop."""


NOOP = Tracing()


def end(span: Any, error: str = "", **attrs: Any) -> None:
    """End `span` (None: tracing off) with `attrs`; `error` marks it failed."""
    if span is None:
        return
    if attrs:
        span.set_attributes({k: v for k, v in attrs.items() if v is not None})
    if error:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def event(span: Any, name: str, at: float | None = None, **attrs: Any) -> None:
    """An event on `span` (None: tracing off), at monotonic time `at` (default: now)."""
    if span is not None:
        span.add_event(name, {k: v for k, v in attrs.items() if v is not None},
                       timestamp=None if at is None else wall_ns(at))


class _OtelTracing(Tracing):
    enabled = True

    def __init__(self, endpoint: str, role: str, worker_id: str) -> None:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace, self._context = trace, context
        self._propagator = TraceContextTextMapPropagator()
        resource = Resource.create({"service.name": f"pdmesh-{role}",
                                    "service.namespace": "pdmesh",
                                    "service.instance.id": worker_id})
        # A provider of this service's own (not the global one): in-process test meshes
        # run several services, each naming itself.
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S),
            schedule_delay_millis=SCHEDULE_DELAY_MS,
            export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000)))
        self._tracer = self._provider.get_tracer("pdmesh")
        log.info("%s %s: tracing to %s", role, worker_id, endpoint)

    def _parent(self, parent: Any) -> Any:
        if parent is None:
            return None  # the current context
        if isinstance(parent, Mapping):  # headers: a malformed traceparent starts a root
            return self._propagator.extract(
                {k.lower(): v for k, v in parent.items() if k.lower() in TRACE_HEADERS})
        return self._trace.set_span_in_context(parent)

    def _kind(self, attrs: dict[str, Any]) -> Any:
        kind = attrs.pop("kind", None)
        return getattr(self._trace.SpanKind, kind.upper()) if kind else \
            self._trace.SpanKind.INTERNAL

    @staticmethod
    def _attrs(attrs: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in attrs.items() if v is not None}

    def span(self, name: str, parent: Any = None, **attrs: Any) -> Any:
        kind = self._kind(attrs)
        start = attrs.pop("start", None)
        return self._tracer.start_span(
            name, context=self._parent(parent), kind=kind, attributes=self._attrs(attrs),
            start_time=None if start is None else wall_ns(start))

    def record(self, name: str, parent: Any, start: float, end: float, error: str = "",
               **attrs: Any) -> None:
        if parent is None:
            return
        kind = self._kind(attrs)
        span = self._tracer.start_span(name, context=self._parent(parent), kind=kind,
                                       attributes=self._attrs(attrs),
                                       start_time=wall_ns(start))
        if error:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, error))
        span.end(end_time=wall_ns(end))

    @contextlib.contextmanager
    def current(self, name: str, parent: Any = None, **attrs: Any) -> Iterator[Any]:
        span = self.span(name, parent, **attrs)
        token = self._context.attach(self._trace.set_span_in_context(span))
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                end(span, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._context.detach(token)
            if span.is_recording():  # not ended inside the block
                span.end()

    def headers(self, span: Any = None,
                into: Mapping[str, str] | None = None) -> dict[str, str] | None:
        out = dict(into or {})
        ctx = self._trace.set_span_in_context(span) if span is not None else None
        self._propagator.inject(out, context=ctx)
        return out or None

    def active(self) -> Any:
        span = self._trace.get_current_span()
        return span if span.get_span_context().is_valid else None

    def shutdown(self) -> None:
        try:
            self._provider.force_flush(SHUTDOWN_TIMEOUT_MS)
            self._provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - a stopping service logs, never fails
            log.warning("tracing: the last spans were not exported: %s", exc)


def open_tracing(endpoint: str, role: str, worker_id: str) -> Tracing:
    """The service's tracer: `NOOP` without an endpoint."""
    return _OtelTracing(endpoint, role, worker_id) if endpoint else NOOP
