"""One OpenAI-style request over aiohttp, streamed (SSE) or not, with its timings.

Timings follow `vllm bench serve`: TTFT is from sending the request to the first chunk that
carries text; each inter-token latency (ITL) is the gap between consecutive text chunks;
E2E latency ends when the stream ends. Token counts come from the server's `usage` object
when it sends one (`stream_options.include_usage`), else from the number of text chunks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from loadtest.workload import RequestSpec

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


def request_body(cfg: ClientConfig, req: RequestSpec) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": req.max_tokens,
                  "temperature": cfg.temperature, "stream": cfg.stream}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
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


def _finish_reason(payload: dict) -> str | None:
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


def _apply_usage(result: RequestResult, payload: dict) -> None:
    usage = payload.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            result.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            result.output_tokens = usage["completion_tokens"]


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, req: RequestSpec,
                       api_key: str | None) -> RequestResult:
    """Send one request and measure it. Never raises for server or network errors (they are
    recorded in the result); CancelledError propagates."""
    result = RequestResult.for_request(req)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    result.start_s = start = time.perf_counter()
    try:
        async with session.post(cfg.url(), json=request_body(cfg, req), headers=headers,
                                timeout=timeout) as resp:
            result.status = resp.status
            if resp.status != 200:
                result.error, result.error_code = error_fields(await resp.text())
                return result.fail(f"http_{resp.status}", result.error or resp.reason or "")
            if cfg.stream:
                await _read_stream(resp, cfg, result, start)
            else:
                payload = await resp.json(content_type=None)
                result.generated_text = chunk_text(payload, cfg.endpoint)
                result.finish_reason = _finish_reason(payload)
                result.output_tokens = 1 if result.generated_text else 0
                _apply_usage(result, payload)
                result.ttft_s = result.e2el_s = time.perf_counter() - start
                result.success = result.output_tokens > 0
                if not result.success:
                    result.fail("empty", "response without output tokens")
    except TimeoutError:
        result.e2el_s = time.perf_counter() - start
        return result.fail("timeout", f"no complete response within {cfg.request_timeout_s}s")
    except aiohttp.ClientError as exc:
        result.e2el_s = time.perf_counter() - start
        return result.fail("connection", f"{type(exc).__name__}: {exc}")
    except (ValueError, UnicodeDecodeError) as exc:
        result.e2el_s = time.perf_counter() - start
        return result.fail("protocol", f"{type(exc).__name__}: {exc}")
    return result


async def _read_stream(resp: aiohttp.ClientResponse, cfg: ClientConfig, result: RequestResult,
                       start: float) -> None:
    parser = SSEParser()
    texts: list[str] = []
    num_chunks = 0
    last = start
    done = False
    async for raw in resp.content.iter_any():
        now = time.perf_counter()
        for data in parser.feed(raw):
            if data.strip() == "[DONE]":
                done = True
                continue
            payload = json.loads(data)
            if not isinstance(payload, dict):
                raise ValueError(f"stream chunk is not an object: {data[:200]}")
            if "error" in payload:
                message, result.error_code = error_fields(data)
                result.e2el_s = now - start
                result.generated_text = "".join(texts)
                result.fail("stream_error", message)
                return
            text = chunk_text(payload, cfg.endpoint)
            if text:
                if num_chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                num_chunks += 1
                last = now
                texts.append(text)
            result.finish_reason = _finish_reason(payload) or result.finish_reason
            _apply_usage(result, payload)
    result.e2el_s = time.perf_counter() - start
    result.generated_text = "".join(texts)
    if result.output_tokens == 0:
        result.output_tokens = num_chunks
    if not done:
        result.fail("stream_error", "stream ended without data: [DONE]")
    elif num_chunks == 0:
        result.fail("empty", "stream without output text")
    else:
        result.success = True


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


def context_length_of(model_info: dict) -> int | None:
    """The served context length, if the /models entry announces one."""
    for key in ("max_model_len", "context_length", "max_context_length", "context_window"):
        value = model_info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None

