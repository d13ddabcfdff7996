"""OpenAI request bodies, validated at the public edge, and the OpenAI error shape.

Bodies decode with msgspec into typed structs: wrong types, unknown fields, invalid UTF-8
and malformed JSON all become an `ApiError` (400) with the offending parameter named.
Parameters the mesh does not implement are accepted only at their neutral value and
otherwise refused with a clear 400, never silently ignored.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from pdmesh.services.engine.grammar import ANY_JSON_OBJECT_SPEC, GrammarError, strict_schema
from pdmesh.services.protocol import messages as m

# The Retry-After of a 503 or 429 whose cause passes on its own and that names no wait of
# its own: admission not answering (restarting), admission's 503 without an estimate, a
# tenant's tokenizer queue full. As admission's for a saturated mesh.
RETRY_AFTER_S = 1.0
MAX_TOKENS_LIMIT = 1 << 20  # anything larger is certainly a mistake; context checks follow
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs (services/engine/sampling.py's too)


class ApiError(Exception):
    """An error answered in the OpenAI shape {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # > 0: answered with a Retry-After header

    def headers(self) -> dict[str, str] | None:
        """`Retry-After` in whole seconds (at least 1), when the error names a wait."""
        if self.retry_after_s <= 0:
            return None
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk


MAX_STOP_TOKEN_IDS = 64


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's `response_format.json_schema` (what `beta.chat.completions.parse` sends)."""

    name: str = ""
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: Any = None  # a JSON schema (an object, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or GBNF
    json_object: bool | None = None


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
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM / SGLang sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Known parameters the mesh does not implement: neutral values only.
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None  # vLLM's: refused (echo with logprobs serves them)


MAX_BATCH_PROMPTS = 64  # prompts one completion request may batch


class CompletionBody(_Common, forbid_unknown_fields=True, kw_only=True):
    # A string, a list of token ids, or a batch: a list of strings or of token-id lists.
    prompt: str | list[Any]
    logprobs: int | None = None  # completions: how many top logprobs (0: the token's own)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    # Unknown fields are tolerated here on purpose: clients echo assistant messages back
    # with whatever the response carried (refusal, audio, annotations: all null here).
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Any = None  # an assistant's earlier calls (gateway/tools.py renders them)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None  # the legacy form: refused when present


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    parameters: Any = None  # a JSON schema object
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str = "function"
    function: FunctionDef


class ChatBody(_Common, forbid_unknown_fields=True, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None  # chat: the sampled tokens' logprobs ...
    top_logprobs: int | None = None  # ... and this many alternatives each
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /tokenize: a completion `prompt` or chat `messages`."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # accepted; pdmesh's prompts never add special tokens
    add_generation_prompt: bool = True


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    tokens: list[int]


_completion_decoder = msgspec.json.Decoder(CompletionBody)
_chat_decoder = msgspec.json.Decoder(ChatBody)
_tokenize_decoder = msgspec.json.Decoder(TokenizeBody)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeBody)


TOO_DEEP = "request body nests arrays or objects too deeply"
MAX_IGNORED_FIELDS = 64  # unknown fields one lenient parse drops before it gives up
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `\$(.*)`)?$")


