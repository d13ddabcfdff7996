"""Request tracing end to end: a real OTLP/HTTP receiver started here, a `pdmesh up` mesh
exporting to it, and one request's span tree across the client and every process.

The receiver decodes each export with the protocol's own messages (`opentelemetry-proto`),
so what is asserted is what a collector (Jaeger, Tempo) would store."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from pdmesh.services.runtime.tracing import open_tracing
from tests.support.meshproc import REPO, Mesh, mesh_env, run_mesh

pytestmark = [pytest.mark.slow]

SERVICES = ("pdmesh-gateway", "pdmesh-admission", "pdmesh-prefill", "pdmesh-decode")
CLIENT = "test-client"  # this process: its own span, exported to the same receiver


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    attrs: dict[str, object]
    events: list[str]
    error: bool
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span exported to it, decoded."""

    server: http.server.ThreadingHTTPServer
    spans: list[Span] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # exports that did not decode
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, trace_id: str, names: set[str], timeout_s: float = 20) -> list[Span]:
        """The trace's spans once every name in `names` is among them (batches come in)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            missing = names - {s.name for s in spans}
            if not missing:
                return spans
            assert time.monotonic() < deadline, (
                f"spans never exported: {sorted(missing)}; got "
                f"{sorted((s.service, s.name) for s in spans)}; bad exports: {self.bad}")
            time.sleep(0.1)


def _decode(body: bytes) -> list[Span]:
    export = ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in export.resource_spans:
        service = next((a.value.string_value for a in rs.resource.attributes
                        if a.key == "service.name"), "")
        for ss in rs.scope_spans:
            for sp in ss.spans:
                attrs: dict[str, object] = {}
                for a in sp.attributes:
                    v = a.value
                    attrs[a.key] = getattr(v, v.WhichOneof("value"))
                out.append(Span(service=service, name=sp.name, trace_id=sp.trace_id.hex(),
                                span_id=sp.span_id.hex(), parent=sp.parent_span_id.hex(),
                                attrs=attrs, events=[e.name for e in sp.events],
                                error=sp.status.code == 2, start_ns=sp.start_time_unix_nano,
                                end_ns=sp.end_time_unix_nano))
    return out


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    holder: list[Receiver] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            rec = holder[0]
            try:
                spans = _decode(body)
            except Exception as exc:  # noqa: BLE001 - recorded, asserted on
                with rec.lock:
                    rec.bad.append(f"{self.path} {self.headers.get('Content-Type')}: {exc}")
                self.send_response(400)
            else:
                ok = self.path == "/v1/traces" and self.headers.get(
                    "Content-Type") == "application/x-protobuf"
                with rec.lock:
                    if ok:
                        rec.spans.extend(spans)
                    else:
                        rec.bad.append(f"{self.path} {self.headers.get('Content-Type')}")
                self.send_response(200 if ok else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(server))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder[0]
    server.shutdown()


@pytest.fixture(scope="module")
def traced_mesh(receiver: Receiver) -> Iterator[Mesh]:
    with run_mesh("--otlp-traces-endpoint", receiver.endpoint) as mesh:
        yield mesh


def _post(mesh: Mesh, path: str, body: dict, headers: dict[str, str]
          ) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{mesh.gateway_port}{path}",
                                 data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", "Bearer sk-dev-alice")
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def _client_span(receiver: Receiver) -> Iterator[tuple[str, str, dict[str, str]]]:
    """A client span of this process's own, exported to the receiver: (trace id, span id,
    the headers that carry it)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    provider = TracerProvider(resource=Resource.create({"service.name": CLIENT}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(receiver.endpoint)))
    span = provider.get_tracer("test").start_span("client.request")
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, context=set_span_in_context(span))
    ctx = span.get_span_context()
    try:
        yield f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", headers
    finally:
        span.end()
        provider.shutdown()


