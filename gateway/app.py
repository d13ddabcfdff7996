"""The gateway: OpenAI-compatible HTTP + SSE in front of the mesh.

Per request: authenticate (API key -> tenant + server-side cache salt) -> validate the body
-> tokenize -> submit to admission (REJECTED answers 400/429/503 at once) -> stream tokens
from decode -> FINISHED. A client that goes away aborts the request across the mesh.
Every error, including 404/405/413 and unexpected ones, is answered in the OpenAI shape.
"""

from __future__ import annotations

import json
import secrets
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Histogram

from gateway.mesh import ClientGone, MeshClient, MeshFailed, MeshRejected, MeshUnavailable
from gateway.schema import ApiError, ChatBody, CompletionBody, parse_chat, parse_completion, \
    stop_list
from gateway.tenants import Tenant, TenantDirectory
from gateway.text import TextStream
from services import messages as m
from services.admission.registry import CapacityRegistry
from services.config import ServiceConfig
from services.engine.models import load_model
from services.faults import FAULT_HEADER, REQUEST_FAULTS
from services.runtime import ServiceRuntime

log = logging.getLogger("pdmesh.gateway")

_REJECT_STATUS = {
    m.RejectReason.CONTEXT_LENGTH_EXCEEDED: (400, "context_length_exceeded"),
    m.RejectReason.PROMPT_EXCEEDS_PREFILL_POOL: (400, "context_length_exceeded"),
    m.RejectReason.EXCEEDS_DECODE_POOL: (400, "context_length_exceeded"),
    m.RejectReason.INVALID: (400, "invalid_request"),
    m.RejectReason.SATURATED: (429, "mesh_saturated"),
    m.RejectReason.NO_WORKERS: (503, "no_workers"),
}
_FINISH = {m.FinishReason.STOP: "stop", m.FinishReason.LENGTH: "length"}
STREAM_STARTED = "pdmesh.stream_started"  # request key: SSE headers already sent
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Gateway:
    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.rt = ServiceRuntime(cfg)
        self.rt.extra_ready = self._workers_ready  # type: ignore[method-assign]
        self.tenants = TenantDirectory.load(cfg.tenants_file, cfg.mesh_secret)
        # The gateway tokenizes and detokenizes; it needs the tokenizer, not the weights.
        loaded = load_model(cfg.model)
        self.tokenizer, self.model_name = loaded.tokenizer, loaded.name
        del loaded
        self.registry = CapacityRegistry(cfg.worker_ttl_s)
        self.request_faults = REQUEST_FAULTS in cfg.fault_set  # test meshes only
        # Admission may queue a request up to queue_timeout_s before answering.
        self.mesh = MeshClient(self.rt, submit_timeout_s=cfg.queue_timeout_s
                               + cfg.reserve_timeout_s + 3.0)
        r = self.rt.registry
        self.ttft = Histogram("pdmesh:time_to_first_token_seconds", "Time to first token",
                              ["tenant"], registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdmesh:inter_token_latency_seconds", "Inter-token latency",
                             ["tenant"], registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("pdmesh:e2e_request_latency_seconds", "End-to-end latency",
                             ["tenant", "outcome"], registry=r, buckets=LATENCY_BUCKETS)
        self.requests = Counter("pdmesh:requests_total", "Requests by tenant and outcome",
                                ["tenant", "outcome"], registry=r)
        self.tokens = Counter("pdmesh:tokens_total", "Tokens by tenant and kind",
                              ["tenant", "kind"], registry=r)

    # -- wiring -------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        app.middlewares.append(self._errors_middleware)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)

    async def start(self) -> None:
        self.rt.app._client_max_size = self.cfg.max_body_bytes  # noqa: SLF001 - set pre-start
        await self.rt.start_http(self.routes)
        await self.rt.connect()
        await self.rt.subscribe(m.HEARTBEAT_WILDCARD, m.Heartbeat, self._on_heartbeat,
                                concurrent=False)
        self.rt.mark_ready()

    async def _on_heartbeat(self, beat: m.Heartbeat, _msg: Any) -> None:
        if beat.role in (m.Role.PREFILL, m.Role.DECODE):
            self.registry.observe(beat)

    def _workers_ready(self) -> bool:
        return bool(self.registry.views(m.Role.PREFILL)) and bool(
            self.registry.views(m.Role.DECODE))

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(exc.status)
            err = ApiError(exc.status, exc.reason if exc.status != 413 else
                           f"request body exceeds {self.cfg.max_body_bytes} bytes",
                           code=code)
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return web.json_response(err.body(), status=exc.status, headers=allow)
        except Exception:
            if request.get(STREAM_STARTED):
                raise  # the SSE headers are out: aiohttp can only drop the connection
            log.exception("gateway: unexpected error on %s %s", request.method, request.path)
            err = ApiError(500, "internal error in the gateway", type_="server_error",
                           code="internal_error")
            return web.json_response(err.body(), status=500)

    # -- endpoints ----------------------------------------------------------------------
    def _auth(self, request: web.Request) -> Tenant:
        tenant = self.tenants.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                           type_="authentication_error")
        return tenant

    async def models(self, request: web.Request) -> web.Response:
        self._auth(request)
        contexts = [v.served_context for v in self.registry.views(m.Role.DECODE)]
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "pdmesh",
            "max_model_len": max(contexts, default=0)}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._auth(request)
        body = parse_completion(await request.read())
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if not ids:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="prompt")
        return await self._generate(request, tenant, body, ids, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        tenant = self._auth(request)
        body = parse_chat(await request.read())
        messages = []
        for msg in body.messages:
            content = msg.content if isinstance(msg.content, str) else "".join(
                p.text for p in (msg.content or []))
            messages.append({"role": msg.role, "content": content})
        ids = self.tokenizer.encode(self.tokenizer.apply_chat_template(messages))
        return await self._generate(request, tenant, body, ids, chat=True)

    async def _generate(self, request: web.Request, tenant: Tenant,
                        body: CompletionBody | ChatBody, ids: list[int],
                        chat: bool) -> web.StreamResponse:
        if body.model not in (self.model_name, "") and body.model != self.cfg.model:
            raise ApiError(404, f"The model {body.model!r} does not exist; this mesh serves "
                           f"{self.model_name!r}", code="model_not_found", param="model")
        t0 = time.monotonic()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        temperature = 1.0 if body.temperature is None else body.temperature
        # One seed per request, chosen here when the client gives none, so prefill (first
        # token) and decode (the rest) sample from the same stream.
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        fault = request.headers.get(FAULT_HEADER, "") if self.request_faults else ""
        req = m.SubmitRequest(
            request_id=rid, tenant=tenant.tenant_id, cache_salt=tenant.cache_salt,
            prompt_ids=ids, max_tokens=max_tokens, sampling=m.Sampling(
                temperature=temperature, top_p=body.top_p or 1.0, seed=seed), fault=fault)
        outcome = "error"
        try:
            async with self.mesh.submit(req) as sub:
                gen = _Generation(self, request, tenant, body, rid, len(ids), chat, t0)
                outcome = await gen.run(sub)
                return gen.response
        except MeshRejected as exc:
            rej = exc.rejection
            status, code = _REJECT_STATUS.get(rej.reason, (400, "invalid_request"))
            outcome = "rejected"
            raise ApiError(status, rej.message, code=code,
                           param="messages" if chat else "prompt",
                           type_="invalid_request_error" if status == 400 else
                           "server_error") from None
        except MeshUnavailable as exc:
            outcome = "unavailable"
            raise ApiError(503, f"the mesh is not answering: {exc}", type_="server_error",
                           code="no_workers") from None
        finally:
            self.requests.labels(tenant.tenant_id, outcome).inc()
            self.e2e.labels(tenant.tenant_id, outcome).observe(time.monotonic() - t0)


class _Generation:
    """One admitted request's reply: JSON at the end, or SSE chunks as tokens arrive."""

    def __init__(self, gw: Gateway, request: web.Request, tenant: Tenant,
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

    def _alive(self) -> bool:
        transport = self.request.transport
        return transport is not None and not transport.is_closing()

    def _workers_alive(self, sub: Any) -> str:
        """Name of a worker serving this request that stopped heartbeating, or ""."""
        # Prefill matters only until its KV has arrived (the first token comes with it).
        workers = [sub.decode_worker] if sub.got_first_token else [sub.decode_worker,
                                                                   sub.prefill_worker]
        for worker in workers:
            if worker and self.gw.registry.get(worker) is None:
                return worker
        return ""

    async def run(self, sub: Any) -> str:
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
                                           self._workers_alive):
                now = time.monotonic()
                if last is None:
                    gw.ttft.labels(self.tenant.tenant_id).observe(now - self.t0)
                else:
                    gw.itl.labels(self.tenant.tenant_id).observe(now - last)
                last = now
                self.completion_tokens += len(ev.token_ids)
                self.cached_tokens = max(self.cached_tokens, sub.cached_tokens)
                delta = self.text.push(ev.token_ids, final=ev.finish is not None)
                if self.text.stopped:
                    finish = "stop"
                elif ev.finish is not None:
                    finish = _FINISH[m.FinishReason(ev.finish)]
                if self.body.stream and (delta or finish):
                    await self._send(self._chunk(delta, finish))
                else:
                    parts.append(delta)
                if finish:
                    break
        except MeshFailed as exc:
            return await self._fail(502, f"generation failed: {exc}", exc.code.name.lower())
        except TimeoutError as exc:
            return await self._fail(504, str(exc), "timeout")
        except (ClientGone, ConnectionResetError):
            return "client_gone"
        gw.tokens.labels(self.tenant.tenant_id, "prompt").inc(self.prompt_len)
        gw.tokens.labels(self.tenant.tenant_id, "completion").inc(self.completion_tokens)
        if self.body.stream:
            if self.include_usage:
                await self._send(self._envelope([], usage=self._usage()))
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()
        else:
            self.response = web.json_response(self._final("".join(parts), finish or "length"))
        return "finished"

    async def _fail(self, status: int, message: str, code: str) -> str:
        err = ApiError(status, message, type_="server_error", code=code)
        if self.body.stream:
            try:
                await self._send(err.body())
                await self.response.write_eof()
            except ConnectionResetError:
                pass
            return "failed"
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


async def serve(cfg: ServiceConfig) -> None:
    gw = Gateway(cfg)
    gw.rt.install_signal_handlers()
    try:
        await gw.start()
    except BaseException:
        await gw.rt.drain("start failed")
        raise
    await gw.rt.wait_closed()
