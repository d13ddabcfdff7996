"""One admitted request's reply: JSON at the end, or SSE chunks as tokens arrive.

Streaming replies follow OpenAI's shape: `text_completion` or `chat.completion.chunk`
objects, the chat role first, `finish_reason` on the last content chunk of each choice,
then (with `stream_options.include_usage`) a chunk with empty `choices` and the `usage`,
then `data: [DONE]`. A failure after the headers went out is sent as an OpenAI error object
in the stream; before that it is raised as an `ApiError` for the middleware.

With `n` > 1 each choice is its own request through the mesh (its own submission, seed
`seed + index`), read concurrently; their chunks interleave on one stream, each with its
`index`. Every chunk and response is encoded with msgspec.

A choice whose worker is lost (`messages.RESUMABLE`: it died, was cut off, or drained
past its timeout) is resumed, up to MAX_RESUMES times: submitted again as the prompt plus
the tokens this choice has delivered, for the rest of `max_tokens`, with the sampler's
token index and counts carried on (`Sampling.start_index`, `prior_output_ids`) and the
lost worker avoided; the new stream's tokens continue the client's, whose text state
(stop-string hold-back included) never left the gateway. The engine's batch invariance
and the per-index seeding make the continuation the tokens the first workers would have
given (docs/DESIGN.md, "No admitted request lost").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiohttp import web

from pdmesh.gateway.mesh import (
    ClientGone,
    MeshClient,
    MeshFailed,
    MeshRejected,
    MeshTooLarge,
    MeshUnavailable,
    Submission,
    WorkerLiveness,
)
from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.gateway.schema import ApiError, ChatBody, CompletionBody, stop_list
from pdmesh.gateway.tenants import Tenant
from pdmesh.gateway.text import TextStream
from pdmesh.gateway.tools import ToolPlan, ToolStream, parse_reply
from pdmesh.services.engine.tokenizer import Tokenizer
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.runtime.config import GatewayConfig

log = logging.getLogger("pdmesh.gateway")
MAX_RESUMES = 3  # a choice is resumed on other workers at most this many times
# A lost worker heard again this long after the loss is back (restarted or reconnected),
# not a heartbeat that was already on its way when it died.
BACK_AFTER_S = 1.0
# Echo with logprobs: prefill's PromptLogprobs may trail decode's last token by this long.
PROMPT_LOGPROBS_WAIT_S = 5.0

# Request key: the SSE headers are out. aiohttp >= 3.14 has typed request keys and warns on
# plain strings; older releases have neither.
STREAM_STARTED: Any = (web.RequestKey("pdmesh.stream_started", bool)
                       if hasattr(web, "RequestKey") else "pdmesh.stream_started")
TokenLogprobs = tuple[float, list[tuple[int, float]]]  # one TokenEvent.logprobs entry
_encode = msgspec.json.Encoder().encode


def json_response(obj: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded with msgspec (the gateway's one JSON encoder)."""
    return web.Response(body=_encode(obj), status=status, headers=headers,
                        content_type="application/json")


class Serving(Protocol):
    """What a Generation uses of the gateway serving it (`app.Gateway`), named here so that
    this module need not import the app that imports it."""

    cfg: GatewayConfig
    tokenizer: Tokenizer
    model_name: str
    mesh: MeshClient
    metrics: GatewayMetrics
    liveness: WorkerLiveness


@dataclass(eq=False)
class Choice:
    """One choice of the reply: its submission, text and logprobs so far."""

    index: int
    sub: Submission
    text: TextStream
    parts: list[str] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    logprobs: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    first_at: float | None = None
    last_at: float | None = None
    origin: m.SubmitChoice | None = None  # the choice as first submitted
    delivered: list[int] = field(default_factory=list)  # token ids the client has got
    resumes: int = 0
    lost: dict[str, float] = field(default_factory=dict)  # workers this choice lost: when
    lost_at: float | None = None  # when the last loss was noticed (until its next token)
    tools: ToolStream | None = None  # a streamed reply with tools: what may be shown yet