def test_one_request_is_one_trace_across_every_process(traced_mesh: Mesh,
                                                       receiver: Receiver) -> None:
    """A streamed chat request sent inside a span of the client's (this process): the
    client's span, then the gateway's, admission's, prefill's and decode's, all under the
    client's trace id (five processes), each parent link the request's path."""
    prompt = "trace this request across the mesh " * 12
    spans_of = _client_span(receiver)
    client_trace, client_span, carrier = next(spans_of)
    status, headers, body = _post(traced_mesh, "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True,
        "messages": [{"role": "user", "content": prompt}]},
        {**carrier, "X-Request-Id": "client-42"})
    next(spans_of, None)  # the client's span ends and is exported
    assert status == 200, body
    assert headers.get("X-Request-Id") == "client-42"  # echoed
    assert b"data: [DONE]" in body

    names = {"client.request", "POST /v1/chat/completions", "admission.request",
             "admission.reserve",
             "admission.dispatch", "prefill.job", "prefill.queue", "prefill.chunk",
             "kv.transfer", "decode.request", "decode.kv_wait", "decode.generate"}
    spans = receiver.wait(client_trace, names)
    assert {s.service for s in spans} == {CLIENT, *SERVICES}
    client = _one(spans, "client.request")
    assert (client.service, client.span_id, client.parent) == (CLIENT, client_span, "")
    gw = _one(spans, "POST /v1/chat/completions")
    adm = _one(spans, "admission.request")
    reserve, dispatch = _one(spans, "admission.reserve"), _one(spans, "admission.dispatch")
    job, dec = _one(spans, "prefill.job"), _one(spans, "decode.request")
    by_id = {s.span_id: s for s in spans}
    # The request path, link by link (each span's service, and its parent).
    assert (gw.service, gw.parent) == ("pdmesh-gateway", client_span)  # the client's span
    assert (adm.service, adm.parent) == ("pdmesh-admission", gw.span_id)
    assert reserve.parent == adm.span_id and dispatch.parent == adm.span_id
    assert (dec.service, dec.parent) == ("pdmesh-decode", reserve.span_id)
    assert (job.service, job.parent) == ("pdmesh-prefill", dispatch.span_id)
    for s in spans:
        if s.name in ("prefill.queue", "prefill.chunk", "kv.transfer"):
            assert s.parent == job.span_id, s
        if s.name in ("decode.kv_wait", "decode.generate"):
            assert s.parent == dec.span_id, s
        assert s.parent in by_id or s is client, f"{s.name}'s parent is not in the trace"
        assert not s.error, s
        assert s.start_ns <= s.end_ns, s
    # What each span says about the request.
    rid = gw.attrs["pdmesh.request_id"]
    assert str(rid).startswith("chatcmpl-") and gw.attrs["pdmesh.client_request_id"] == \
        "client-42"
    assert gw.attrs["http.response.status_code"] == 200
    assert {adm.attrs["pdmesh.request_id"], job.attrs["pdmesh.request_id"],
            dec.attrs["pdmesh.request_id"]} == {rid}
    assert adm.attrs["pdmesh.verdict"] == "admitted"
    prompt_tokens = gw.attrs["gen_ai.usage.input_tokens"]
    assert job.attrs["gen_ai.usage.input_tokens"] == prompt_tokens
    assert sum(int(s.attrs["pdmesh.chunk.tokens"]) for s in spans  # type: ignore[arg-type]
               if s.name == "prefill.chunk") == prompt_tokens
    transfer = _one(spans, "kv.transfer")
    assert transfer.attrs["pdmesh.kv.transport"] == "tcp"
    assert int(transfer.attrs["pdmesh.kv.bytes"]) > 0  # type: ignore[arg-type]
    assert 0 <= float(transfer.attrs["pdmesh.kv.exposed_s"]) <= float(  # type: ignore[arg-type]
        (transfer.end_ns - transfer.start_ns) / 1e9) + 1e-3
    assert _one(spans, "decode.kv_wait").attrs["pdmesh.kv.bytes"] == \
        transfer.attrs["pdmesh.kv.bytes"]
    gen = _one(spans, "decode.generate")
    assert gen.events == ["first_token", "last_token"]
    assert dec.attrs["gen_ai.usage.output_tokens"] == 6 == gw.attrs["gen_ai.usage.output_tokens"]
    assert "first_token" in gw.events and "last_token" in gw.events
    # Nesting in time: the workers' spans lie within the gateway's.
    assert client.start_ns <= gw.start_ns <= adm.start_ns
    assert max(s.end_ns for s in spans if s is not client) <= gw.end_ns + 50e6


