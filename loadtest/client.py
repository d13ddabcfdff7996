"""The tools' one OpenAI-style client: a request over aiohttp, streamed (SSE) or not.

`exchange` sends it and records what came back (`Reply`); the soak judges that as it is,
the load tester turns it into a `RequestResult` (`send_request`). Timings follow `vllm bench
serve`: TTFT is from sending the request to the first chunk that carries text; each
inter-token latency (ITL) is the gap between consecutive text chunks; E2E latency ends when
the stream ends. Token counts come from the server's `usage` object when it sends one
(`stream_options.include_usage`), else from the number of text chunks.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from pdmesh.loadtest.workload import RequestSpec
from pdmesh.services.ops.topology import metrics_port_for

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


class SSEParser:
    """Incremental server-sent-events parser: feed bytes, get the `data` payload of each
    complete event. Handles events split across reads, CRLF, comments and multi-line data."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                return events
            line = self._buffer[:newline].rstrip(b"\r").decode("utf-8")
            self._buffer = self._buffer[newline + 1 :]
            if not line:  # blank line: dispatch the event
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith(":"):
                continue  # comment / keep-alive
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) carry nothing we use

    def close(self) -> list[str]:
        """Flush a last event not followed by a blank line (lenient servers)."""
        events = self.feed(b"\n\n" if self._buffer else b"\n")
        return events


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # ends in /v1
    model: str
    endpoint: str = "completions"
    stream: bool = True
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout_s: float = 300.0

    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclass
class Reply:
    """What the client saw of one request, as it came off the wire (times in seconds).

    The load tester turns it into a `RequestResult` (its success rules and timings); the
    soak judges it as it is (`soak_verdict.judge`)."""

    status: int | None = None  # HTTP status; None: no response (connection, timeout)
    text: str = ""  # all text received (the whole reply, or the part before an end)
    finish_reason: str | None = None
    error_code: str | None = None  # OpenAI error code (HTTP error body or stream event)
    error: str = ""
    http_reason: str = ""  # the HTTP reason phrase of a non-200 status
    transport_error: str = ""  # timeout / connection / protocol / cancelled
    stream_error: bool = False  # an error event arrived inside a 200 stream (or JSON body)
    done: bool = False  # the reply was complete ([DONE], or a whole JSON body)
    aborted: bool = False  # the client disconnected on purpose
    chunks: int = 0  # text chunks received (a whole JSON body with text: 1)
    prompt_tokens: int | None = None  # from usage
    completion_tokens: int | None = None  # from usage
    start_s: float = 0.0  # perf_counter at send
    ttft_s: float = 0.0  # to the first text chunk of a stream
    itls_s: list[float] = field(default_factory=list)  # gaps between text chunks
    e2e_s: float = 0.0


def request_body(cfg: ClientConfig, prompt: str | list[int], max_tokens: int) -> dict:
    """The request's JSON body; a completions `prompt` may be token ids."""
    body: dict = {"model": cfg.model, "max_tokens": max_tokens,
                  "temperature": cfg.temperature, "stream": cfg.stream}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(payload: dict, endpoint: str) -> str:
    """The text of one completion chunk / response (empty for a usage-only chunk)."""
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        part = choice.get("delta") or choice.get("message") or {}
        return part.get("content") or ""
    return choice.get("text") or ""


def finish_reason(payload: dict) -> str | None:
    choices = payload.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def error_fields(text: str) -> tuple[str, str | None]:
    """(message, code) of an OpenAI-style error body; lenient to other bodies."""
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text[:500], None
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        return str(err.get("message", ""))[:500], None if code is None else str(code)
    return text[:500], None


def _apply_usage(reply: Reply, payload: dict) -> None:
    usage = payload.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            reply.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            reply.completion_tokens = usage["completion_tokens"]


