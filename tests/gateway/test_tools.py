"""Tool calling (gateway/tools.py): the tools in the prompt, a required or named call
constrained to the function's schema through the mesh, `tool_calls` in replies and
streamed deltas through the openai client, a tool's result sent back, and the parser of
`<tool_call>` blocks an `auto` reply may hold."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from pdmesh.gateway.tools import ToolPlan, ToolStream, parse_reply, plan_of, render_messages
from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.base_url, api_key="sk-dev-alice", max_retries=0)


def _plan(tool_choice: Any = "required", parallel: bool | None = None) -> ToolPlan:
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    defs = [ToolDef(type="function", function=FunctionDef(**t["function"])) for t in TOOLS]
    plan = plan_of(defs, tool_choice, parallel)
    assert plan is not None
    return plan


def _check_call(call: Any) -> dict:
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.mesh
def test_required_tool_call_follows_the_schema_and_the_oracle(live_mesh: Mesh) -> None:
    with _client(live_mesh) as client:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                               tool_choice="required", temperature=0,
                                               max_tokens=300, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    # The oracle: the same rendered prompt, the same constraint, the same tokens.
    plan = _plan(parallel=False)
    ref = reference("tiny")
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(
        render_messages(MESSAGES, plan, False)))
    expected = ref.answer(ids, 300, m.Sampling(structured=plan.structured()))
    calls = json.loads(expected.text)
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [(c["name"], c["arguments"]) for c in calls]


@pytest.mark.mesh
def test_named_tool_and_no_parallel_calls(live_mesh: Mesh) -> None:
    with _client(live_mesh) as client:
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0.8, seed=3,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=200)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in calls] == ["get_time"]
    _check_call(calls[0])


@pytest.mark.mesh
def test_a_streamed_tool_call_round_trips_through_the_openai_client(live_mesh: Mesh) -> None:
    """The call arrives as tool_calls deltas (finish `tool_calls`), the client runs it and
    sends the result back as a tool message: the next reply is the model's answer to a
    prompt that holds the call and its result (the oracle's, on that prompt)."""
    with _client(live_mesh) as client:
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", temperature=0,
                                                max_tokens=300, stream=True,
                                                parallel_tool_calls=False)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        content = ""
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                got = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += tc.id or ""
                got["name"] += tc.function.name or ""
                got["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == "" and len(calls) == 1, (finish, calls)
        call = calls[0]
        args = json.loads(call["arguments"])
        jsonschema.validate(args, {"get_weather": WEATHER, "get_time": TIME}[call["name"]])
        history = [*MESSAGES,
                   {"role": "assistant", "content": None, "tool_calls": [{
                       "id": call["id"], "type": "function",
                       "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees"}]
        answer = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                temperature=0, max_tokens=12)
    ref = reference("tiny")
    rendered = ref.tokenizer.apply_chat_template(render_messages(history, _plan("auto"), False))
    assert "<tool_response>\n18 degrees\n</tool_response>" in rendered
    assert f'"name": "{call["name"]}"' in rendered
    expected = ref.answer(ref.tokenizer.encode(rendered), 12, m.Sampling())
    # tiny's free text holds no <tool_call> block: the reply is its text as content.
    assert answer.choices[0].message.content == expected.text


def test_auto_replies_parse_tool_call_blocks() -> None:
    plan = _plan("auto")
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Oslo", "unit": "celsius"}}\n</tool_call>\n<tool_call>{"name": "get_time", '
            '"arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = parse_reply(text, plan)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    # Not a call: malformed JSON, an unknown function, no tags.
    for text in ('<tool_call>{"name": "get_weather", </tool_call>',
                 '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '{"name": "get_weather", "arguments": {}}'):
        assert parse_reply(text, plan) == (text, [])


@pytest.mark.parametrize("cut", [1, 3, 5, 11, 13])
def test_a_streamed_auto_reply_shows_text_and_holds_the_call(cut: int) -> None:
    """Text before a `<tool_call>` streams; the tag (even split across deltas) and what
    follows are held and come out as the call at the end."""
    text = ('Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    stream = ToolStream(_plan("auto"))
    shown = "".join(stream.push(text[i:i + cut]) for i in range(0, len(text), cut))
    rest, calls = stream.finish()
    assert shown + rest == "Sure. " and "<" not in shown
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    plain = ToolStream(_plan("auto"))
    out = "".join(plain.push(p) for p in ("a <b> c", " <tool", "ing>"))
    rest, calls = plain.finish()
    assert out + rest == "a <b> c <tooling>" and calls == []


def test_forced_plan_is_an_array_of_the_functions_calls() -> None:
    required = json.loads(_plan("required").structured().spec)
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    single = json.loads(_plan("required", parallel=False).structured().spec)
    assert single["maxItems"] == 1
    named = json.loads(_plan({"type": "function",
                              "function": {"name": "get_weather"}}).structured().spec)
    assert named["items"]["properties"]["name"] == {"const": "get_weather"}
    assert named["items"]["properties"]["arguments"] == WEATHER
    assert _plan("auto").structured() is None
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    one = [ToolDef(type="function", function=FunctionDef(name="f"))]
    assert plan_of(None, None, None) is None and plan_of(one, "none", None) is None


def _defs(parameters: Any, strict: bool | None) -> list[Any]:
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    return [ToolDef(type="function", function=FunctionDef(
        name="f", parameters=parameters, strict=strict))]


def _args_schema(plan: ToolPlan | None) -> dict:
    assert plan is not None
    return json.loads(plan.structured().spec)["items"]["properties"]["arguments"]


def test_a_strict_function_closes_its_arguments() -> None:
    """`strict: true` on a function: its arguments take no undeclared key (OpenAI's strict
    mode), in nested objects too; without it JSON Schema's meaning stays."""
    open_schema = {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]}
    strict = _args_schema(plan_of(_defs(open_schema, True), "required", None))
    assert strict["additionalProperties"] is False
    assert strict["properties"]["where"]["additionalProperties"] is False
    jsonschema.validate({"city": "x"}, strict)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"city": "x", "extra": 1}, strict)
    loose = _args_schema(plan_of(_defs(open_schema, None), "required", None))
    assert "additionalProperties" not in loose
    assert open_schema == {"type": "object", "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}}},
        "required": ["city"]}, "the request's schema is left as it came"
    none = _args_schema(plan_of(_defs(None, True), "required", None))
    assert none == {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("parameters,needle", [
    ({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "x"}}},
     "contentEncoding"),
    ({"type": "object", "additionalProperties": True}, "additionalProperties false"),
    ([], "JSON schema object")])
def test_a_strict_function_outside_the_subset_is_refused(parameters: Any,
                                                          needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        plan_of(_defs(parameters, True), "auto", None)
    assert "function f" in str(info.value)
