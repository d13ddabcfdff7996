"""Tool calling: the request's tools in the prompt, and `tool_calls` out of the reply.

One format for every chat template: the Hermes one Qwen2.5's template and many fine-tunes
use. A tool call is a JSON object `{"name": ..., "arguments": {...}}` between
`<tool_call>` and `</tool_call>`; a tool's result goes back as a `tool` message, wrapped in
`<tool_response>` tags. A checkpoint whose template renders tools itself (it names
`tools`) gets them as the template's `tools` variable; any other (SmolLM2's, ChatML, the
tiny model's) gets them in a system message that says how to call them.

`tool_choice`:
* `auto` (the default with tools): the model decides; `<tool_call>` blocks in its reply
  become `tool_calls` (a block that does not parse stays text);
* `required`, or a named function: the reply is constrained (structured outputs, the same
  grammar engine) to a JSON array of calls, of the named function only when one is named,
  one call unless `parallel_tool_calls`; its arguments follow the function's `parameters`
  schema, so they always parse;
* `none`: the tools are neither shown to the model nor parsed.

A function with `strict: true` has its `parameters` read as OpenAI's strict mode reads a
schema (grammar.strict_schema): every object closed, a keyword outside the strict subset a
400 naming it; a forced call's arguments then carry no undeclared key. With `auto` and at
least one strict function, the reply is constrained too (`auto_grammar`, a Lark grammar):
free text without `<tool_call>`, or free text and then `<tool_call>` blocks whose JSON is a
call of a listed function with arguments that follow its schema (one block unless
`parallel_tool_calls`), the reply ending after the last; so a call the model starts always
parses, as OpenAI's strict function calling promises.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pdmesh.services.engine.grammar import (
    ANY_JSON_DEFS,
    ANY_JSON_OBJECT_REF,
    JSON_DEFAULTS,
    GrammarError,
    bounded_numbers,
    strict_schema,
)
from pdmesh.services.protocol import messages as m

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
MAX_TOOLS = 128

SYSTEM_PROMPT = """\
You may call one or more functions to assist with the user query.
You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>
For each function call, return a JSON object with the function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools and what it asks of them (`mode`: auto, required or named)."""

    functions: list[dict[str, Any]]  # OpenAI function objects: name, description, parameters
    mode: str
    named: str = ""
    parallel: bool = True
    strict: bool = False  # a function says `strict: true`: `auto` replies are constrained

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def _call_schema(self) -> dict[str, Any]:
        """One call, `{"name": <a function's>, "arguments": <its parameters>}`, as a
        document's root. Each function's parameters go into the root's `$defs` (as
        `f<i>`, their own `$defs` as `f<i>_<name>`, every `$ref` in them rewritten to
        match): a `$ref` points from the root of the document it is in, so a pydantic
        model's `#/$defs/Inner`, embedded as it is, would point nowhere. A function
        without parameters takes any JSON object."""
        defs: dict[str, Any] = {}
        calls = []
        for i, f in enumerate(self.functions):
            if self.mode == "named" and f["name"] != self.named:
                continue
            params = f.get("parameters")
            if params:
                params = dict(params)
                for key in ("$defs", "definitions"):
                    for name, sub in (params.pop(key, None) or {}).items():
                        defs[f"f{i}_{name}"] = _rebased(sub, i)
                defs[f"f{i}"] = _rebased(params, i)
                arguments: dict[str, Any] = {"$ref": f"#/$defs/f{i}"}
            else:
                defs.update(ANY_JSON_DEFS)
                arguments = ANY_JSON_OBJECT_REF
            calls.append({"type": "object", "properties": {
                "name": {"const": f["name"]}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False})
        root = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**root, "$defs": defs}

    def structured(self) -> m.Structured | None:
        """The reply's constraint: a forced call's JSON array of calls, `auto_grammar` for
        `auto` with a strict function, else None."""
        if not self.forced:
            return (m.Structured(kind="grammar", spec=self.auto_grammar()) if self.strict
                    else None)
        item = self._call_schema()
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1,
                                  "$defs": item.pop("$defs")}
        if not self.parallel:
            schema["maxItems"] = 1
        return m.Structured(kind="json", spec=json.dumps(schema))

    def auto_grammar(self) -> str:
        """Lark (llguidance's): free text that holds no `<tool_call>` (the reply ends in
        text), or free text up to the first `<tool_call>` (lazy: it ends at the tag) and
        then calls, each block's JSON one call (`%json`, its numbers bounded, the JSON
        separators of every structured output), blocks apart by at most a newline."""
        call = dict(bounded_numbers(self._call_schema()))
        call["x-guidance"] = JSON_DEFAULTS
        more = ' (SEP "<tool_call>" call_block)*' if self.parallel else ""
        return "\n".join([
            f"start: TEXT | pre call_block{more}",
            "pre[lazy]: /(.|\\n)*<tool_call>/",
            'call_block: SEP call SEP "</tool_call>"',
            f"call: %json {json.dumps(call)}",
            "SEP: /\\n?/",
            "TEXT: /(.|\\n)*/ & ~/(.|\\n)*<tool_call>(.|\\n)*/"]) + "\n"

    def system_text(self) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in
                           self.functions)
        return SYSTEM_PROMPT.format(tools=listed)


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas


def _rebased(schema: Any, i: int) -> Any:
    """Function i's `schema` with each local `$ref` pointing where `_call_schema` moves
    what it named: `#` to `#/$defs/f<i>`, `#/$defs/X` (or `#/definitions/X`) to
    `#/$defs/f<i>_X`, any other `#/...` under `#/$defs/f<i>`."""
    if isinstance(schema, list):
        return [_rebased(sub, i) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: sub if key in _DATA_KEYWORDS else _rebased(sub, i)
           for key, sub in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        path = ref[1:]
        for key in ("/$defs/", "/definitions/"):
            if path.startswith(key):
                out["$ref"] = f"#/$defs/f{i}_{path[len(key):]}"
                break
        else:
            out["$ref"] = f"#/$defs/f{i}{path}"
    return out


def plan_of(tools: list[Any] | None, tool_choice: Any, parallel: bool | None
            ) -> ToolPlan | None:
    """The request's plan, or None (no tools, or `tool_choice: none`); ValueError names
    what is wrong (the caller answers 400)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools")
    functions = []
    for t in tools:
        f = t.function
        if t.type != "function":
            raise ValueError(f"tool type {t.type!r} is not supported (only 'function')")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", f.name):
            raise ValueError(f"function name {f.name!r}: 1 to 64 of a-z, A-Z, 0-9, _ . -")
        if f.parameters is not None and not isinstance(f.parameters, dict):
            raise ValueError(f"function {f.name}: parameters must be a JSON schema object")
        parameters = f.parameters
        if f.strict:
            try:
                parameters = strict_schema(parameters if parameters is not None else {
                    "type": "object", "properties": {}}, "parameters")
            except GrammarError as exc:
                raise ValueError(f"function {f.name}: {exc}") from None
            except RecursionError:
                raise ValueError(f"function {f.name}: parameters nest too deeply") from None
        functions.append({k: v for k, v in (("name", f.name), ("description", f.description),
                                             ("parameters", parameters)) if v is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ValueError("function names must be unique")
    parallel = True if parallel is None else parallel
    strict = any(t.function.strict for t in tools)
    if tool_choice in (None, "auto"):
        return ToolPlan(functions, "auto", parallel=parallel, strict=strict)
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolPlan(functions, "required", parallel=parallel, strict=strict)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return ToolPlan(functions, "named", named=name, parallel=False, strict=strict)
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None,
                    template_has_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it: earlier tool calls and results as
    text in the Hermes format, and (unless the template renders them) the tools in the
    system message."""
    out = []
    for msg in messages:
        msg = dict(msg)
        calls = msg.pop("tool_calls", None)
        if calls:
            text = "\n".join(f"{OPEN}\n" + json.dumps({
                "name": c["function"]["name"],
                "arguments": _arguments(c["function"].get("arguments"))}) + f"\n{CLOSE}"
                for c in calls)
            msg["content"] = ((msg.get("content") or "") + "\n" + text).strip()
        if msg.get("role") == "tool":
            msg["content"] = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
            msg.pop("tool_call_id", None)
        if msg.get("content") is None:
            msg["content"] = ""
        out.append(msg)
    if plan is not None and not template_has_tools:
        text = plan.system_text()
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _arguments(raw: Any) -> Any:
    """A call's arguments as sent back by the client (a JSON string, as OpenAI returns
    them, or an object)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw if raw is not None else {}


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def parse_reply(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished reply: a forced reply is its JSON array of calls;
    an `auto` one, its `<tool_call>` blocks (those that parse, naming a listed function),
    the rest content (None when empty)."""
    names = {f["name"] for f in plan.functions}
    if plan.forced:
        try:
            items = json.loads(text)
        except ValueError:
            return text or None, []  # cut short by max_tokens: what there is, as text
        calls = [_call(c["name"], c.get("arguments", {})) for c in items
                 if isinstance(c, dict) and c.get("name") in names]
        return None, calls
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in names:
            continue
        calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        kept.append(text[last:match.start()])
        last = match.end()
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return content or None, calls


@dataclass
class ToolStream:
    """Streams a reply's text up to where a tool call may start, then holds the rest: the
    calls go out whole at the end (one delta per call), as their text may only be judged
    complete. A forced reply holds everything."""

    plan: ToolPlan
    text: str = ""  # the whole reply so far
    sent: int = 0  # characters of it already streamed as content
    held: bool = False  # a tool call started: nothing more is streamed

    def push(self, delta: str) -> str:
        """The part of the reply that may be streamed as content now."""
        self.text += delta
        if self.plan.forced or self.held:
            return ""
        at = self.text.find(OPEN, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = self.text[self.sent:at], at
            return out
        # Hold back a tail that could be the start of the tag.
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.text)), 0, -1)
                     if OPEN.startswith(self.text[-k:])), 0)
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to stream, tool calls) once the reply ended."""
        content, calls = parse_reply(self.text, self.plan)
        if not calls:
            rest = self.text[self.sent:]
            return ("" if self.plan.forced and content is None else rest), []
        tail = self.text[self.sent:]
        # Text after the last call (auto): content too, once the calls are judged.
        after = tail[tail.rfind(CLOSE) + len(CLOSE):] if CLOSE in tail else ""
        return after.strip(), calls
