"""The gateway: OpenAI-compatible HTTP + SSE in front of the mesh.

Per request: authenticate (API key -> tenant + server-side cache salt) -> validate the body
-> tokenize (off the event loop: text.TokenizerPool) -> submit to admission (REJECTED
answers 400/429/503 at once) -> stream tokens from decode -> FINISHED. A client that goes
away aborts the request across the mesh. Every error, including 404/405/413 and unexpected
ones, is answered in the OpenAI shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from pdmesh.gateway import responses
from pdmesh.gateway.generation import STREAM_STARTED, Generation, json_response
from pdmesh.gateway.limits import TenantLimiter
from pdmesh.gateway.mesh import (
    MeshClient,
    MeshRejected,
    MeshTooLarge,
    MeshUnavailable,
    WorkerLiveness,
)
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.schema import (
    RETRY_AFTER_S,
    TOO_DEEP,
    ApiError,
    ChatBody,
    CompletionBody,
    logit_bias_of,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
    prompts_of,
    structured_of,
)
from pdmesh.gateway.tenants import Tenant, TenantDirectory
from pdmesh.gateway.text import TENANT_QUEUED_BODIES, TokenizerPool
from pdmesh.gateway.tools import ToolPlan, plan_of, render_messages
from pdmesh.services import faults
from pdmesh.services.admission.policy import context_rejection
from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.engine.checkpoint import load_tokenizer
from pdmesh.services.engine.grammar import GrammarError, Grammars
from pdmesh.services.engine.tokenizer import ChatTemplateError
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import GatewayConfig
from pdmesh.services.runtime.service import ServiceRuntime, ServiceState, run_service, settle
from pdmesh.services.runtime.tracing import end, event

log = logging.getLogger("pdmesh.gateway")

CUT_GRACE_S = 2.0  # at the drain timeout: how long the cut replies get to write their error
# X-Request-Id: a client's own id for its request, echoed on the reply (else the mesh's id is
# sent there) and put on the request's trace and log lines; never the mesh's request id,
# which only the gateway makes (a client's could collide with another tenant's).
REQUEST_ID_HEADER = "X-Request-Id"
MAX_CLIENT_REQUEST_ID = 256
TRACED_PATHS = ("/v1/", "/tokenize", "/detokenize")  # the API, not /health or /ready
CLIENT_REQUEST_ID: Any = (web.RequestKey("pdmesh.client_request_id", str)
                          if hasattr(web, "RequestKey") else "pdmesh.client_request_id")
MESH_REQUEST_ID: Any = (web.RequestKey("pdmesh.request_id", str)
                        if hasattr(web, "RequestKey") else "pdmesh.request_id")
_REJECT_STATUS = {
    m.Code.CONTEXT_LENGTH_EXCEEDED: (400, "context_length_exceeded"),
    m.Code.PROMPT_EXCEEDS_PREFILL_POOL: (400, "context_length_exceeded"),
    m.Code.EXCEEDS_DECODE_POOL: (400, "context_length_exceeded"),
    m.Code.INVALID: (400, "invalid_request"),
    m.Code.SATURATED: (429, "mesh_saturated"),
    m.Code.TENANT_LIMIT: (429, "tenant_kv_share"),  # admission holds tenants to kv_share
    m.Code.NO_WORKERS: (503, "no_workers"),
}


class Gateway:
    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.rt = ServiceRuntime(cfg)
        self.rt.extra_ready = self._workers_ready  # type: ignore[method-assign]
        self.tenants = TenantDirectory.load(cfg.tenants_file, cfg.salt_key)
        # The gateway tokenizes and detokenizes; it needs the tokenizer, not the weights.
        self.tokenizer, derived_name = load_tokenizer(cfg.model)
        # Structured outputs: requests' grammars are compiled here first (a 400 before the
        # mesh sees them); the workers compile their own.
        self.grammars = Grammars(self.tokenizer)
        # Off the event loop, in a bounded pool shared fairly between tenants (text.py).
        self.tokenizers = TokenizerPool(self.tokenizer,
                                        budget=TENANT_QUEUED_BODIES * cfg.max_body_bytes)
        # Clients may send any served name (or --model itself); replies carry the first.
        self.served_names = cfg.served_model_names or [derived_name]
        self.model_name = self.served_names[0]
        self.registry = CapacityRegistry(cfg.worker_ttl_s)
        self.limiter = TenantLimiter()  # each tenant's concurrency and rates (limits.py)
        self.liveness = WorkerLiveness(self.rt, cfg.worker_ttl_s)
        # A test mesh copies the fault header onto the submit (services/faults.py).
        self.submit_headers = faults.gateway_headers(cfg)
        self.bypass_checks = faults.gateway_bypass(cfg)
        # Admission may queue a request up to queue_timeout_s before answering.
        self.metrics = GatewayMetrics(self.rt.registry, self.model_name)
        self.mesh = MeshClient(self.rt, submit_timeout_s=cfg.queue_timeout_s
                               + cfg.reserve_timeout_s + 3.0,
                               on_phase_timing=self.metrics.observe_phases,
                               eos_token_ids=self.tokenizer.eos_token_ids)
        self.version = _version()
        self.generating = 0  # requests between their submit and their reply's end
        self.rt.track_inflight(lambda: self.generating)
        self.rt.on_handoff(self._cut_streams)

    # -- wiring -------------------------------------------------------------------------
    def routes(self, app: web.Application) -> None:
        app.middlewares.append(self._request_id_middleware)
        if self.rt.tracing.enabled:  # no cost when off
            app.middlewares.append(self._tracing_middleware)
        app.middlewares.append(self._errors_middleware)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_get("/version", self.version_info)
        # vLLM's (SageMaker's) liveness ping, and its server load (a key needed: a count of
        # every tenant's requests is no one tenant's to read without one).
        app.router.add_get("/ping", self.ping)
        app.router.add_post("/ping", self.ping)
        app.router.add_get("/load", self.load)

    async def start(self) -> None:
        self.rt.app._client_max_size = self.cfg.max_body_bytes
        self.rt.app.on_cleanup.append(self._close_tokenizers)  # after the last request
        await self.rt.start_http(self.routes)
        await self.rt.connect()
        self.rt.spawn(self.liveness.watch(), "liveness-watch")
        await self.rt.subscribe_heartbeats(m.HEARTBEAT_WILDCARD, self._on_heartbeat)
        self.rt.mark_ready()

    async def _cut_streams(self) -> int:
        """Drain timeout: end every reply still open with an error event (the client may
        retry elsewhere) rather than drop its connection; how many requests were cut."""
        cut = self.generating
        self.mesh.interrupt_all(f"the gateway is shutting down (--drain-timeout-s "
                                f"{self.cfg.drain_timeout_s:g} passed); retry the request")
        await settle(lambda: self.generating, CUT_GRACE_S)
        return cut

    def _refuse_if_draining(self) -> None:
        """A draining gateway takes no new request: 503 with Retry-After, so that a client
        or load balancer goes to another replica."""
        if self.rt.state >= ServiceState.DRAINING:
            raise ApiError(503, "the gateway is draining; retry the request", type_="server_error",
                           code="draining", retry_after_s=1.0)

    async def _close_tokenizers(self, _app: web.Application) -> None:
        self.tokenizers.close()

    async def _on_heartbeat(self, beat: m.Heartbeat, _msg: Any) -> None:
        if beat.role in (m.Role.PREFILL, m.Role.DECODE):
            self.registry.observe(beat)
            self.liveness.observe(beat)  # guard: liveness-hears-draining

    def _workers_ready(self) -> bool:
        return bool(self.registry.views(m.Role.PREFILL)) and bool(
            self.registry.views(m.Role.DECODE))

    @web.middleware
    async def _request_id_middleware(self, request: web.Request,
                                     handler: Any) -> web.StreamResponse:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None:
            problem = client_request_id_problem(given)
            if problem:
                err = ApiError(400, f"{REQUEST_ID_HEADER} {problem}", param=REQUEST_ID_HEADER,
                               code="invalid_request_id")
                return json_response(err.body(), status=400)
            request[CLIENT_REQUEST_ID] = given
        return await handler(request)

    @web.middleware
    async def _tracing_middleware(self, request: web.Request,
                                  handler: Any) -> web.StreamResponse:
        """The request's server span, continuing a client's `traceparent`; admission's and
        the workers' spans hang below it (the submit carries its context)."""
        if not request.path.startswith(TRACED_PATHS):
            return await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else request.path
        with self.rt.tracing.current(
                f"{request.method} {route}", request.headers, kind="server",
                **{"http.request.method": request.method, "url.path": request.path,
                   "http.route": route,
                   "pdmesh.client_request_id": request.get(CLIENT_REQUEST_ID)}) as span:
            resp = await handler(request)
            end(span, error=f"HTTP {resp.status}" if resp.status >= 500 else "",
                **{"http.response.status_code": resp.status,
                   "pdmesh.request_id": request.get(MESH_REQUEST_ID)})
            return resp

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return json_response(exc.body(), status=exc.status, headers=exc.headers())
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: "not_found", 405: "method_not_allowed",
                    413: "request_too_large"}.get(exc.status)
            err = ApiError(exc.status, exc.reason if exc.status != 413 else
                           f"request body exceeds {self.cfg.max_body_bytes} bytes",
                           code=code)
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return json_response(err.body(), status=exc.status, headers=allow)
        except Exception:
            if request.get(STREAM_STARTED):
                raise  # the SSE headers are out: aiohttp can only drop the connection
            log.exception("gateway: unexpected error on %s %s", request.method, request.path)
            err = ApiError(500, "internal error in the gateway", type_="server_error",
                           code="internal_error")
            return json_response(err.body(), status=500)

    # -- endpoints ----------------------------------------------------------------------
    def _auth(self, request: web.Request) -> Tenant:
        tenant = self.tenants.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                           type_="authentication_error")
        return tenant

    def served_context(self) -> int:
        """The largest context a live decode worker serves (0 while none is heard)."""
        return max((v.served_context for v in self.registry.views(m.Role.DECODE)), default=0)

    async def models(self, request: web.Request) -> web.Response:
        self._auth(request)
        # As vLLM: `root` is what was loaded (--model), `parent` null for a base model.
        return json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "pdmesh",
            "root": self.cfg.model, "parent": None, "max_model_len": self.served_context()}
            for name in self.served_names]})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API, text in and out (gateway/responses.py)."""
        return await responses.handle(self, request)

    async def ping(self, request: web.Request) -> web.Response:
        """200 while the gateway takes requests (as /health), else 503."""
        return await self.rt._health_public(request)

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load: how many requests this gateway is serving now."""
        self._auth(request)
        return json_response({"server_load": self.generating})

    async def version_info(self, _request: web.Request) -> web.Response:
        return json_response({"version": self.version})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (as /v1/completions) or `messages` (as chat, with the
        chat template) -> {count, max_model_len, tokens}."""
        tenant = self._auth(request)
        body = parse_tokenize(await request.read(), self._lenient())
        self._check_model(body)
        if body.messages is not None:
            ids = await self._chat_ids(tenant, body.messages)
        elif body.prompt is not None:
            if not body.prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            ids = await self.tokenizers.encode(tenant.tenant_id, body.prompt)
        else:
            raise ApiError(400, "give 'prompt' or 'messages'", param="prompt")
        return json_response({"count": len(ids), "max_model_len": self.served_context(),
                              "tokens": ids, "token_strs": None})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info: what a client needs to tokenize as the server does
        (lm-eval's `tokenizer_backend=remote` reads it, then calls /tokenize)."""
        self._auth(request)
        tok = self.tokenizer
        return json_response({
            "tokenizer_class": type(tok).__name__, "vocab_size": tok.vocab_size,
            "eos_token": getattr(tok, "eos_token", None) or None,
            "bos_token": getattr(tok, "bos_token", None) or None, "pad_token": None,
            "chat_template": getattr(tok, "chat_template", None) or None,
            "model_max_length": self.served_context()})

    async def detokenize(self, request: web.Request) -> web.Response:
        tenant = self._auth(request)
        body = parse_detokenize(await request.read())
        self._check_model(body)
        self._check_ids(body.tokens, "tokens")
        return json_response({"prompt": await self.tokenizers.decode(tenant.tenant_id,
                                                                     body.tokens)})

    @contextlib.contextmanager
    def _validating(self, tenant: Tenant) -> Iterator[None]:
        """Count a request the gateway itself refuses (after auth) as rejected: `invalid`,
        or `saturated` when its tenant has too much in the tokenizer (429)."""
        try:
            yield
        except ApiError as exc:
            code = m.Code.SATURATED if exc.status == 429 else m.Code.INVALID
            self.metrics.request_done(tenant.tenant_id, m.Outcome(
                code=code, detail=exc.message), 0.0)
            raise

    def _check_model(self, body: Any) -> None:
        if body.model not in (*self.served_names, "", self.cfg.model):
            raise ApiError(404, f"The model {body.model!r} does not exist; this mesh serves "
                           f"{self.model_name!r}", code="model_not_found", param="model")

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param=param)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._refuse_if_draining()
        tenant = self._auth(request)
        with self._validating(tenant):
            ignored = self._lenient()
            body = parse_completion(await request.read(), ignored)
            self._log_ignored(ignored, request)
            self._check_model(body)
            self._check_limits(body)
            structured = await self._structured(body)
            batch = [await self._prompt_ids(tenant, p) for p in prompts_of(body)]
        echoes = [self._echo(body, p, ids) for p, ids in zip(prompts_of(body), batch,
                                                              strict=True)]
        if len(batch) == 1:
            return await self._generate(request, tenant, body, batch[0], chat=False,
                                        structured=structured, echo=echoes[0])
        return await self._batch(request, tenant, body, batch, structured, echoes)

    def _echo(self, body: CompletionBody, prompt: str | list[int], ids: list[int]
              ) -> str | None:
        """The prompt's text a reply with `echo` starts with (None: no echo)."""
        if not body.echo:
            return None
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    async def _batch(self, request: web.Request, tenant: Tenant, body: CompletionBody,
                     batch: list[list[int]], structured: m.Structured | None,
                     echoes: list[str | None]) -> web.Response:
        """Batched prompts (a list of them): each its own request through the mesh, all at
        once; one reply whose choices are prompt i's choice j at index i * n + j (as vLLM),
        usage summed. A prompt that fails fails the reply (the others are aborted)."""
        tasks = [asyncio.ensure_future(self._generate(
            request, tenant, body, ids, chat=False, structured=structured, echo=echo))
            for ids, echo in zip(batch, echoes, strict=True)]
        try:
            replies = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        bodies = [json.loads(r.body) for r in replies]  # type: ignore[attr-defined]
        n = body.n or 1
        choices = [{**c, "index": i * n + c["index"]}
                   for i, b in enumerate(bodies) for c in b["choices"]]
        usage: dict[str, Any] = {k: sum(b["usage"][k] for b in bodies)
                                 for k in ("prompt_tokens", "completion_tokens",
                                           "total_tokens")}
        usage["prompt_tokens_details"] = {"cached_tokens": sum(
            b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)}
        request[MESH_REQUEST_ID] = bodies[0]["id"]
        return json_response({**bodies[0], "choices": choices, "usage": usage})

    def _check_limits(self, body: CompletionBody | ChatBody) -> None:
        """The checks that need the gateway's settings or the tokenizer."""
        if (body.n or 1) > self.cfg.max_n:
            raise ApiError(400, f"n must be at most {self.cfg.max_n} (--max-n)", param="n")
        if body.stop_token_ids:
            self._check_ids(body.stop_token_ids, "stop_token_ids")
        self._logit_bias(body)

    async def _prompt_ids(self, tenant: Tenant, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            return await self.tokenizers.encode(tenant.tenant_id, prompt)
        ids = list(prompt)
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        self._check_ids(ids, "prompt")
        return ids

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._refuse_if_draining()
        tenant = self._auth(request)
        with self._validating(tenant):
            ignored = self._lenient()
            body = parse_chat(await request.read(), ignored)
            self._log_ignored(ignored, request)
            self._check_model(body)
            self._check_limits(body)
            tools = self._tool_plan(body)
            structured = await self._structured(body, tools)
            ids = await self._chat_ids(tenant, body.messages, tools)
        return await self._generate(request, tenant, body, ids, chat=True,
                                    structured=structured, tools=tools)

    def _lenient(self) -> list[str] | None:
        """Where a lenient parse lists the fields it dropped (None: unknown fields are a
        400, the default)."""
        return [] if self.cfg.ignore_unknown_fields else None

    @staticmethod
    def _log_ignored(ignored: list[str] | None, request: web.Request) -> None:
        if ignored:  # names only (never values), bounded
            names = ", ".join(n[:64].encode("ascii", "replace").decode() for n in ignored[:16])
            log.warning("gateway: %s ignored unknown request fields: %s%s", request.path,
                        names, " ..." if len(ignored) > 16 else "")

    def _tool_plan(self, body: ChatBody) -> ToolPlan | None:
        try:
            plan = plan_of(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="tool_choice" if "tool_choice" in str(exc)
                           else "tools") from None
        if plan is not None and plan.forced and structured_of(body) is not None:
            raise ApiError(400, "a required or named tool_choice constrains the reply "
                           "itself: it cannot be combined with a structured output",
                           param="tool_choice")
        return plan

    async def _chat_ids(self, tenant: Tenant, chat_messages: list[Any],
                        tools: ToolPlan | None = None) -> list[int]:
        messages: list[dict[str, Any]] = []
        for msg in chat_messages:
            content = msg.content if isinstance(msg.content, str) else "".join(
                p.text for p in (msg.content or []))
            entry: dict[str, Any] = {"role": msg.role, "content": content}
            if msg.tool_calls:
                entry["tool_calls"] = msg.tool_calls
            messages.append(entry)
        renders = bool(getattr(self.tokenizer, "renders_tools", False))
        messages = render_messages(messages, tools, renders)
        template_tools = ([{"type": "function", "function": f} for f in tools.functions]
                          if tools is not None and renders else None)
        # tiny: plain "<|role|>" lines; checkpoints: their own template (gateway/README)
        try:
            return await self.tokenizers.chat(tenant.tenant_id, messages, template_tools)
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}",
                           param="messages") from None

    def max_tokens_for(self, body: CompletionBody | ChatBody, prompt_len: int) -> int:
        """`max_tokens`, or as vLLM without it: the rest of the served context, capped by
        --default-max-tokens (decode reserves prompt + max_tokens of KV up front)."""
        if body.max_tokens is not None:
            return body.max_tokens
        cap = self.cfg.default_max_tokens
        context = self.served_context()
        # No decode worker heard yet, or a prompt that fills the context: admission answers.
        rest = context - prompt_len if context else cap
        return max(1, min(cap, rest), body.min_tokens)

    async def _structured(self, body: CompletionBody | ChatBody,
                          tools: ToolPlan | None = None) -> m.Structured | None:
        """The request's structured-output constraint (or a required tool call's), compiled
        once here (off the event loop: the grammar engine's vocabulary is built on the
        first) so that a grammar that does not compile is a 400 before anything is sent."""
        structured = structured_of(body)
        if structured is None and tools is not None:
            try:
                structured = tools.structured()
            except RecursionError:  # deeply nested parameters: the body's fault
                raise ApiError(400, TOO_DEEP, param="tools") from None
        if structured is not None:
            try:
                await asyncio.to_thread(self.grammars.check, structured)
            except GrammarError as exc:
                raise ApiError(400, str(exc), param="response_format"
                               if body.response_format is not None else "structured_outputs"
                               if body.structured_outputs is not None else "tools") from None
        return structured

    def _logit_bias(self, body: CompletionBody | ChatBody) -> dict[int, float]:
        bias = logit_bias_of(body)
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in bias):
            raise ApiError(400, f"logit_bias token ids must be in 0..{vocab - 1}",
                           param="logit_bias")
        return bias

    def sampling_for(self, body: CompletionBody | ChatBody, ids: list[int],
                     seed: int, structured: m.Structured | None = None) -> m.Sampling:
        rep = 1.0 if body.repetition_penalty is None else body.repetition_penalty
        return m.Sampling(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p or 1.0, seed=seed,
            top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
            repetition_penalty=rep, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos, stop_token_ids=list(body.stop_token_ids or []),
            logprobs=body.logprobs_k,
            penalty_prompt_ids=sorted(set(ids)) if rep != 1.0 else [], structured=structured,
            logit_bias=self._logit_bias(body),
            # echo with logprobs: the prompt's own logprobs too (lm-eval's loglikelihood)
            prompt_logprobs=body.logprobs if isinstance(body, CompletionBody)
            and body.echo and body.logprobs is not None else None)

    async def _generate(self, request: web.Request, tenant: Tenant,
                        body: CompletionBody | ChatBody, ids: list[int],
                        chat: bool, structured: m.Structured | None = None,
                        tools: ToolPlan | None = None, echo: str | None = None,
                        generation: type[Generation] = Generation) -> web.StreamResponse:
        t0 = time.monotonic()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        request[MESH_REQUEST_ID] = rid
        span = self.rt.tracing.active()  # the request's server span (None: tracing off)
        max_tokens = self.max_tokens_for(body, len(ids))
        # One seed per request, chosen here when the client gives none, so prefill (first
        # token) and decode (the rest) sample from the same stream; choice i uses seed + i.
        seed = body.seed if body.seed is not None else secrets.randbits(62)
        n = body.n or 1
        outcome = m.Outcome(code=m.Code.INTERNAL, detail="gateway error")
        gen: Generation | None = None
        metrics = self.metrics
        metrics.waiting.labels(self.model_name).inc()
        try:
            # Over the served context: answered here, before any control message, so that
            # no prompt size can make a submit exceed NATS's max payload (admission applies
            # the same rule to what gets through: the context may shrink meanwhile).
            over = context_rejection(  # guard: gateway-context
                len(ids), max_tokens, self.served_context() or 1 << 62)
            if over is not None and not self.bypass_checks(request.headers):
                raise MeshRejected(m.Rejected(
                    request_id=rid, outcome=m.Outcome(code=over.reason, detail=over.message),
                    prompt_len=len(ids), max_tokens=max_tokens, limit=over.limit))
            headers = self.submit_headers(request.headers) if self.submit_headers else None
            samplings = [self.sampling_for(body, ids, _seed_of(seed, i), structured)
                         for i in range(n)]
            rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
            limits = tenant.limits
            # One submit for every choice: admission reserves all of them or none.
            req = m.SubmitRequest(
                request_id=rids[0], tenant=tenant.tenant_id, cache_salt=tenant.cache_salt,
                prompt_ids=ids, max_tokens=max_tokens, sampling=samplings[0],
                stream_key=streamauth.new_key(), weight=limits.weight,
                kv_share=limits.kv_share, priority=body.priority, choices=[
                    m.SubmitChoice(request_id=r, stream_key=streamauth.new_key(), sampling=s)
                    for r, s in zip(rids[1:], samplings[1:], strict=True)])
            try:
                self.limiter.admit(tenant, n, n * (len(ids) + max_tokens))
            except ApiError as exc:
                outcome = m.Outcome(code=m.Code.TENANT_LIMIT, detail=exc.message)
                raise
            self.generating += 1
            try:
                async with self.mesh.submit(req, headers) as subs:
                    queued = subs[0].queued_s
                    metrics.queue_time.labels(self.model_name).observe(
                        queued if queued is not None else time.monotonic() - t0)
                    gen = generation(self, request, tenant, body, rid, len(ids), chat, t0,
                                     req, tools, echo)
                    try:
                        outcome = await gen.run(subs)
                    finally:
                        outcome = gen.outcome or outcome  # also when run() raised 502/504
                    return gen.response
            finally:
                self.generating -= 1
                self.limiter.release(tenant.tenant_id, n)
        except MeshRejected as exc:
            status, code = _REJECT_STATUS.get(exc.outcome.code, (400, "invalid_request"))
            outcome = exc.outcome
            raise ApiError(status, exc.outcome.detail, code=code,
                           param="messages" if chat else "prompt",
                           type_="invalid_request_error" if status == 400 else
                           "rate_limit_error" if status == 429 else "server_error",
                           retry_after_s=exc.retry_after_s or (
                               RETRY_AFTER_S if status in (429, 503) else 0.0)) from None
        except MeshTooLarge as exc:
            log.warning("gateway: %s: %s", exc.request_id, exc)
            outcome = m.Outcome(code=m.Code.INVALID, detail=str(exc))
            raise ApiError(413, str(exc), code="request_too_large",
                           param="messages" if chat else "prompt") from None
        except MeshUnavailable as exc:
            outcome = m.Outcome(code=m.Code.NO_WORKERS, detail=str(exc))
            raise ApiError(503, f"the mesh is not answering: {exc}", type_="server_error",
                           code="no_workers", retry_after_s=RETRY_AFTER_S) from None
        finally:
            running = gen is not None and bool(gen.choices) and (
                gen.choices[0].first_at is not None)
            (metrics.running if running else metrics.waiting).labels(self.model_name).dec()
            metrics.request_done(tenant.tenant_id, outcome, time.monotonic() - t0,
                                 admitted=gen is not None)
            if span is not None:
                _trace_reply(span, rid, tenant, len(ids), max_tokens, outcome, gen,
                             self.model_name)