class Generation:
    """One admitted request's reply: JSON at the end, or SSE chunks as tokens arrive."""

    def __init__(self, gw: Serving, request: web.Request, tenant: Tenant,
                 body: CompletionBody | ChatBody, rid: str, prompt_len: int, chat: bool,
                 t0: float, submit: m.SubmitRequest, tools: ToolPlan | None = None,
                 echo: str | None = None) -> None:
        self.gw, self.request, self.tenant, self.body = gw, request, tenant, body
        self.tools = tools  # the request's tool plan (chat only; gateway/tools.py)
        self.echo = echo  # completions' `echo`: the prompt's text, before each choice's
        # echo with logprobs: the prompt's own token logprobs, per choice, before its own
        self.prompt_lps: dict[int, list[tuple[float, list[tuple[int, float]]]]] = {}
        self.rid, self.prompt_len, self.chat, self.t0 = rid, prompt_len, chat, t0
        self.submit = submit  # what a resume submits again
        self.resumed = contextlib.AsyncExitStack()  # the resumed choices' submissions
        self.created = int(time.time())
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far.
        self.continuous_usage = self.include_usage and bool(
            body.stream_options and body.stream_options.continuous_usage_stats)
        self.want_logprobs = body.logprobs_k is not None
        self.response: web.StreamResponse = web.Response()
        self.choices: list[Choice] = []
        self.outcome: m.Outcome | None = None  # how the request ended, once it has

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return max((c.sub.cached_tokens for c in self.choices), default=0)

    def _alive(self) -> bool:
        transport = self.request.transport
        return transport is not None and not transport.is_closing()

    async def _dead_worker(self, sub: Submission) -> str:
        """Name of a worker serving this request that stopped heartbeating, or ""."""
        # Prefill matters only until its KV has arrived (the first token comes with it).
        workers = [sub.decode_worker] if sub.got_first_token else [sub.decode_worker,
                                                                   sub.prefill_worker]
        return await self.gw.liveness.dead(workers)

    async def run(self, subs: list[Submission]) -> m.Outcome:
        gw = self.gw
        stops = stop_list(self.body)
        req = self.submit
        origins = [m.SubmitChoice(request_id=req.request_id, stream_key=req.stream_key,
                                  sampling=req.sampling), *req.choices]
        self.choices = [Choice(i, sub, TextStream(gw.tokenizer, stops), origin=origin,
                               tools=ToolStream(self.tools) if self.tools and self.body.stream
                               else None)
                        for i, (sub, origin) in enumerate(zip(subs, origins, strict=True))]
        async with self.resumed:
            return await self._run()

    async def _run(self) -> m.Outcome:
        if self.body.stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            await resp.prepare(self.request)
            self.request[STREAM_STARTED] = True
            self.response = resp
            await self._stream_opened()
        tasks = [asyncio.ensure_future(self._read(c)) for c in self.choices]
        try:
            await asyncio.gather(*tasks)
        except MeshFailed as exc:
            # A worker's own liveness limit (decode: no progress from prefill) is the same
            # answer as the gateway's: 504 `deadline`; any other failure is a 502.
            status = 504 if exc.code == m.Code.DEADLINE else 502
            return await self._fail(status, f"generation failed: {exc}", exc.outcome)
        except TimeoutError as exc:  # RequestStalled: the gateway's own liveness limit
            return await self._fail(504, str(exc), m.Outcome(code=m.Code.DEADLINE,
                                                             detail=str(exc)))
        except (ClientGone, ConnectionResetError):
            self.outcome = m.Outcome(code=m.Code.ABORTED, detail="client gone")
            return self.outcome
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._observe_finished()
        if self.body.stream:
            await self._stream_closed()
        else:
            if self.echo is not None and self.want_logprobs:
                for c in self.choices:
                    lps = await self.gw.mesh.prompt_logprobs(
                        c.sub, len(self.submit.prompt_ids), PROMPT_LOGPROBS_WAIT_S)
                    if lps is None:
                        return await self._fail(502, "the prompt's logprobs did not all come "
                                                "from prefill", m.Outcome(
                                                    code=m.Code.INTERNAL,
                                                    detail="prompt logprobs missing"))
                    self.prompt_lps[c.index] = lps
            self.response = json_response(self._final())
        first = self.choices[0].finish
        self.outcome = m.FINISHED_LENGTH if first == "length" else m.FINISHED_STOP
        return self.outcome

    async def _stream_opened(self) -> None:
        """The first events of a stream: chat's role delta, or the echoed prompt."""
        if self.chat:
            for c in self.choices:
                await self._send(self._chunk(c, {"role": "assistant", "content": ""},
                                             None, []))
        elif self.echo:
            for c in self.choices:
                await self._send(self._chunk(c, self.echo, None, []))

    async def _stream_closed(self) -> None:
        """A stream that finished: the usage chunk (when asked for), then `[DONE]`."""
        if self.include_usage:
            await self._send(self._envelope([], usage=self._usage()))
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def _read(self, c: Choice) -> None:
        """Read one choice's token events to its end, resuming it elsewhere when a worker
        serving it is lost."""
        while True:
            try:
                await self._read_stream(c)
                return
            except MeshFailed as exc:
                if exc.code not in m.RESUMABLE:
                    raise
                await self._resume(c, exc)

    async def _resume(self, c: Choice, exc: MeshFailed) -> None:
        """Submit the choice again from the tokens it delivered, avoiding the lost worker;
        raises MeshFailed (naming the loss and why no resume) when none can be made."""
        gw, lost, old = self.gw, exc.outcome, c.sub
        role = ("prefill" if lost.worker and lost.worker == old.prefill_worker
                and lost.worker != old.decode_worker else "decode")
        worker = lost.worker or (old.decode_worker if old.got_first_token
                                 else old.prefill_worker)
        c.lost_at = time.monotonic()
        if worker:
            c.lost[worker] = c.lost_at
        await gw.mesh.let_go(old)  # the old workers free what they hold now
        why = ""
        if c.resumes >= MAX_RESUMES:
            why = f"it was resumed {MAX_RESUMES} times already"
        else:
            c.resumes += 1
            req = self._resubmission(c)
            try:
                # Without the fault header of a test mesh: it models the lost worker.
                subs = await self.resumed.enter_async_context(gw.mesh.submit(req))
            except MeshRejected as rej:
                why = f"no worker could take it ({rej.outcome.label}: {rej.outcome.detail})"
                gw.metrics.migration_failed.labels(gw.model_name, rej.outcome.label).inc()
            except (MeshUnavailable, MeshTooLarge) as err:
                why = f"admission did not take it: {err}"
                gw.metrics.migration_failed.labels(gw.model_name, "no_workers").inc()
            else:
                sub = subs[0]
                again = {sub.prefill_worker, sub.decode_worker} & set(self._avoid(c))
                # An admission that ignores avoid_workers.
                if again:  # guard: resume-avoids-lost
                    await gw.mesh.let_go(sub)
                    why = f"admission placed it on lost worker {sorted(again)[0]} again"
                    gw.metrics.migration_failed.labels(gw.model_name, "no_workers").inc()
            if not why:
                sub.max_tokens, sub.tokens_out = old.max_tokens, len(c.delivered)
                sub.cached_tokens = max(sub.cached_tokens, old.cached_tokens)
                sub.prompt_logprobs.update(old.prompt_logprobs)  # positions are the same
                c.sub = sub
                gw.metrics.migrated.labels(gw.model_name, role, lost.label).inc()
                log.info("gateway: %s resumed as %s after %d tokens (%s lost: %s; now "
                         "prefill %s, decode %s)", old.request_id, sub.request_id,
                         len(c.delivered), role, lost.detail, sub.prefill_worker,
                         sub.decode_worker)
                return
        log.warning("gateway: %s not resumed after losing %s: %s", old.request_id, worker,
                    why)
        raise MeshFailed(m.Outcome(code=lost.code, worker=lost.worker,
                                   detail=f"{lost.detail}; not resumed: {why}"))

    def _resubmission(self, c: Choice) -> m.SubmitRequest:
        """The choice as a new request: prompt + what it delivered, the rest of max_tokens,
        its sampler's state carried on, away from the workers it lost."""
        req, origin = self.submit, c.origin
        assert origin is not None
        done = list(c.delivered)
        sampling = origin.sampling
        # The sampler's counts (penalties) and grammar state (structured outputs) go on from
        # the delivered tokens.
        stateful = (sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0
                    or sampling.frequency_penalty != 0.0 or sampling.structured is not None)
        sampling = msgspec.structs.replace(
            sampling, start_index=sampling.start_index + len(done),  # guard: resume-carries-state
            prior_output_ids=[*sampling.prior_output_ids, *done] if stateful else [])
        return m.SubmitRequest(
            request_id=f"{origin.request_id}-r{c.resumes}", tenant=req.tenant,
            cache_salt=req.cache_salt, prompt_ids=[*req.prompt_ids, *done],
            max_tokens=req.max_tokens - len(done), sampling=sampling,
            stream_key=streamauth.new_key(), weight=req.weight, kv_share=req.kv_share,
            avoid_workers=self._avoid(c), resumes=origin.request_id, priority=req.priority)

    def _avoid(self, c: Choice) -> list[str]:
        """The workers this choice lost that have not heartbeated since (a restarted or
        reconnected one, heard again, may take it)."""
        heard = self.gw.liveness.heard_since
        return sorted(w for w, at in c.lost.items() if not heard(w, at + BACK_AFTER_S))

    async def _read_stream(self, c: Choice) -> None:
        """Read the choice's current stream to its end, streaming chunks as they come."""
        gw = self.gw
        min_tokens = self.body.min_tokens
        itl = gw.metrics.itl.labels(gw.model_name, self.tenant.tenant_id)
        async for ev in gw.mesh.tokens(c.sub, gw.cfg.prefill_stall_s, gw.cfg.request_timeout_s,
                                       self._alive, self._dead_worker):
            now = time.monotonic()
            c.delivered.extend(ev.token_ids)
            if c.lost_at is not None:
                gw.metrics.migration_gap.labels(gw.model_name).observe(
                    now - (c.last_at or c.lost_at))
                c.lost_at = None
            if ev.decode_first_token_s is not None:
                gw.metrics.observe_decode_first_token(ev.decode_first_token_s)
            if c.first_at is None:
                c.first_at = now
                if c.index == 0:
                    gw.metrics.ttft.labels(gw.model_name, self.tenant.tenant_id).observe(
                        now - self.t0)
                    if c.sub.admitted_at is not None:
                        gw.metrics.prefill_time.labels(gw.model_name).observe(
                            now - c.sub.admitted_at)
                    gw.metrics.waiting.labels(gw.model_name).dec()
                    gw.metrics.running.labels(gw.model_name).inc()
            else:
                itl.observe(now - (c.last_at or now))
            c.last_at = now
            c.completion_tokens += len(ev.token_ids)
            if self.want_logprobs:
                lps = ev.logprobs or (c.sub.first_logprobs if ev.seq == 0 else [])
                c.logprobs.extend(zip(ev.token_ids, lps, strict=False))
            delta = c.text.push(ev.token_ids, final=ev.finish is not None,
                                check_stops=c.completion_tokens >= min_tokens)
            if c.text.stopped:
                c.finish, c.stop_reason = "stop", c.text.stop_string
            elif ev.finish is not None:
                c.finish = ev.finish.label  # "stop" | "length", as OpenAI spells them
                last = ev.token_ids[-1] if ev.token_ids else None
                if c.finish == "stop" and last not in gw.tokenizer.eos_token_ids:
                    c.stop_reason = last  # one of stop_token_ids, as vLLM reports it
            if self.body.stream:
                if c.tools is not None:  # it sends what may be shown, and the calls
                    if await self._tool_chunks(c, delta):
                        return
                elif delta or c.finish or (self.want_logprobs and c.logprobs):
                    await self._send(self._chunk(c, delta, c.finish, c.logprobs))
                    c.logprobs = []
            else:
                c.parts.append(delta)
            if c.finish:
                return

    async def _tool_chunks(self, c: Choice, delta: str) -> bool:
        """A streamed reply with tools: send what may be shown of `delta` now; at its end,
        the tool calls, one delta each, and finish `tool_calls`. True when the calls went
        out (the choice is done)."""
        assert c.tools is not None
        shown = c.tools.push(delta)
        calls: list[dict[str, Any]] = []
        if c.finish:
            rest, calls = c.tools.finish()
            shown += rest
        if not calls:
            if shown or c.finish or (self.want_logprobs and c.logprobs):
                await self._send(self._chunk(c, shown, c.finish, c.logprobs))
                c.logprobs = []
            return bool(c.finish)
        if shown or (self.want_logprobs and c.logprobs):
            await self._send(self._chunk(c, shown, None, c.logprobs))
            c.logprobs = []
        if c.finish == "stop":
            c.finish = "tool_calls"
        for i, call in enumerate(calls):
            await self._send(self._chunk(c, {"tool_calls": [{"index": i, **call}]},
                                         c.finish if i == len(calls) - 1 else None, []))
        return True

    def _observe_finished(self) -> None:
        gw = self.gw
        name = gw.model_name
        gw.metrics.tokens_done(self.tenant.tenant_id, self.prompt_len, self.completion_tokens)
        first = self.choices[0]
        if first.first_at is not None and first.last_at is not None:
            gw.metrics.decode_time.labels(name).observe(first.last_at - first.first_at)

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
        await self.response.write(b"data: " + _encode(obj) + b"\n\n")

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

    def _chunk(self, c: Choice, delta: str | dict[str, str], finish: str | None,
               logprobs: list[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        lp = self._logprobs(logprobs) if self.want_logprobs and logprobs else None
        if self.chat:
            d = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": c.index, "delta": d, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": c.index, "text": delta, "finish_reason": finish,
                      "logprobs": lp}
        if finish:
            choice["stop_reason"] = c.stop_reason
        return self._envelope([choice], self._usage() if self.continuous_usage else None)

    def _final(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            text = "".join(c.parts)
            lp = self._logprobs(c.logprobs) if self.want_logprobs else None
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tools is not None:
                    content, calls = parse_reply(text, self.tools)
                    if calls:
                        message = {"role": "assistant", "content": content,
                                   "tool_calls": calls}
                        if c.finish == "stop":
                            c.finish = "tool_calls"
                choice = {"index": c.index, "message": message,
                          "finish_reason": c.finish or "length", "logprobs": lp}
            else:
                if c.index in self.prompt_lps and lp is not None:
                    lp = self._echo_logprobs(self.prompt_lps[c.index], lp)
                choice = {"index": c.index, "text": (self.echo or "") + text,
                          "finish_reason": c.finish or "length", "logprobs": lp}
            choice["stop_reason"] = c.stop_reason
            choices.append(choice)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.gw.model_name, "choices": choices,
                "usage": self._usage()}

    def _logprobs(self, entries: list[tuple[int, TokenLogprobs]]) -> dict[str, Any]:
        """OpenAI's logprobs object for these (token id, (logprob, top)) entries: chat's
        `content` list, or completions' parallel lists."""
        piece = self._token_str
        if self.chat:
            return {"content": [{
                "token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
                "top_logprobs": [{"token": piece(i), "logprob": v,
                                  "bytes": list(piece(i).encode())} for i, v in top]}
                for t, (lp, top) in entries]}
        tokens = [piece(t) for t, _ in entries]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _) in entries],
                "top_logprobs": [{piece(i): v for i, v in top} for _, (_, top) in entries],
                "text_offset": offsets}

    def _echo_logprobs(self, prompt: list[tuple[float, list[tuple[int, float]]]],
                       reply: dict[str, Any]) -> dict[str, Any]:
        """Completions' logprobs with the prompt's in front, as vLLM's echo: the first
        prompt token has none (null), then each prompt token given those before it."""
        ids = self.submit.prompt_ids
        pieces = [self._token_str(t) for t in ids]
        tokens = pieces + reply["tokens"]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens,
                "token_logprobs": [None] + [lp for lp, _ in prompt] + reply["token_logprobs"],
                "top_logprobs": [None] + [{self._token_str(i): v for i, v in top}
                                          for _, top in prompt] + reply["top_logprobs"],
                "text_offset": offsets}

    def _token_str(self, token_id: int) -> str:
        return self.gw.tokenizer.decode([token_id])