async def exchange(session: aiohttp.ClientSession, cfg: ClientConfig, prompt: str | list[int],
                   max_tokens: int, headers: Mapping[str, str] | None = None, *,
                   abort_after_chunks: int = 0, stop_at_error: bool = False) -> Reply:
    """Send one request and record what came back: the one OpenAI client (JSON or SSE) of
    the load tester and the soak. Never raises for server or network errors (they are
    recorded in the reply); CancelledError propagates.

    `abort_after_chunks`: drop the connection once that many text chunks arrived (the
    server sees the client go away). `stop_at_error`: stop reading a stream at its first
    error event (else read on to its end)."""
    reply = Reply()
    reply.start_s = time.perf_counter()
    try:
        async with session.post(cfg.url(), json=request_body(cfg, prompt, max_tokens),
                                headers=dict(headers or {}),
                                timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s)
                                ) as resp:
            reply.status = resp.status
            if resp.status != 200:
                reply.http_reason = resp.reason or ""
                reply.error, reply.error_code = error_fields(await resp.text())
            elif cfg.stream:
                await _read_stream(resp, cfg.endpoint, reply, abort_after_chunks,
                                   stop_at_error)
            else:
                _read_body(await resp.json(content_type=None), cfg.endpoint, reply)
    except TimeoutError:
        reply.transport_error = "timeout"
    except aiohttp.ClientError as exc:
        reply.transport_error = "connection"
        reply.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, UnicodeDecodeError) as exc:
        reply.transport_error = "protocol"
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.e2e_s = time.perf_counter() - reply.start_s
    return reply


def _read_body(payload: dict, endpoint: str, reply: Reply) -> None:
    """A whole (stream=false) JSON reply."""
    if "error" in payload:
        reply.error, reply.error_code = error_fields(json.dumps(payload))
        reply.stream_error = True
        return
    reply.text = chunk_text(payload, endpoint)
    reply.finish_reason = finish_reason(payload)
    _apply_usage(reply, payload)
    reply.chunks = 1 if reply.text else 0
    reply.done = True


async def _read_stream(resp: aiohttp.ClientResponse, endpoint: str, reply: Reply,
                       abort_after_chunks: int, stop_at_error: bool) -> None:
    parser = SSEParser()
    texts: list[str] = []
    last = reply.start_s
    async for raw in resp.content.iter_any():
        now = time.perf_counter()
        for data in parser.feed(raw):
            if data.strip() == "[DONE]":
                reply.done = True
                continue
            payload = json.loads(data)
            if not isinstance(payload, dict):
                raise ValueError(f"stream chunk is not an object: {data[:200]}")
            if "error" in payload:
                reply.error, reply.error_code = error_fields(data)
                reply.stream_error = True
                if stop_at_error:
                    reply.text = "".join(texts)
                    return
                continue
            text = chunk_text(payload, endpoint)
            if text:
                if reply.chunks == 0:
                    reply.ttft_s = now - reply.start_s
                else:
                    reply.itls_s.append(now - last)
                reply.chunks += 1
                last = now
                texts.append(text)
            reply.finish_reason = finish_reason(payload) or reply.finish_reason
            _apply_usage(reply, payload)
        reply.text = "".join(texts)
        if (abort_after_chunks and reply.chunks >= abort_after_chunks and not reply.done
                and not reply.stream_error):
            reply.aborted = True
            resp.close()  # drop the connection: the server sees the client go away
            return
    reply.text = "".join(texts)


