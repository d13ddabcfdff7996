"""OpenAI's Responses API (`POST /v1/responses`), text in and text out, streamed or not.

A response request is a chat request underneath: `instructions` becomes the system message,
`input` (a string, or a list of messages whose content is a string or `input_text` /
`output_text` parts) the conversation, `max_output_tokens` the max_tokens; `temperature`,
`top_p`, `seed`-less sampling, `text.format` (text, json_object, json_schema: the
structured outputs' constraint) as in chat. The reply is a `response` object whose output
is one assistant message of one `output_text` part; streamed, the Responses events
(`response.created`, `response.output_text.delta`, ..., `response.completed`), each with its
`sequence_number`. Responses are not stored (`store` is accepted, nothing is kept), so
`previous_response_id`, tools, reasoning and other item types are a 400 that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from pdmesh.gateway.generation import Choice, Generation, _encode
from pdmesh.gateway.schema import (
    ApiError,
    ChatBody,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    _decode,
)


class InputPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str = ""


class InputMessage(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    # Unknown fields tolerated, as chat messages: clients send back output items whole.
    role: str = ""
    content: str | list[InputPart] = ""
    type: str = "message"


class TextFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str = "text"
    name: str = ""
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class TextOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: TextFormat | None = None


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextOptions | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None


_decoder = msgspec.json.Decoder(ResponsesBody)


def parse_responses(raw: bytes, lenient: list[str] | None = None) -> ResponsesBody:
    body: ResponsesBody = _decode(_decoder, raw, lenient)
    for name in ("previous_response_id", "reasoning"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"'{name}' is not supported (responses are not stored, and "
                           "the models served do not reason)", param=name)
    if body.tools or body.tool_choice not in (None, "none", "auto"):
        raise ApiError(400, "tools are not supported on /v1/responses (use chat "
                       "completions)", param="tools")
    if isinstance(body.input, list):
        if not body.input:
            raise ApiError(400, "'input' must not be empty", param="input")
        for item in body.input:
            if item.type != "message" or not item.role:
                raise ApiError(400, f"input items of type {item.type!r} are not supported "
                               "(text messages only)", param="input")
            if isinstance(item.content, list) and any(
                    p.type not in ("input_text", "output_text") for p in item.content):
                raise ApiError(400, "only input_text and output_text parts are supported",
                               param="input")
    elif not body.input:
        raise ApiError(400, "'input' must not be empty", param="input")
    return body


def chat_of(body: ResponsesBody) -> ChatBody:
    """The chat request a response request is, for the gateway's chat path."""
    messages = [ChatMessage(role="system", content=body.instructions)] \
        if body.instructions else []
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
    else:
        for item in body.input:
            text = item.content if isinstance(item.content, str) else "".join(
                p.text for p in item.content)
            messages.append(ChatMessage(role=item.role, content=text))
    fmt = body.text.format if body.text is not None else None
    response_format = None
    if fmt is not None and fmt.type != "text":
        response_format = ResponseFormat(type=fmt.type, json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema, strict=fmt.strict,
            description=fmt.description) if fmt.type == "json_schema" else None)
    return ChatBody(model=body.model, messages=messages, max_tokens=body.max_output_tokens,
                    temperature=body.temperature, top_p=body.top_p, stream=body.stream,
                    stream_options=StreamOptions(include_usage=True) if body.stream
                    else None, user=body.user, response_format=response_format)


class ResponsesGeneration(Generation):
    """A chat generation answered in the Responses API's shape."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.response_id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.seq = 0
        self.text: list[str] = []

    # -- the response object ------------------------------------------------------------
    def _object(self, status: str, text: str) -> dict[str, Any]:
        c = self.choices[0] if self.choices else None
        finish = c.finish if c is not None else None
        incomplete = status == "completed" and finish == "length"
        done = "incomplete" if incomplete else status
        output = [] if status == "in_progress" else [{
            "type": "message", "id": self.item_id, "status": done, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}]
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": done, "model": self.gw.model_name, "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": None, "max_output_tokens": body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "metadata": {},
            "usage": None if status == "in_progress" else {
                "input_tokens": self.prompt_len, "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_len + self.completion_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}}

    def _final(self) -> dict[str, Any]:
        return self._object("completed", "".join(self.choices[0].parts))

    # -- streaming ----------------------------------------------------------------------
    async def _event(self, kind: str, **fields: Any) -> None:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        await self.response.write(f"event: {kind}\ndata: ".encode() + _encode(obj) + b"\n\n")

    async def _send(self, obj: dict[str, Any] | None) -> None:
        if obj is not None:  # a text delta (_chunk's); the rest are written as events
            await self._event("response.output_text.delta", item_id=self.item_id,
                              output_index=0, content_index=0, delta=obj["delta"])

    def _chunk(self, c: Choice, delta: str | dict[str, str], finish: str | None,
               logprobs: Any) -> dict[str, Any] | None:  # type: ignore[override]
        if isinstance(delta, str) and delta:
            self.text.append(delta)
            return {"delta": delta}
        return None

    async def _stream_opened(self) -> None:
        await self._event("response.created", response=self._object("in_progress", ""))
        await self._event("response.in_progress", response=self._object("in_progress", ""))
        await self._event("response.output_item.added", output_index=0, item={
            "type": "message", "id": self.item_id, "status": "in_progress",
            "role": "assistant", "content": []})
        await self._event("response.content_part.added", item_id=self.item_id,
                          output_index=0, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})

    async def _stream_closed(self) -> None:
        text = "".join(self.text)
        final = self._object("completed", text)
        part = {"type": "output_text", "text": text, "annotations": []}
        await self._event("response.output_text.done", item_id=self.item_id, output_index=0,
                          content_index=0, text=text)
        await self._event("response.content_part.done", item_id=self.item_id,
                          output_index=0, content_index=0, part=part)
        await self._event("response.output_item.done", output_index=0,
                          item=final["output"][0])
        await self._event("response.completed" if final["status"] == "completed"
                          else "response.incomplete", response=final)
        await self.response.write_eof()

    async def _fail(self, status: int, message: str, outcome: Any,
                    code: str = "") -> Any:
        if not self.body.stream:
            return await super()._fail(status, message, outcome, code)
        self.outcome = outcome
        try:
            await self._event("error", code=code or outcome.label, message=message,
                              param=None)
            failed = self._object("failed", "".join(self.text))
            failed["error"] = {"code": code or outcome.label, "message": message}
            await self._event("response.failed", response=failed)
            await self.response.write_eof()
        except ConnectionResetError:
            pass
        return outcome


async def handle(gw: Any, request: web.Request) -> web.StreamResponse:
    """`POST /v1/responses` on gateway `gw` (app.Gateway)."""
    gw._refuse_if_draining()
    tenant = gw._auth(request)
    with gw._validating(tenant):
        ignored = gw._lenient()
        body = chat_of(parse_responses(await request.read(), ignored))
        gw._log_ignored(ignored, request)
        gw._check_model(body)
        gw._check_limits(body)
        structured = await gw._structured(body)
        ids = await gw._chat_ids(tenant, body.messages)
    return await gw._generate(request, tenant, body, ids, chat=True, structured=structured,
                              generation=ResponsesGeneration)