def client_request_id_problem(value: str) -> str:
    """What is wrong with a client's X-Request-Id ("" if nothing): 1 to 256 visible ASCII
    characters, so that it can go on log lines and trace attributes as it is."""
    if not 0 < len(value) <= MAX_CLIENT_REQUEST_ID:
        return f"must be 1 to {MAX_CLIENT_REQUEST_ID} characters long"
    if not all("!" <= ch <= "~" for ch in value):
        return "must be visible ASCII characters (no spaces or control characters)"
    return ""


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Every reply names its request: the client's X-Request-Id, or the mesh's id."""
    rid = request.get(CLIENT_REQUEST_ID) or request.get(MESH_REQUEST_ID)
    if rid:
        response.headers[REQUEST_ID_HEADER] = rid


def _trace_reply(span: Any, rid: str, tenant: Tenant, prompt_len: int, max_tokens: int,
                 outcome: m.Outcome, gen: Generation | None, model_name: str) -> None:
    """The request's figures on its server span: ids, token counts, how it ended, and
    when its first and last tokens went out."""
    span.set_attributes({"pdmesh.request_id": rid, "pdmesh.tenant": tenant.tenant_id,
                         "gen_ai.request.model": model_name,
                         "gen_ai.request.max_tokens": max_tokens,
                         "gen_ai.usage.input_tokens": prompt_len,
                         "pdmesh.outcome": outcome.label})
    if gen is None:
        return
    span.set_attribute("gen_ai.usage.output_tokens", gen.completion_tokens)
    for c in gen.choices:
        if c.first_at is not None:
            event(span, "first_token", at=c.first_at, choice=c.index)
        if c.last_at is not None:
            event(span, "last_token", at=c.last_at, choice=c.index,
                  tokens=c.completion_tokens, finish_reason=c.finish)
        if c.resumes:
            span.set_attribute(f"pdmesh.choice.{c.index}.resumes", c.resumes)


def _seed_of(seed: int, index: int) -> int:
    """Choice `index`'s seed (choice 0 keeps the request's), within msgspec's int64."""
    value = seed + index
    return value - (1 << 64) if value >= 1 << 63 else value


def _version() -> str:
    try:
        return importlib.metadata.version("pdmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def serve(cfg: GatewayConfig) -> None:
    gw = Gateway(cfg)
    await run_service(gw.rt, gw.start)
