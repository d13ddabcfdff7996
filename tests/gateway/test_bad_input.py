"""Bad input at the public edge (I8): every malformed request is a 4xx in the OpenAI error
shape, none is a 500 or a crash, and the mesh serves a good request afterwards."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.support.meshproc import Mesh
from tests.support.oracle import expected_text

ANY = object()
GOOD = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 4, "temperature": 0}
BIG_BODY_BYTES = 4 * 1024 * 1024 + 1024  # over the default --max-body-bytes (4 MiB)


@dataclass
class Case:
    name: str
    body: Any = None  # a JSON-able object, or raw bytes sent as they are
    status: int = 400
    param: Any = ANY
    code: Any = ANY
    path: str = "/v1/completions"
    method: str = "POST"
    key: str | None = "sk-dev-alice"
    headers: dict[str, str] = field(default_factory=dict)


def comp(**changes: Any) -> dict[str, Any]:
    """The good completion body with some fields changed (None value: field removed)."""
    body = {**GOOD, **changes}
    return {k: v for k, v in body.items() if v is not None}


def chat(**changes: Any) -> Case | dict[str, Any]:
    body = {**GOOD_CHAT, **changes}
    return {k: v for k, v in body.items() if v is not None}


def msgs(*messages: Any) -> dict[str, Any]:
    return chat(messages=list(messages))


CHAT = "/v1/chat/completions"
CASES = [
    # -- the body as a whole
    Case("malformed json", b'{"model": "tiny", "prompt": '),
    Case("trailing garbage", b'{"model": "tiny", "prompt": "a"} x'),
    Case("empty body", b""),
    Case("json array", b"[]"),
    Case("json null", b"null"),
    Case("json NaN", b'{"model": "tiny", "prompt": "a", "temperature": NaN}'),
    Case("deeply nested", b"[" * 100_000),
    Case("invalid utf-8", b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    Case("lone surrogate escape", b'{"model": "tiny", "prompt": "\\udc00 x"}'),
    Case("body over the size limit", b'{"model": "tiny", "prompt": "' + b"a" * BIG_BODY_BYTES
         + b'"}', status=413, code="request_too_large"),
    # -- fields and types
    Case("missing prompt", comp(prompt=None), param="prompt"),
    Case("missing model", comp(model=None), param="model"),
    Case("model not a string", comp(model=7), param="model"),
    Case("prompt wrong type", comp(prompt=123), param="prompt"),
    Case("empty prompt", comp(prompt=""), param="prompt"),
    Case("empty token list", comp(prompt=[]), param="prompt"),
    Case("batched prompts mixed", comp(prompt=["a", [1]]), param="prompt"),
    Case("batched prompts streamed", comp(prompt=["a", "b"], stream=True), param="stream"),
    Case("mixed prompt list", comp(prompt=["a", 1]), param="prompt"),
    Case("bool token id", comp(prompt=[True]), param="prompt"),
    Case("token id too large", comp(prompt=[72, 258]), param="prompt"),
    Case("negative token id", comp(prompt=[-1]), param="prompt"),
    Case("unknown field", comp(foo=1), param="foo"),
    Case("client cache_salt", comp(cache_salt="other-tenant"), param="cache_salt"),
    Case("tools on completions", comp(tools=[]), param="tools"),
    Case("max_tokens negative", comp(max_tokens=-1), param="max_tokens"),
    Case("max_tokens zero", comp(max_tokens=0), param="max_tokens"),
    Case("max_tokens huge", comp(max_tokens=10**30), param="max_tokens"),
    Case("max_tokens string", comp(max_tokens="16"), param="max_tokens"),
    Case("max_tokens float", comp(max_tokens=1.5), param="max_tokens"),
    Case("max_tokens over context", comp(max_tokens=1_000_000),
         code="context_length_exceeded"),
    Case("temperature negative", comp(temperature=-0.5), param="temperature"),
    Case("temperature too high", comp(temperature=3), param="temperature"),
    Case("temperature infinite", b'{"model": "tiny", "prompt": "a", "temperature": 1e999}',
         param="temperature"),
    Case("temperature string", comp(temperature="hot"), param="temperature"),
    Case("top_p zero", comp(top_p=0), param="top_p"),
    Case("top_p above one", comp(top_p=1.5), param="top_p"),
    Case("seed over 64 bits", comp(seed=2**64), param="seed"),
    Case("stream not bool", comp(stream="yes"), param="stream"),
    Case("stream_options without stream", comp(stream_options={"include_usage": True}),
         param="stream_options"),
    Case("stream_options unknown field", comp(stream=True, stream_options={"x": 1}),
         param="stream_options"),
    Case("stop empty string", comp(stop=""), param="stop"),
    Case("stop too many", comp(stop=["a", "b", "c", "d", "e"]), param="stop"),
    Case("stop not strings", comp(stop=[1, 2]), param="stop"),
    # -- sampling fields out of range
    Case("n zero", comp(n=0), param="n"),
    Case("n over --max-n", comp(n=9), param="n"),
    Case("logprobs over 20", comp(logprobs=21), param="logprobs"),
    Case("logprobs negative", comp(logprobs=-1), param="logprobs"),
    Case("presence_penalty over 2", comp(presence_penalty=2.5), param="presence_penalty"),
    Case("frequency_penalty under -2", comp(frequency_penalty=-3.0),
         param="frequency_penalty"),
    Case("top_k under -1", comp(top_k=-2), param="top_k"),
    Case("min_p over 1", comp(min_p=1.5), param="min_p"),
    Case("repetition_penalty zero", comp(repetition_penalty=0), param="repetition_penalty"),
    Case("min_tokens over max_tokens", comp(min_tokens=5), param="min_tokens"),
    Case("min_tokens negative", comp(min_tokens=-1), param="min_tokens"),
    Case("ignore_eos not bool", comp(ignore_eos="yes"), param="ignore_eos"),
    Case("stop_token_ids outside the vocabulary", comp(stop_token_ids=[258]),
         param="stop_token_ids"),
    Case("stop_token_ids negative", comp(stop_token_ids=[-1]), param="stop_token_ids"),
    Case("chat top_logprobs without logprobs", chat(top_logprobs=2), path=CHAT,
         param="top_logprobs"),
    Case("chat top_logprobs over 20", chat(logprobs=True, top_logprobs=21), path=CHAT,
         param="top_logprobs"),
    # -- parameters the mesh does not implement (accepted at their neutral value only)
    Case("best_of=2", comp(best_of=2), param="best_of"),
    Case("logit_bias out of range", comp(logit_bias={"65": 101}), param="logit_bias"),
    Case("logit_bias key", comp(logit_bias={"a": 1}), param="logit_bias"),
    Case("skip_special_tokens false", comp(skip_special_tokens=False),
         param="skip_special_tokens"),
    Case("include_stop_str_in_output", comp(include_stop_str_in_output=True),
         param="include_stop_str_in_output"),
    Case("use_beam_search", comp(use_beam_search=True), param="use_beam_search"),
    Case("chat continue_final_message", chat(continue_final_message=True), path=CHAT,
         param="continue_final_message"),
    Case("echo with logprobs streamed", comp(echo=True, logprobs=1, stream=True),
         param="echo"),
    Case("prompt_logprobs", comp(prompt_logprobs=1), param="prompt_logprobs"),
    Case("suffix", comp(suffix="end"), param="suffix"),
    # -- chat messages
    Case("chat without messages", chat(messages=None), path=CHAT, param="messages"),
    Case("chat empty messages", chat(messages=[]), path=CHAT, param="messages"),
    Case("chat message not object", msgs("hi"), path=CHAT, param="messages"),
    Case("chat unknown role", msgs({"role": "robot", "content": "x"}), path=CHAT,
         param="messages"),
    Case("chat missing role", msgs({"content": "x"}), path=CHAT, param="messages"),
    Case("chat user without content", msgs({"role": "user"}), path=CHAT, param="messages"),
    Case("chat content number", msgs({"role": "user", "content": 5}), path=CHAT,
         param="messages"),
    Case("chat image part", msgs({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}), path=CHAT,
         param="messages"),
    Case("chat part without type", msgs({"role": "user", "content": [{"text": "x"}]}),
         path=CHAT, param="messages"),
    Case("chat tool calls not a list", msgs({"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "tool_calls": {"function": "f"}}),
         path=CHAT, param="messages"),
    Case("chat tool calls from the user", msgs({"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
         path=CHAT, param="messages"),
    Case("chat legacy function_call", msgs({"role": "assistant", "content": None,
                                            "function_call": {"name": "f"}}),
         path=CHAT, param="messages"),
    Case("chat tool type", chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]),
         path=CHAT, param="tools"),
    Case("chat tool bad name", chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
         path=CHAT, param="tools"),
    Case("chat tool parameters not a schema", chat(tools=[
        {"type": "function", "function": {"name": "f", "parameters": [1]}}]),
         path=CHAT, param="tools"),
    Case("chat tool names repeat", chat(tools=[{"type": "function", "function": {"name": "f"}},
                                               {"type": "function", "function": {"name": "f"}}]),
         path=CHAT, param="tools"),
    Case("chat tool_choice names no tool", chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}),
         path=CHAT, param="tool_choice"),
    Case("chat tool_choice without tools", chat(tool_choice="required"),
         path=CHAT, param="tool_choice"),
    Case("chat tool_choice unknown", chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                          tool_choice="sometimes"),
         path=CHAT, param="tool_choice"),
    Case("chat required tool and response_format", chat(
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
        response_format={"type": "json_object"}), path=CHAT, param="tool_choice"),
    Case("chat max_completion_tokens zero", chat(max_tokens=None, max_completion_tokens=0),
         path=CHAT),
    Case("chat token limits disagree", chat(max_tokens=4, max_completion_tokens=8),
         path=CHAT, param="max_completion_tokens"),
    Case("chat logprobs not bool", chat(logprobs=3), path=CHAT, param="logprobs"),
    # -- /tokenize and /detokenize
    Case("tokenize without key", {"prompt": "x"}, path="/tokenize", key=None, status=401),
    Case("tokenize unknown field", {"prompt": "x", "foo": 1}, path="/tokenize",
         param="foo"),
    Case("tokenize neither prompt nor messages", {"model": "tiny"}, path="/tokenize",
         param="prompt"),
    Case("tokenize wrong model", {"model": "gpt-4o", "prompt": "x"}, path="/tokenize",
         status=404, param="model"),
    Case("detokenize token outside the vocabulary", {"tokens": [258]},
         path="/detokenize", param="tokens"),
    Case("detokenize not a list", {"tokens": "abc"}, path="/detokenize", param="tokens"),
    # -- routes, methods, keys, model
    Case("unknown route", GOOD, path="/v1/embeddings", status=404),
    Case("unknown prefix", GOOD, path="/v2/completions", status=404),
    Case("GET on completions", None, method="GET", status=405),
    Case("DELETE on models", None, path="/v1/models", method="DELETE", status=405),
    Case("missing key", GOOD, key=None, status=401, code="invalid_api_key"),
    Case("wrong key", GOOD, key="sk-dev-mallory", status=401, code="invalid_api_key"),
    Case("empty bearer", GOOD, key="", headers={"Authorization": "Bearer "}, status=401),
    Case("basic auth", GOOD, key="", headers={"Authorization": "Basic c2stZGV2LWFsaWNl"},
         status=401),
    Case("models without key", None, path="/v1/models", method="GET", key=None, status=401),
    Case("wrong model", comp(model="gpt-4o"), status=404, param="model",
         code="model_not_found"),
    Case("wrong model chat", chat(model="gpt-4o"), path=CHAT, status=404,
         code="model_not_found"),
]


@pytest.fixture(scope="module")
def seen() -> list[str]:
    return []


@pytest.mark.mesh
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input_is_openai_shaped_4xx(live_mesh: Mesh, case: Case,
                                              seen: list[str]) -> None:
    headers = dict(case.headers)
    if case.key:
        headers["Authorization"] = f"Bearer {case.key}"
    seen.append(case.name)
    data: Any = case.body if isinstance(case.body, bytes) or case.body is None else \
        json.dumps(case.body).encode()
    if isinstance(data, bytes) and len(data) > 1 << 20:
        data = io.BytesIO(data)  # aiohttp warns about large raw bodies
    headers["Content-Type"] = "application/json"
    url = f"http://127.0.0.1:{live_mesh.gateway_port}{case.path}"
    async with aiohttp.ClientSession() as session, session.request(
            case.method, url, data=data, headers=headers) as resp:
        status, ctype, raw = resp.status, resp.content_type, await resp.read()
    assert status == case.status, raw[:300]
    assert ctype == "application/json"
    body = json.loads(raw)
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("authentication_error" if status == 401 else
                           "invalid_request_error")
    if case.param is not ANY:
        assert err["param"] == case.param, err
    if case.code is not ANY:
        assert err["code"] == case.code, err


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.mesh
async def test_mesh_still_serves_after_bad_input(live_mesh: Mesh, seen: list[str]) -> None:
    # Ordering: pytest runs this module's tests in file order, so the table ran first.
    assert len(seen) == len(CASES), "run the whole module: the table must come first"
    status, out = live_mesh.http("POST", "/v1/completions", GOOD)
    assert status == 200, out
    assert out["choices"][0]["text"] == expected_text("Hello", 4)
    status, out = live_mesh.http("POST", CHAT, GOOD_CHAT)
    assert status == 200, out
    status, ready = live_mesh.http("GET", "/ready")
    assert status == 200 and ready["ready"], ready