def _decode(decoder: msgspec.json.Decoder, raw: bytes, lenient: list[str] | None = None
            ) -> Any:
    """`raw` as the decoder's type. `lenient`: drop unknown fields instead of refusing them
    (`--ignore-unknown-fields`), their paths appended to the list."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if lenient is not None and _UNKNOWN.match(msg):
            return _decode_lenient(decoder.type, raw, lenient)
        param = _param_of(msg)
        if msg.startswith("Object contains unknown field") and "at `$" not in msg:
            raise ApiError(400, f"Unrecognized request argument supplied: {param}",
                           param=param) from None
        raise ApiError(400, f"invalid request: {msg}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, TOO_DEEP) from None


def _decode_lenient(typ: Any, raw: bytes, ignored: list[str]) -> Any:
    """Decode generically, then drop each unknown field msgspec names (at any depth) and
    convert again; other errors are answered as in a strict parse."""
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, TOO_DEEP) from None
    for _ in range(MAX_IGNORED_FIELDS):
        try:
            return msgspec.convert(obj, typ)
        except msgspec.ValidationError as exc:
            found = _UNKNOWN.match(str(exc))
            if not found:
                raise ApiError(400, f"invalid request: {exc}", param=_param_of(str(exc))
                               ) from None
            name, path = found.group(1), found.group(2) or ""
            target = _at(obj, path)
            if not isinstance(target, dict) or name not in target:
                raise ApiError(400, f"invalid request: {exc}") from None
            del target[name]
            ignored.append(f"{path.lstrip('.')}.{name}" if path else name)
    raise ApiError(400, f"more than {MAX_IGNORED_FIELDS} unknown fields")


def _at(obj: Any, path: str) -> Any:
    """The value at a msgspec error path (`.tools[0].function`) inside `obj`."""
    for key, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", path):
        try:
            obj = obj[key] if key else obj[int(index)]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _param_of(msg: str) -> str | None:
    """The top-level request field a msgspec validation message is about, if any."""
    if "at `$." in msg:
        return msg.rsplit("at `$.", 1)[1].rstrip("`").split(".")[0].split("[")[0]
    found = re.search(r"field `([^`]+)`", msg)
    return found.group(1) if found else None


def parse_completion(raw: bytes, lenient: list[str] | None = None) -> CompletionBody:
    body: CompletionBody = _decode(_completion_decoder, raw, lenient)
    prompts = prompts_of(body)
    if len(prompts) > 1 and body.stream:
        raise ApiError(400, "stream with several prompts is not supported: send them one "
                       "per request, or without stream", param="stream")
    if body.echo and body.logprobs is not None and body.stream:
        raise ApiError(400, "echo with logprobs is not streamed (the prompt's logprobs come "
                       "with the whole reply)", param="echo")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}",
                       param="logprobs")
    if body.best_of not in (None, 1):
        raise ApiError(400, "'best_of' is not supported", param="best_of")
    if body.suffix:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    _check_common(body)
    return body


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """The request's prompts: one (a string, or a list of token ids) or a batch (a list of
    strings, or a list of token-id lists), each a string or a list of ids."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        out: list[str | list[int]] = list(prompt)
    elif all(isinstance(p, list) for p in prompt):
        out = list(prompt)
    elif all(isinstance(p, int) for p in prompt):
        out = [list(prompt)]
    else:
        raise ApiError(400, "prompt must be a string, a list of token ids, or a list of "
                       "strings or of token-id lists", param="prompt")
    if len(out) > MAX_BATCH_PROMPTS:
        raise ApiError(400, f"at most {MAX_BATCH_PROMPTS} prompts in one request",
                       param="prompt")
    for p in out:
        if isinstance(p, list) and not all(
                isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ApiError(400, "token ids must be integers", param="prompt")
    return out


def parse_tokenize(raw: bytes, lenient: list[str] | None = None) -> TokenizeBody:
    body: TokenizeBody = _decode(_tokenize_decoder, raw, lenient)
    if body.messages is not None:
        _check_messages(body.messages)
        if not body.add_generation_prompt:
            raise ApiError(400, "add_generation_prompt=false is not supported",
                           param="add_generation_prompt")
    return body


def parse_detokenize(raw: bytes) -> DetokenizeBody:
    return _decode(_detokenize_decoder, raw)


def _check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    for msg in messages:
        if msg.role not in ("system", "user", "assistant", "developer", "tool"):
            raise ApiError(400, f"unknown message role {msg.role!r}", param="messages")
        if isinstance(msg.content, list) and any(p.type != "text" for p in msg.content):
            raise ApiError(400, "only text content parts are supported", param="messages")
        if msg.content is None and msg.role != "assistant":
            raise ApiError(400, f"a {msg.role!r} message needs 'content'", param="messages")
        if msg.function_call:
            raise ApiError(400, "function_call messages are not supported (use tool_calls)",
                           param="messages")
        if msg.tool_calls is not None:
            _check_tool_calls(msg)
        if msg.role == "tool" and msg.content is None:
            raise ApiError(400, "a 'tool' message needs 'content'", param="messages")


def _check_tool_calls(msg: ChatMessage) -> None:
    """An assistant message's earlier tool calls, as OpenAI returns them."""
    calls = msg.tool_calls
    ok = msg.role == "assistant" and isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments", ""), str | dict) for c in calls)
    if not ok:
        raise ApiError(400, "tool_calls must be an assistant message's list of {'id', "
                       "'type': 'function', 'function': {'name', 'arguments'}}",
                       param="messages")


def parse_chat(raw: bytes, lenient: list[str] | None = None) -> ChatBody:
    body: ChatBody = _decode(_chat_decoder, raw, lenient)
    _check_messages(body.messages)
    if body.max_completion_tokens is not None:
        if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree",
                           param="max_completion_tokens")
        body.max_tokens = body.max_completion_tokens
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}",
                           param="top_logprobs")
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if not body.add_generation_prompt:
        raise ApiError(400, "add_generation_prompt=false is not supported",
                       param="add_generation_prompt")
    if body.continue_final_message:
        raise ApiError(400, "'continue_final_message' is not supported",
                       param="continue_final_message")
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
    if body.n is not None and body.n < 1:
        raise ApiError(400, "n must be >= 1", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None and not -2.0 <= value <= 2.0:
            raise ApiError(400, f"{name} must be between -2 and 2", param=name)
    if body.top_k is not None and body.top_k < -1:
        raise ApiError(400, "top_k must be -1 or 0 (off) or a positive count", param="top_k")
    if body.min_p is not None and not 0.0 <= body.min_p <= 1.0:
        raise ApiError(400, "min_p must be between 0 and 1", param="min_p")
    if body.repetition_penalty is not None and not 0.0 < body.repetition_penalty <= 2.0:
        raise ApiError(400, "repetition_penalty must be in (0, 2]",
                       param="repetition_penalty")
    if not 0 <= body.min_tokens <= MAX_TOKENS_LIMIT:
        raise ApiError(400, f"min_tokens must be between 0 and {MAX_TOKENS_LIMIT}",
                       param="min_tokens")
    if body.max_tokens is not None and body.min_tokens > body.max_tokens:
        raise ApiError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
    ids = body.stop_token_ids or []
    if len(ids) > MAX_STOP_TOKEN_IDS or any(isinstance(t, bool) or t < 0 for t in ids):
        raise ApiError(400, f"stop_token_ids must be up to {MAX_STOP_TOKEN_IDS} token ids "
                       ">= 0", param="stop_token_ids")
    if body.prompt_logprobs is not None:
        raise ApiError(400, "'prompt_logprobs' is not supported: send echo with logprobs "
                       "(completions) for the prompt's logprobs", param="prompt_logprobs")
    if body.logit_bias:
        logit_bias_of(body)  # checked here; the gateway checks the ids against its vocabulary
    if not -(2**31) <= body.priority < 2**31:
        raise ApiError(400, "priority must fit in 32 bits", param="priority")
    for name, neutral in (("skip_special_tokens", True), ("spaces_between_special_tokens", True),
                          ("include_stop_str_in_output", False), ("use_beam_search", False)):
        if getattr(body, name) != neutral:
            raise ApiError(400, f"'{name}' is only accepted at its default ({neutral!r})",
                           param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")
    if structured_of(body) is not None and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with a structured output (its "
                       "end is the grammar's)", param="ignore_eos")


def structured_of(body: _Common) -> m.Structured | None:
    """The request's structured-output constraint (None: free text), from
    `response_format` or `structured_outputs`; 400 when the two disagree or one is
    malformed. Whether the grammar compiles is checked by the gateway's `Grammars`."""
    found: list[tuple[str, m.Structured]] = []
    rf = body.response_format
    if rf is not None:
        if rf.type == "json_object":
            found.append(("response_format", m.Structured(kind="json",
                                                          spec=ANY_JSON_OBJECT_SPEC)))
        elif rf.type == "json_schema":
            if rf.json_schema is None or not isinstance(rf.json_schema.schema, dict):
                raise ApiError(400, "response_format json_schema needs json_schema.schema, "
                               "a JSON schema object", param="response_format")
            schema = rf.json_schema.schema
            if rf.json_schema.strict:  # OpenAI's strict mode: closed objects, its subset
                try:
                    schema = strict_schema(schema)
                except GrammarError as exc:
                    raise ApiError(400, f"response_format json_schema: {exc}",
                                   param="response_format") from None
                except RecursionError:
                    raise ApiError(400, "response_format json_schema nests too deeply",
                                   param="response_format") from None
            found.append(("response_format", m.Structured(kind="json",
                                                          spec=_json_text(schema))))
        elif rf.type != "text":
            raise ApiError(400, f"response_format type {rf.type!r} is not one of text, "
                           "json_object, json_schema", param="response_format")
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json), ("regex", so.regex),
                                     ("choice", so.choice), ("grammar", so.grammar))
                 if v is not None]
        if so.json_object:
            given.append(("json_object", ANY_JSON_OBJECT_SPEC))
        if len(given) != 1:
            raise ApiError(400, "structured_outputs takes exactly one of json, regex, "
                           "choice, grammar, json_object", param="structured_outputs")
        kind, value = given[0]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise ApiError(400, "structured_outputs.json is not valid JSON",
                                   param="structured_outputs") from None
            if not isinstance(value, dict):
                raise ApiError(400, "structured_outputs.json must be a JSON schema object",
                               param="structured_outputs")
            value = _json_text(value)
        elif kind == "choice":
            value = _json_text(value)
        found.append(("structured_outputs", m.Structured(
            kind="json" if kind == "json_object" else kind, spec=value)))
    if len(found) > 1:
        raise ApiError(400, "give response_format or structured_outputs, not both",
                       param="structured_outputs")
    return found[0][1] if found else None


def _json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


MAX_LOGIT_BIAS = 300  # entries, as OpenAI's limit


def logit_bias_of(body: _Common) -> dict[int, float]:
    """OpenAI's logit_bias ({"<token id>": bias in -100..100}) as token ids."""
    bias = body.logit_bias or {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens",
                       param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 9:
            raise ApiError(400, f"logit_bias keys are token ids, not {key[:20]!r}",
                           param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise ApiError(400, "logit_bias values must be between -100 and 100",
                           param="logit_bias")
        out[int(key)] = float(value)
    return out


def stop_list(body: _Common) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
