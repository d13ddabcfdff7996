"""The loop guard of constrained outputs (services/engine/grammar.py): once the latest
tokens repeat a short period over `loop_span` tokens, the token that would continue the
period is masked, so that a model stuck in `"revised", "revised", ...` inside a string or an
array takes another way the grammar allows instead of running to max_tokens. Each test
feeds bytes to the tiny model's byte-level constraint and reads its mask, the one the
sampler applies."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from pdmesh.services.engine.grammar import (
    LOOP_MAX_PERIOD,
    LOOP_SPAN_DEFAULT,
    Constraint,
    Grammars,
    loop_span_from_env,
)
from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m

TOK = ByteTokenizer()
TAGS = {"type": "object", "properties": {"tags": {"type": "array",
                                                  "items": {"type": "string"}}},
        "required": ["tags"]}


def _fed(schema: dict[str, Any], text: str, span: int = LOOP_SPAN_DEFAULT) -> Constraint:
    c = Grammars(TOK, loop_span=span).constraint(
        m.Structured(kind="json", spec=json.dumps(schema)))
    for byte in text.encode():
        assert c.allowed()[byte], f"the grammar refused {text!r} at {byte!r}"
        c.advance(byte)
    return c


def _only(mask: Any) -> set[str]:
    """The bytes a byte-level mask allows (special tokens left out)."""
    return {chr(t) for t in range(256) if mask[t]}


@pytest.mark.parametrize("period", [1, 2, 7, 16, 40, LOOP_MAX_PERIOD])
def test_a_loop_over_the_span_loses_its_continuation_and_the_json_closes(period: int) -> None:
    """A period p is a loop once it covers max(span, 2p) tokens: a short one over the
    span, a long one (a sentence said again) once it has come round twice."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.,;"
    unit = alphabet[:period]
    head = '{"tags": ["'
    covers = max(LOOP_SPAN_DEFAULT, 2 * period)
    loop = (unit * (covers // period + 2))[:covers - 1]
    c = _fed(TAGS, head + loop)
    nxt = ord(loop[-period])
    assert len(_only(c.allowed())) > 90, "one token short of the span: anything goes"
    c.advance(nxt)
    assert _only(c.allowed()) == {'"'}, "the span reached: only the string's end"
    assert c.closing and c.loops == 1
    c.advance(ord('"'))
    assert _only(c.allowed()) == {"]"}, "then the array's end, not another item"
    c.advance(ord("]"))
    assert _only(c.allowed()) == {"}"}
    c.advance(ord("}"))
    assert c.complete


def test_a_repeated_array_item_is_cut_and_the_array_closes() -> None:
    """The bench's failure: the same item again and again."""
    text = '{"tags": ["rev"' + ', "rev"' * 4  # a 7-byte period over the last 33 bytes
    c = _fed(TAGS, text, span=33)
    assert _only(c.allowed()) == {"]"}, "no other item: the array closes"
    for byte in b"]}":
        c.advance(byte)
    assert c.complete
    assert json.loads(text + "]}") == {"tags": ["rev"] * 5}


def test_closing_fills_what_the_schema_still_requires() -> None:
    """A loop in the first of two required fields: the string closes, the grammar writes
    the next key (no closing token is allowed there, so the mask is the grammar's), and its
    value closes as soon as the grammar allows."""
    schema = {"type": "object", "properties": {"a": {"type": "string"},
                                               "b": {"type": "string"}},
              "required": ["a", "b"], "additionalProperties": False}
    c = _fed(schema, '{"a": "' + "ab" * 16)
    assert _only(c.allowed()) == {'"'}
    out = bytearray()
    for _ in range(40):
        mask = c.allowed()
        if c.complete:
            break
        token = next(t for t in range(256) if mask[t])  # the lowest byte allowed
        out.append(token)
        c.advance(token)
    assert c.complete
    assert json.loads('{"a": "' + "ab" * 16 + out.decode()) == {"a": "ab" * 16, "b": ""}


@pytest.mark.parametrize("kind,spec", [("regex", "[ab]+c"),
                                       ("grammar", 'start: /[ab]+/ "c"')])
def test_a_regex_or_a_grammar_is_left_as_its_author_wrote_it(kind: str, spec: str) -> None:
    """Free text under a regex or a Lark grammar (a tool-calling reply's among them) is
    not JSON: the guard neither masks its repetitions nor closes it."""
    c = Grammars(TOK).constraint(m.Structured(kind=kind, spec=spec))
    for byte in b"ab" * 40:
        c.advance(byte)
    assert _only(c.allowed()) == {"a", "b", "c"}
    assert not c.closing and c.loops == 0


def test_varied_text_and_short_repeats_are_untouched() -> None:
    rng = random.Random(7)
    varied = '{"tags": ["' + "".join(rng.choice("abcdefghij") for _ in range(300))
    c = _fed(TAGS, varied)
    assert c.loops == 0
    short = _fed(TAGS, '{"tags": ["' + "ab" * 10)  # 20 tokens of a loop: under the span
    assert short.allowed()[ord("a")]
    assert short.loops == 0


def test_the_guard_never_masks_the_only_way_on() -> None:
    """A schema whose only sentence repeats (a const of 40 `a`): the guard gives way."""
    const = "a" * 40
    c = _fed({"const": const}, json.dumps(const))
    assert c.complete


def test_span_zero_turns_the_guard_off() -> None:
    c = _fed(TAGS, '{"tags": ["' + "ab" * 40, span=0)
    assert c.allowed()[ord("a")]
    assert c.loops == 0


def test_a_resumed_constraint_masks_as_the_one_that_generated() -> None:
    """Decode rebuilds a request's constraint from its delivered tokens (a resume, the
    handoff): the guard's state, closing included, must come back with them."""
    structured = m.Structured(kind="json", spec=json.dumps(TAGS))
    tokens = list(('{"tags": ["' + "xyz" * 11).encode())
    for tail in (b"", b'"'):  # inside the loop, and after the string it closed
        live = Grammars(TOK).constraint(structured)
        for token in tokens + list(tail):
            assert live.allowed()[token] or token != ord('"')
            live.advance(token)
        resumed = Grammars(TOK).constraint(structured, tokens + list(tail))
        assert (live.allowed() == resumed.allowed()).all()
        assert resumed.closing
        assert _only(resumed.allowed()) == ({'"'} if not tail else {"]"})


def test_greedy_sampling_stuck_on_a_loop_ends_the_json() -> None:
    """Logits that always prefer `x` then `y`: without the guard a string of `xyxy...` runs
    to max_tokens; with it the sampler's next choice (`"`, ranked after them) closes it."""
    structured = m.Structured(kind="json", spec=json.dumps(TAGS))
    logits = torch.full((TOK.vocab_size,), -5.0)
    logits[ord("x")] = logits[ord("y")] = 5.0
    logits[ord('"')], logits[ord("]")], logits[ord("}")] = 4.0, 3.0, 3.0

    def run(span: int) -> str:
        grammars = Grammars(TOK, loop_span=span)
        sampler = Sampler(SamplingParams(temperature=0.0, max_tokens=200), TOK.eos_token_ids,
                          grammars.constraint(structured))
        out = bytearray()
        for _ in range(200):
            token = sampler.sample(logits)
            if token in TOK.eos_token_ids:
                break
            out.append(token)
        return out.decode()

    assert not run(0).endswith("}"), "without the guard it never closes"
    text = run(LOOP_SPAN_DEFAULT)
    value = json.loads(text)
    assert value["tags"] and set(value["tags"][0]) <= {"x", "y"}


@pytest.mark.parametrize("raw,span", [("", LOOP_SPAN_DEFAULT), ("0", 0), ("64", 64),
                                      (" 48 ", 48)])
def test_the_span_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str,
                                       span: int) -> None:
    monkeypatch.setenv("PDMESH_STRUCTURED_LOOP_TOKENS", raw)
    assert loop_span_from_env() == span


@pytest.mark.parametrize("raw", ["x", "-1", "8", "5000"])
def test_a_bad_span_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("PDMESH_STRUCTURED_LOOP_TOKENS", raw)
    with pytest.raises(ValueError, match="PDMESH_STRUCTURED_LOOP_TOKENS"):
        loop_span_from_env()


def test_only_tokens_that_close_and_open_nothing_are_closers() -> None:
    """A BPE vocabulary's `", "` closes a string and opens the next item: taken in closing
    mode it would fill the array with empty strings (`"", "", ...`) until max_tokens."""
    from pdmesh.services.engine.grammar import _Closers

    vocab = [b'"', b'"]', b'"]}', b'", "', b'",', b'ab"', b"]", b"]}", b"],", b"}, {",
             b"\\\"", b'\\\\"', b""]

    class Vocab:
        vocab_size = len(vocab)

        def is_special_token(self, t: int) -> bool:
            return t == len(vocab) - 1

        def decode_bytes(self, ts: list[int]) -> bytes:
            return vocab[ts[0]]

    closers = _Closers(Vocab(), len(vocab), [len(vocab) - 1])
    assert [vocab[t] for t in range(len(vocab)) if closers.string[t]] == [
        b'"', b'"]', b'"]}', b'ab"', b'\\\\"', b""]
    assert [vocab[t] for t in range(len(vocab)) if closers.container[t]] == [
        b"]", b"]}", b""]


def test_where_nothing_can_close_the_loop_only_loses_its_continuation() -> None:
    """Right after `, ` in an array a value must come (no `]`): the loop's next token is
    masked and the grammar's other ways stay open."""
    c = _fed({"type": "array", "items": {"type": "integer"}}, "[" + "1, " * 11, span=33)
    assert c.closing
    allowed = _only(c.allowed())
    assert "1" not in allowed and {"2", "9", "-"} <= allowed and "]" not in allowed