@dataclass
class RequestResult:
    """The outcome of one request; times in seconds (like vllm's RequestFuncOutput)."""

    index: int
    tenant: int
    prompt_len: int  # intended prompt tokens (bytes of the prompt)
    max_tokens: int
    expect_reject: bool = False
    warmup: bool = False
    success: bool = False
    status: int | None = None
    error_kind: str | None = None  # http_<status>, timeout, connection, stream_error, ...
    error: str = ""
    error_code: str | None = None  # OpenAI error code, e.g. context_length_exceeded
    prompt_tokens: int | None = None  # from usage, when the server sends it
    output_tokens: int = 0
    ttft_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    start_s: float = 0.0  # perf_counter at send
    generated_text: str = ""
    finish_reason: str | None = None

    @classmethod
    def for_request(cls, req: RequestSpec) -> RequestResult:
        return cls(req.index, req.tenant, req.prompt_len, req.max_tokens, req.expect_reject,
                   req.warmup)

    @classmethod
    def from_reply(cls, req: RequestSpec, cfg: ClientConfig, reply: Reply) -> RequestResult:
        """The load tester's accounting of a reply: a success needs a 200 with output (a
        stream: text chunks and `data: [DONE]`); a transport failure keeps no text."""
        result = cls.for_request(req)
        result.status, result.prompt_tokens = reply.status, reply.prompt_tokens
        result.finish_reason = reply.finish_reason
        result.start_s, result.e2el_s = reply.start_s, reply.e2e_s
        result.ttft_s, result.itls_s = reply.ttft_s, reply.itls_s
        if reply.transport_error:
            result.output_tokens = reply.completion_tokens or 0
            message = (f"no complete response within {cfg.request_timeout_s}s"
                       if reply.transport_error == "timeout" else reply.error)
            return result.fail(reply.transport_error, message)
        if reply.status != 200:
            result.error, result.error_code = reply.error, reply.error_code
            return result.fail(f"http_{reply.status}", reply.error or reply.http_reason)
        result.generated_text = reply.text
        if not cfg.stream:  # TTFT of a whole reply is its E2E latency (as vllm)
            result.ttft_s = result.e2el_s
            result.output_tokens = (reply.chunks if reply.completion_tokens is None
                                    else reply.completion_tokens)
            result.success = result.output_tokens > 0
            if not result.success:
                result.fail("empty", "response without output tokens")
            return result
        if reply.stream_error:
            result.error_code = reply.error_code
            result.output_tokens = reply.completion_tokens or 0
            return result.fail("stream_error", reply.error)
        result.output_tokens = reply.completion_tokens or reply.chunks
        if not reply.done:
            return result.fail("stream_error", "stream ended without data: [DONE]")
        if reply.chunks == 0:
            return result.fail("empty", "stream without output text")
        result.success = True
        return result

    @property
    def input_len(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens > 1:
            return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)
        return None

    def fail(self, kind: str, message: str) -> RequestResult:
        self.success = False
        self.error_kind = kind
        self.error = message or kind  # vllm: an empty error means success
        return self


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, req: RequestSpec,
                       api_key: str | None) -> RequestResult:
    """Send one request and measure it. Never raises for server or network errors (they are
    recorded in the result); CancelledError propagates."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = await exchange(session, cfg, req.prompt, req.max_tokens, headers,
                           stop_at_error=True)
    return RequestResult.from_reply(req, cfg, reply)


async def fetch_model_info(session: aiohttp.ClientSession, base_url: str,
                           api_key: str | None) -> dict:
    """The first model of GET /models (OpenAI shape); {} when the server has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(base_url.rstrip("/") + "/models", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        payload = await resp.json(content_type=None)
    models = payload.get("data") or []
    return models[0] if models else {}


async def model_info(base_url: str, api_key: str | None) -> dict:
    """`fetch_model_info` over a session of its own (raises on failure)."""
    async with aiohttp.ClientSession() as session:
        return await fetch_model_info(session, base_url, api_key)


BASE_URL_HELP = "the server, as http://host:port or http://host:port/v1"


def api_base(url: str) -> str:
    """The OpenAI API base of a server given as http://host:port or http://host:port/v1
    (vllm bench serve's --base-url is the former; OpenAI clients use the latter). Every
    tool's `--base-url` is parsed with it, so they all take both forms."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_root(url: str) -> str:
    """The server's root (where /tokenize and /health live)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def default_metrics_url(url: str) -> str:
    """Where a pdmesh gateway at `url` serves /metrics by convention: its host, its port
    + 100 (`pdmesh up` and compose put it there; services/ops/topology.py). The API port
    itself never serves them."""
    parts = urllib.parse.urlsplit(server_root(url))
    port = metrics_port_for(parts.port or (443 if parts.scheme == "https" else 80))
    host = parts.hostname or "127.0.0.1"
    host = f"[{host}]" if ":" in host else host
    return f"{parts.scheme or 'http'}://{host}:{port}/metrics"


def context_length_of(model_info: dict) -> int | None:
    """The served context length, if the /models entry announces one."""
    for key in ("max_model_len", "context_length", "max_context_length", "context_window"):
        value = model_info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None

