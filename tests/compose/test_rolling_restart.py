"""compose/rolling_restart.py's verdicts (the live run is compose/ci.sh): a whole answer
passes; an error event, a cut stream, a short answer, an error reply or two different answers
to one prompt each fail."""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import pytest

from tests.compose.test_compose_files import COMPOSE

_spec = importlib.util.spec_from_file_location("rolling_restart", COMPOSE / "rolling_restart.py")
assert _spec and _spec.loader
rr: Any = importlib.util.module_from_spec(_spec)
sys.modules.setdefault(_spec.name, rr)  # its dataclasses look their module up there
_spec.loader.exec_module(rr)


def _sse(*events: Any) -> list[str]:
    lines = []
    for event in events:
        lines += [f"data: {event if isinstance(event, str) else json.dumps(event)}", ""]
    return lines


def _chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


USAGE = {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 3}}
WHOLE = _sse(_chunk("a"), _chunk("b"), _chunk("c", "length"), USAGE, "[DONE]")


def _result(reply: Any, index: int = 0, max_tokens: int = 3) -> Any:
    res = rr.Result(index, "completions", "p", max_tokens, True, 0.0)
    res.reply = reply
    return res


def test_a_whole_stream_passes() -> None:
    reply = rr.parse_stream(WHOLE, chat=False)
    assert (reply.text, reply.finish_reason, reply.completion_tokens, reply.done) == (
        "abc", "length", 3, True)
    assert rr.problem(_result(reply)) == ""


def test_a_chat_stream_reads_the_deltas() -> None:
    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"},
                                    "finish_reason": None}]}
    part = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"},
                                    "finish_reason": "length"}]}
    reply = rr.parse_stream(_sse(role, part, USAGE, "[DONE]"), chat=True)
    assert (reply.text, reply.finish_reason) == ("hi", "length")


@pytest.mark.parametrize(("lines", "why"), [
    (_sse(_chunk("a"), {"error": {"message": "generation failed", "code": "worker_lost"}}),
     "error event"),
    (WHOLE[:-2], "without [DONE]"),
    (_sse(_chunk("a"), _chunk("b", "length"),
          {"id": "cmpl-1", "choices": [], "usage": {"completion_tokens": 2}}, "[DONE]"),
     "2 completion tokens"),
    (_sse(_chunk("a"), USAGE, "[DONE]"), "finish_reason None"),
])
def test_a_broken_stream_fails(lines: list[str], why: str) -> None:
    assert why in rr.problem(_result(rr.parse_stream(lines, chat=False)))


def test_an_error_reply_fails() -> None:
    body = json.dumps({"error": {"message": "the gateway is draining", "code": "draining"}})
    assert "HTTP 503" in rr.problem(_result(rr.parse_json(503, body, chat=False)))
    assert "HTTP 0" in rr.problem(_result(rr.Reply(error="ClientConnectionError: reset")))


def test_different_answers_to_one_prompt_are_mismatches() -> None:
    doc = {"id": "cmpl-2", "choices": [{"index": 0, "text": "abd", "finish_reason": "length"}],
           "usage": {"completion_tokens": 3}}
    same = rr.parse_json(200, json.dumps({**doc, "choices": [{**doc["choices"][0],
                                                               "text": "abc"}]}), chat=False)
    other = rr.parse_json(200, json.dumps(doc), chat=False)
    first = _result(rr.parse_stream(WHOLE, chat=False), index=0)
    assert rr.mismatches([first, _result(same, index=4)]) == []
    (line,) = rr.mismatches([first, _result(other, index=4)])
    assert "request 4" in line and "'abd'" in line
