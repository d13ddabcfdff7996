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
from tests.support.grammar import takes
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
    assert named["items"]["properties"]["arguments"] == {"$ref": "#/$defs/f0"}
    assert named["$defs"] == {"f0": WEATHER}
    assert _plan("auto").structured() is None
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    one = [ToolDef(type="function", function=FunctionDef(name="f"))]
    assert plan_of(None, None, None) is None and plan_of(one, "none", None) is None


def _defs(parameters: Any, strict: bool | None) -> list[Any]:
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    return [ToolDef(type="function", function=FunctionDef(
        name="f", parameters=parameters, strict=strict))]


def _args_schema(plan: ToolPlan | None) -> dict:
    """The first function's arguments schema in a forced plan's constraint."""
    assert plan is not None
    spec = json.loads(plan.structured().spec)
    ref = spec["items"]["properties"]["arguments"]
    return spec["$defs"][ref["$ref"].rsplit("/", 1)[1]] if "$ref" in ref else ref


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


def _auto_takes(plan: ToolPlan, text: str) -> bool:
    """Whether `plan`'s constraint lets the whole reply `text` be sampled and end there."""
    structured = plan.structured()
    assert structured is not None and structured.kind == "grammar"
    return takes(structured, text)


def _strict_auto(parallel: bool | None = None) -> ToolPlan:
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    city = {"type": "object", "properties": {"city": {"type": "string"},
                                             "days": {"type": "integer"}},
            "required": ["city"]}
    plan = plan_of([ToolDef(type="function", function=FunctionDef(
                        name="get_weather", parameters=city, strict=True)),
                    ToolDef(type="function", function=FunctionDef(name="get_time"))],
                   "auto", parallel)
    assert plan is not None
    return plan


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("text,accepted", [
    ("It is sunny in Paris.", True),  # text alone
    ("", True),
    (CALL, True),
    ("Let me look.\n" + CALL, True),  # text, then the call
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', True),  # no newlines
    (CALL.replace('"Paris"}', '"Paris", "unit": "C"}'), False),  # strict: undeclared key
    (CALL.replace('"Paris"', "3"), False),  # not its schema
    (CALL.replace("get_weather", "delete_all"), False),  # a function not listed
    (CALL.replace('"Paris"}}', '"Paris"}'), False),  # a call that does not parse
    (CALL.replace('{"city": "Paris"}', '{"city": "Paris", "days": 1.' + "5" * 20 + "}"),
     False),
    (CALL + "\nDone.", False),  # the reply ends with its calls
    (CALL + "\n" + CALL, True),  # parallel calls (the default)
])
def test_auto_with_a_strict_function_constrains_the_calls_not_the_text(
        text: str, accepted: bool) -> None:
    assert _auto_takes(_strict_auto(), text) is accepted


def test_auto_strict_without_parallel_calls_takes_one_block() -> None:
    plan = _strict_auto(parallel=False)
    assert _auto_takes(plan, CALL)
    assert not _auto_takes(plan, CALL + "\n" + CALL)


def test_auto_without_a_strict_function_is_unconstrained() -> None:
    assert _plan("auto").structured() is None
    assert not _plan("auto").strict


def test_parameters_with_their_own_defs_and_a_function_without_any_compile() -> None:
    """A pydantic model's parameters point into their own `$defs` (`#/$defs/Address`),
    and two functions may both name one `Address`; a `$ref` points from the root of the
    document it is in, so each function's `$defs` move to the constraint's root under its
    own names. A function without parameters takes any JSON object."""
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    def nested(field: str) -> dict:
        return {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
                "required": ["to"], "$defs": {"Address": {
                    "type": "object", "properties": {field: {"type": "string"}},
                    "required": [field], "additionalProperties": False}}}

    tools = [ToolDef(type="function", function=FunctionDef(name="ship", parameters=nested(
                 "city"), strict=True)),
             ToolDef(type="function", function=FunctionDef(name="mail", parameters=nested(
                 "street"))),
             ToolDef(type="function", function=FunctionDef(name="ping"))]
    for choice in ("required", "auto"):
        plan = plan_of(tools, choice, None)
        assert plan is not None
        structured = plan.structured()
        assert structured is not None
        ship = '{"name": "ship", "arguments": {"to": {"city": "Oslo"}}}'
        mail = '{"name": "mail", "arguments": {"to": {"street": "Main"}}}'
        ping = '{"name": "ping", "arguments": {"n": [1, {"x": null}]}}'
        crossed = '{"name": "ship", "arguments": {"to": {"street": "Main"}}}'
        wrap = ((lambda call: f"[{call}]") if choice == "required"
                else (lambda call: f"<tool_call>{call}</tool_call>"))
        for call, accepted in ((ship, True), (mail, True), (ping, True), (crossed, False)):
            assert takes(structured, wrap(call)) is accepted, (choice, call)


@pytest.mark.mesh
def test_auto_with_a_strict_function_is_served_under_its_grammar(live_mesh: Mesh) -> None:
    """Through the mesh: the gateway compiles an `auto` plan's grammar when a function is
    strict (one that does not compile is a 400 naming `tools`, before anything is sent),
    and the reply is the oracle's under that grammar, token for token."""
    strict_tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}},
                    TOOLS[1]]
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}]
    status, body = live_mesh.http("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "tools": bad, "max_tokens": 20})
    assert status == 400 and body["error"]["param"] == "tools", body
    with _client(live_mesh) as client:
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES,
                                               tools=strict_tools, temperature=0.8, seed=11,
                                               max_tokens=120)
    from pdmesh.gateway.schema import FunctionDef, ToolDef

    plan = plan_of([ToolDef(type=t["type"], function=FunctionDef(**t["function"]))
                    for t in strict_tools], "auto", None)
    assert plan is not None and plan.strict
    ref = reference("tiny")
    ids = ref.tokenizer.encode(ref.tokenizer.apply_chat_template(
        render_messages(MESSAGES, plan, False)))
    expected = ref.answer(ids, 120, m.Sampling(temperature=0.8, seed=11,
                                               structured=plan.structured()))
    content, calls = parse_reply(expected.text, plan)
    assert reply.choices[0].message.content == content
    assert len(reply.choices[0].message.tool_calls or []) == len(calls)


@pytest.mark.mesh
def test_parameters_nested_too_deeply_are_a_400(live_mesh: Mesh) -> None:
    """Parameters that parse but nest deeper than the constraint can be built: a 400
    naming `tools`, not a 500."""
    params: dict = {"type": "object"}
    for _ in range(900):
        params = {"type": "array", "items": params}
    status, body = live_mesh.http("POST", "/v1/chat/completions", {
        "model": "tiny", "messages": MESSAGES, "tool_choice": "required", "max_tokens": 5,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]})
    assert status == 400 and body["error"]["param"] == "tools", body
    status, _ = live_mesh.http("GET", "/health")
    assert status == 200
