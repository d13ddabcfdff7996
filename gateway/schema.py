"""OpenAI request bodies, validated at the public edge, and the OpenAI error shape.

Bodies decode with msgspec into typed structs: wrong types, unknown fields, invalid UTF-8
and malformed JSON all become an `ApiError` (400) with the offending parameter named.
Parameters the mesh does not implement are accepted only at their neutral value and
otherwise refused with a clear 400, never silently ignored.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

MAX_TOKENS_LIMIT = 1 << 20  # anything larger is certainly a mistake; context checks follow


class ApiError(Exception):
    """An error answered in the OpenAI shape {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known OpenAI parameters the mesh does not implement: neutral values only.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None


class CompletionBody(_Common, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[int | str]
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    # Unknown fields are tolerated here on purpose: clients echo assistant messages back
    # with whatever the response carried (refusal, audio, annotations: all null here).
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # known and unsupported: refused when present
    function_call: Any = None


class ChatBody(_Common, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)


def _decode(decoder: msgspec.json.Decoder, raw: bytes) -> Any:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        param = _param_of(msg)
        if msg.startswith("Object contains unknown field") and "at `$" not in msg:
            raise ApiError(400, f"Unrecognized request argument supplied: {param}",
                           param=param) from None
        raise ApiError(400, f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def _param_of(msg: str) -> str | None:
    """The top-level request field a msgspec validation message is about, if any."""
    if "at `$." in msg:
        return msg.rsplit("at `$.", 1)[1].rstrip("`").split(".")[0].split("[")[0]
    found = re.search(r"field `([^`]+)`", msg)
    return found.group(1) if found else None


def parse_completion(raw: bytes) -> CompletionBody:
    body: CompletionBody = _decode(_completion_decoder, raw)
    if isinstance(body.prompt, list):
        strs = [p for p in body.prompt if isinstance(p, str)]
        if strs and (len(strs) != len(body.prompt) or len(strs) != 1):
            raise ApiError(400, "prompt must be a string, one string in a list, or a list "
                           "of token ids (batched prompts are not supported)", param="prompt")
        if any(isinstance(p, bool) for p in body.prompt):
            raise ApiError(400, "token ids must be integers", param="prompt")
    for name in ("echo",):
        if getattr(body, name):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    if body.best_of not in (None, 1):
        raise ApiError(400, "'best_of' is not supported", param="best_of")
    if body.suffix:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    _check_common(body)
    return body


def parse_chat(raw: bytes) -> ChatBody:
    body: ChatBody = _decode(_chat_decoder, raw)
    if not body.messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    for msg in body.messages:
        if msg.role not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"unknown message role {msg.role!r}", param="messages")
        if isinstance(msg.content, list) and any(p.type != "text" for p in msg.content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        if msg.content is None and msg.role != "assistant":
            raise ApiError(400, f"a {msg.role!r} message needs 'content'", param="messages")
        if msg.tool_calls or msg.function_call:
            raise ApiError(400, "tool and function calls are not supported",
                           param="messages")
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree",
                           param="max_completion_tokens")
        body.max_tokens = body.max_completion_tokens
    _check_common(body)
    return body


def _check_common(body: _Common) -> None:
    if body.max_tokens is not None and not 1 <= body.max_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"max_tokens must be between 1 and {MAX_TOKENS_LIMIT}",
                       param="max_tokens")
    if body.temperature is not None and not 0.0 <= body.temperature <= 2.0:
        raise ApiError(400, "temperature must be between 0 and 2", param="temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    if body.seed is not None and not -(2**63) <= body.seed < 2**63:
        raise ApiError(400, "seed must fit in 64 bits", param="seed")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop must be up to 4 non-empty strings", param="stop")
    if body.n not in (None, 1):
        raise ApiError(400, "only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"'{name}' is not supported", param=name)
    if body.logit_bias:
        raise ApiError(400, "'logit_bias' is not supported", param="logit_bias")
    # `is` on purpose: logprobs=0 on completions asks for the sampled token's logprob.
    if (body.logprobs is not None and body.logprobs is not False) or body.top_logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")


def stop_list(body: _Common) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
