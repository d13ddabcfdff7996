"""Fixtures for the load tester's own tests.

`sse_server` is a TEST DOUBLE of an OpenAI-style server, for the *client's* tests only
(SSE parsing, timings, accounting). It proves nothing about pdmesh: the real end-to-end
test uses the `live_mesh` fixture from tests/conftest.py. The double speaks a byte-level
"tokenizer" (1 token per byte + 1 BOS), answers deterministically (the reply is derived
from the prompt's hash) and can be told to misbehave: let over-long prompts through
(`miss_rejections`) or answer differently while other requests are in flight
(`corrupt_when_concurrent`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

MODEL = "double-tiny"


@dataclass
class SSEDouble:
    api_keys: list[str] = field(default_factory=lambda: ["key-a", "key-b"])
    model: str = MODEL
    max_context: int = 512
    token_delay_s: float = 0.002
    miss_rejections: bool = False
    corrupt_when_concurrent: bool = False
    base_url: str = ""
    active: int = 0
    peak_active: int = 0
    requests_seen: int = 0
    tenants_seen: set[str] = field(default_factory=set)

    def reply_text(self, prompt: str, max_tokens: int, corrupt: bool) -> str:
        seed = (prompt + ("#other" if corrupt else "")).encode()
        digest = hashlib.sha256(seed).hexdigest()
        return (digest * (max_tokens // len(digest) + 1))[:max_tokens]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    def _auth(self, request: web.Request) -> str | None:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        return key if key in self.api_keys else None

    async def models(self, request: web.Request) -> web.Response:
        if self._auth(request) is None:
            return _error(401, "invalid api key", "invalid_api_key")
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "max_model_len": self.max_context}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        key = self._auth(request)
        if key is None:
            return _error(401, "invalid api key", "invalid_api_key")
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        max_tokens = int(body.get("max_tokens", 16))
        prompt_tokens = len(prompt.encode()) + 1  # BOS
        self.requests_seen += 1
        self.tenants_seen.add(key)
        if prompt_tokens + max_tokens > self.max_context and not self.miss_rejections:
            return _error(400, f"prompt of {prompt_tokens} tokens + {max_tokens} exceeds "
                          f"the context of {self.max_context}", "context_length_exceeded")
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            await asyncio.sleep(self.token_delay_s)
            text = self.reply_text(prompt, max_tokens,
                                   self.corrupt_when_concurrent and self.active > 1)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(text),
                     "total_tokens": prompt_tokens + len(text)}
            if not body.get("stream"):
                choice = ({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
                return web.json_response({"choices": [{**choice, "index": 0,
                                                       "finish_reason": "length"}],
                                          "usage": usage})
            return await self._stream(request, text, chat, usage, body)
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request, text: str, chat: bool, usage: dict,
                      body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\n\n")
        for i, char in enumerate(text):
            part = {"delta": {"content": char}} if chat else {"text": char}
            finish = "length" if i == len(text) - 1 else None
            chunk = {"choices": [{**part, "index": 0, "finish_reason": finish}]}
            await resp.write(f"data: {json.dumps(chunk)}\r\n\r\n".encode())
            await asyncio.sleep(self.token_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": code}},
        status=status)


class DoubleServer:
    """Runs a test double (anything with `app()` and a `base_url` to fill in) on 127.0.0.1
    (free port) in its own thread and event loop, so that synchronous tests can call a
    tool's `main` (which runs its own loop)."""

    def __init__(self, double: Any) -> None:
        self.double = double
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def start(self) -> Any:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self.double

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.double.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.double.base_url = f"http://{host}:{port}/v1"

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def serve_double() -> Iterator[Callable[[Any], Any]]:
    """`serve_double(double)` starts `double` (see DoubleServer) and returns it, its
    `base_url` set; every double started is stopped after the test."""
    servers: list[DoubleServer] = []

    def start(double: Any) -> Any:
        server = DoubleServer(double)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def sse_server_factory(serve_double: Callable[[Any], Any]) -> Callable[..., SSEDouble]:
    def make(**kwargs: object) -> SSEDouble:
        return serve_double(SSEDouble(**kwargs))

    return make


@pytest.fixture
def sse_server(sse_server_factory: Callable[..., SSEDouble]) -> SSEDouble:
    """A well-behaved OpenAI-style SSE test double (client tests only, not pdmesh)."""
    return sse_server_factory()