def test_a_request_without_traceparent_starts_its_own_trace(traced_mesh: Mesh,
                                                            receiver: Receiver) -> None:
    """No (or a malformed) traceparent: the gateway's span is the root of a new trace, the
    request is served as any other, and the reply names it with the mesh's request id."""
    for sent in ({}, {"traceparent": "00-not-a-trace-id-01"}):
        before = {s.trace_id for s in receiver.spans}
        status, headers, body = _post(traced_mesh, "/v1/completions", {
            "model": "tiny", "prompt": "untraced client", "max_tokens": 3,
            "temperature": 0}, sent)
        assert status == 200, body
        rid = json.loads(body)["id"]
        assert headers.get("X-Request-Id") == rid
        deadline = time.monotonic() + 20
        while True:
            roots = [s for s in receiver.spans if s.name == "POST /v1/completions"
                     and s.attrs.get("pdmesh.request_id") == rid]
            if roots:
                break
            assert time.monotonic() < deadline, "the gateway's span never came"
            time.sleep(0.1)
        root = roots[0]
        assert root.parent == "" and root.trace_id not in before
        spans = receiver.wait(root.trace_id, {"admission.request", "decode.request",
                                               "prefill.job"})
        assert {s.service for s in spans} == set(SERVICES)


def test_a_rejected_request_reaches_no_worker_in_its_trace(traced_mesh: Mesh,
                                                          receiver: Receiver) -> None:
    """I1 as the trace shows it: a request over the served context is answered 400 by the
    gateway, and its trace is the gateway's span alone: no admission, reserve, dispatch or
    worker span."""
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    status, _, body = _post(traced_mesh, "/v1/completions", {
        "model": "tiny", "prompt": "x", "max_tokens": 1 << 20, "temperature": 0},
        {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"})
    assert status == 400 and b"context" in body, body
    root = receiver.wait(trace_id, {"POST /v1/completions"})[0]
    assert root.attrs["http.response.status_code"] == 400
    assert root.attrs["pdmesh.outcome"] == "context_length_exceeded"
    # An admitted request's admission span comes well within this (the first test's did).
    time.sleep(1.5)
    assert {s.name for s in receiver.trace(trace_id)} == {"POST /v1/completions"}


def test_an_invalid_x_request_id_is_refused(traced_mesh: Mesh) -> None:
    for bad in ("x" * 257, "has space", "tab\there"):
        status, _, body = _post(traced_mesh, "/v1/completions", {
            "model": "tiny", "prompt": "hi", "max_tokens": 1}, {"X-Request-Id": bad})
        err = json.loads(body)["error"]
        assert status == 400 and err["param"] == "X-Request-Id", (bad, body)
        assert err["code"] == "invalid_request_id"


def test_tracing_off_loads_no_sdk() -> None:
    """Without an endpoint a service's tracer is the no-op one and the OpenTelemetry SDK is
    never imported (no cost when off)."""
    code = ("import sys\n"
            "from pdmesh.services.runtime.config import resolve\n"
            "from pdmesh.services.runtime.service import ServiceRuntime\n"
            "rt = ServiceRuntime(resolve('admission', {}, {'PDMESH_ALLOW_DEV_CREDENTIALS': "
            "'1'}))\n"
            "print(rt.tracing.enabled, any(m.startswith('opentelemetry') for m in "
            "sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=mesh_env(),
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr
    assert open_tracing("", "gateway", "g").span("x") is None
