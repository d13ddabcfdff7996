"""One admitted request's reply: JSON at the end, or SSE chunks as tokens arrive.

Streaming replies follow OpenAI's shape: `text_completion` or `chat.completion.chunk`
objects, the chat role first, `finish_reason` on the last content chunk, then (with
`stream_options.include_usage`) a chunk with empty `choices` and the `usage`, then
`data: [DONE]`. A failure after the headers went out is sent as an OpenAI error object in
the stream; before that it is raised as an `ApiError` for the middleware.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from aiohttp import web

from pdmesh.gateway.mesh import ClientGone, MeshClient, MeshFailed, Submission
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.schema import ApiError, ChatBody, CompletionBody, stop_list
from pdmesh.gateway.tenants import Tenant
from pdmesh.gateway.text import TextStream
from pdmesh.services import messages as m
from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.config import ServiceConfig
from pdmesh.services.engine.tokenizer import Tokenizer

STREAM_STARTED = "pdmesh.stream_started"  # request key: SSE headers already sent


class Serving(Protocol):
    """What a Generation uses of the gateway serving it (`app.Gateway`), named here so that
    this module need not import the app that imports it."""

    cfg: ServiceConfig
    tokenizer: Tokenizer
    model_name: str
    mesh: MeshClient
    metrics: GatewayMetrics
    registry: CapacityRegistry


class Generation:
    """One admitted request's reply: JSON at the end, or SSE chunks as tokens arrive."""

    def __init__(self, gw: Serving, request: web.Request, tenant: Tenant,
                 body: CompletionBody | ChatBody, rid: str, prompt_len: int, chat: bool,
                 t0: float) -> None:
        self.gw, self.request, self.tenant, self.body = gw, request, tenant, body
        self.rid, self.prompt_len, self.chat, self.t0 = rid, prompt_len, chat, t0
        self.created = int(time.time())
        self.text = TextStream(gw.tokenizer, stop_list(body))
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.response: web.StreamResponse = web.Response()
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.outcome: m.Outcome | None = None  # how the request ended, once it has

    def _alive(self) -> bool:
        transport = self.request.transport
        return transport is not None and not transport.is_closing()

    def _dead_worker(self, sub: Submission) -> str:
        """Name of a worker serving this request that stopped heartbeating, or ""."""
        # Prefill matters only until its KV has arrived (the first token comes with it).
        workers = [sub.decode_worker] if sub.got_first_token else [sub.decode_worker,
                                                                   sub.prefill_worker]
        for worker in workers:
            if worker and self.gw.registry.get(worker) is None:
                return worker
        return ""

    async def run(self, sub: Submission) -> m.Outcome:
        gw = self.gw
        finish: str | None = None
        parts: list[str] = []
        last = None
        if self.body.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(self.request)
            self.request[STREAM_STARTED] = True
            self.response = resp
            if self.chat:
                await self._send(self._chunk({"role": "assistant", "content": ""}, None))
        try:
            async for ev in gw.mesh.tokens(sub, gw.cfg.request_timeout_s, self._alive,
                                           self._dead_worker):
                now = time.monotonic()
                if last is None:
                    gw.metrics.ttft.labels(self.tenant.tenant_id).observe(now - self.t0)
                else:
                    gw.metrics.itl.labels(self.tenant.tenant_id).observe(now - last)
                last = now
                self.completion_tokens += len(ev.token_ids)
                self.cached_tokens = max(self.cached_tokens, sub.cached_tokens)
                delta = self.text.push(ev.token_ids, final=ev.finish is not None)
                if self.text.stopped:
                    finish = "stop"
                elif ev.finish is not None:
                    finish = ev.finish.label  # "stop" | "length", as OpenAI spells them
                if self.body.stream and (delta or finish):
                    await self._send(self._chunk(delta, finish))
                else:
                    parts.append(delta)
                if finish:
                    break
        except MeshFailed as exc:
            return await self._fail(502, f"generation failed: {exc}", exc.outcome)
        except TimeoutError as exc:
            return await self._fail(504, str(exc), m.Outcome(code=m.Code.DEADLINE,
                                                             detail=str(exc)), "timeout")
        except (ClientGone, ConnectionResetError):
            self.outcome = m.Outcome(code=m.Code.ABORTED, detail="client gone")
            return self.outcome
        gw.metrics.tokens.labels(self.tenant.tenant_id, "prompt").inc(self.prompt_len)
        gw.metrics.tokens.labels(self.tenant.tenant_id, "completion").inc(self.completion_tokens)
        if self.body.stream:
            if self.include_usage:
                await self._send(self._envelope([], usage=self._usage()))
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()
        else:
            self.response = web.json_response(self._final("".join(parts), finish or "length"))
        self.outcome = m.FINISHED_LENGTH if finish == "length" else m.FINISHED_STOP
        return self.outcome

    async def _fail(self, status: int, message: str, outcome: m.Outcome,
                    code: str = "") -> m.Outcome:
        """Answer a failure (an error event on a stream, else an error response: raised).
        `self.outcome` says how the request ended either way."""
        self.outcome = outcome
        err = ApiError(status, message, type_="server_error", code=code or outcome.label)
        if self.body.stream:
            try:
                await self._send(err.body())
                await self.response.write_eof()
            except ConnectionResetError:
                pass
            return outcome
        raise err

    async def _send(self, obj: dict[str, Any]) -> None:
        await self.response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_len, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_len + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def _envelope(self, choices: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.gw.model_name, "choices": choices}
        if self.include_usage:
            obj["usage"] = usage
        return obj

    def _chunk(self, delta: str | dict[str, str], finish: str | None) -> dict[str, Any]:
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        return self._envelope([choice])

    def _final(self, text: str, finish: str) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.gw.model_name, "choices": [choice],
                "usage": self._usage()}

