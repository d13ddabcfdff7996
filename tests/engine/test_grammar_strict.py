"""JSON schemas as the grammar reads them (services/engine/grammar.py): OpenAI's strict mode
closes every object and refuses keywords outside its subset, a schema without strict keeps
JSON Schema's meaning, numbers the schema leaves unbounded get bounded digits, and no
whitespace beyond json.dumps's separators can be sampled. Each test feeds bytes to the
tiny model's byte-level constraint and reads its mask, the one the sampler applies."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pdmesh.services.engine.grammar import (
    NUMBER_FRACTION_DIGITS,
    NUMBER_INTEGER_DIGITS,
    GrammarError,
    Grammars,
    bounded_numbers,
    strict_schema,
)
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m
from tests.support.grammar import takes

TOK = ByteTokenizer()
GRAMMARS = Grammars(TOK)
OPEN_OBJECT = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


def _takes(schema: dict[str, Any], text: str) -> bool:
    """Whether the schema's constraint lets the whole of `text` be sampled and end there."""
    return takes(GRAMMARS.constraint(m.Structured(kind="json", spec=json.dumps(schema))), text)


# -- strict mode ------------------------------------------------------------------------------
def test_strict_refuses_an_undeclared_key_and_non_strict_takes_it() -> None:
    text = '{"a": "x", "b": 1}'
    assert _takes(OPEN_OBJECT, text), "without strict, JSON Schema allows other keys"
    assert not _takes(strict_schema(OPEN_OBJECT), text)
    assert _takes(strict_schema(OPEN_OBJECT), '{"a": "x"}')


@pytest.mark.parametrize("where", ["items", "anyOf", "$defs", "definitions", "nested"])
def test_strict_closes_every_object(where: str) -> None:
    inner = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    schema, text = {
        "items": ({"type": "array", "items": inner}, '[{"a": "x", "b": 1}]'),
        "anyOf": ({"anyOf": [inner, {"type": "null"}]}, '{"a": "x", "b": 1}'),
        "$defs": ({"$ref": "#/$defs/o", "$defs": {"o": inner}}, '{"a": "x", "b": 1}'),
        "definitions": ({"$ref": "#/definitions/o", "definitions": {"o": inner}},
                        '{"a": "x", "b": 1}'),
        "nested": ({"type": "object", "properties": {"o": inner}, "required": ["o"]},
                   '{"o": {"a": "x", "b": 1}}'),
    }[where]
    assert _takes(schema, text)
    assert not _takes(strict_schema(schema), text)


def test_strict_takes_string_lengths_and_annotations_and_enforces_the_lengths() -> None:
    """minLength / maxLength (beyond OpenAI's list: the grammar enforces them, and they keep
    a small model's strings finite) and annotations pass strict mode."""
    schema = strict_schema({"$schema": "https://json-schema.org/draft/2020-12/schema",
                            "type": "object", "required": ["n"], "properties": {
                                "n": {"type": "string", "minLength": 2, "maxLength": 3,
                                      "default": "ab", "examples": ["abc"]}}})
    assert _takes(schema, '{"n": "abc"}')
    assert not _takes(schema, '{"n": "abcd"}')
    assert not _takes(schema, '{"n": "a"}')


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "contentEncoding": "base64"}, "contentEncoding"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minProperties": 3}}},
     "minProperties"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"anyOf": [{"type": "object", "patternProperties": {"x": {}}}]}, "patternProperties"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
    ({"$defs": {"d": {"not": {"type": "null"}}}}, "not"),
])
def test_strict_refuses_keywords_outside_its_subset(schema: dict, keyword: str) -> None:
    with pytest.raises(GrammarError, match=f"keyword '{keyword}'"):
        strict_schema(schema)


def test_strict_refuses_additional_properties_other_than_false() -> None:
    with pytest.raises(GrammarError, match="additionalProperties false"):
        strict_schema({**OPEN_OBJECT, "additionalProperties": {"type": "integer"}})
    assert strict_schema({**OPEN_OBJECT, "additionalProperties": False})[
        "additionalProperties"] is False


def test_strict_keeps_a_pydantic_schema_and_leaves_the_request_untouched() -> None:
    """What the openai client's parse() sends for a model with str, str, float fields."""
    schema = {"title": "City", "type": "object", "additionalProperties": False,
              "properties": {"name": {"title": "Name", "type": "string"},
                             "country": {"title": "Country", "type": "string"},
                             "population_millions": {"title": "Population Millions",
                                                     "type": "number"}},
              "required": ["name", "country", "population_millions"]}
    before = json.dumps(schema)
    assert strict_schema(schema) == schema
    assert json.dumps(schema) == before
    assert _takes(strict_schema(schema),
                  '{"name": "Paris", "country": "France", "population_millions": 2.1}')


# -- bounded numbers --------------------------------------------------------------------------
def test_a_number_takes_at_most_the_cap_of_fraction_digits() -> None:
    number = {"type": "number"}
    assert _takes(number, "3." + "1" * NUMBER_FRACTION_DIGITS)
    assert not _takes(number, "3." + "1" * (NUMBER_FRACTION_DIGITS + 1))
    assert not _takes(number, "3." + "1" * 40), "the run that outran max_tokens"


@pytest.mark.parametrize("kind", ["number", "integer"])
def test_a_number_takes_at_most_the_cap_of_integer_digits(kind: str) -> None:
    most = "9" * NUMBER_INTEGER_DIGITS
    for text in (most, "-" + most, "0", "-7"):
        assert _takes({"type": kind}, text), text
    for text in ("1" + "0" * NUMBER_INTEGER_DIGITS, "-" + "1" * (NUMBER_INTEGER_DIGITS + 1)):
        assert not _takes({"type": kind}, text), text


def test_bounds_the_schema_gives_are_kept() -> None:
    assert _takes({"type": "number", "maximum": 1e17}, "1" + "0" * 16)
    assert not _takes({"type": "number", "minimum": 0}, "-1")
    assert _takes({"type": "number", "multipleOf": 0.5}, "2.5")
    assert not _takes({"type": "number", "multipleOf": 0.5}, "2.25")
    assert _takes({"type": "number", "enum": [0.123456789012345]}, "0.123456789012345")
    # a number inside `not` stays as written: bounding it would widen what `not` allows
    assert bounded_numbers({"not": {"type": "number"}}) == {"not": {"type": "number"}}


def test_bounded_numbers_reach_every_subschema() -> None:
    schema = {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "number"}},
        "o": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
        "$defs": {"n": {"type": ["integer", "null"]}}}
    long_fraction = "0." + "3" * (NUMBER_FRACTION_DIGITS + 1)
    long_integer = "1" * (NUMBER_INTEGER_DIGITS + 1)
    assert _takes(schema, '{"xs": [0.5], "o": 12}')
    assert not _takes(schema, '{"xs": [' + long_fraction + ']}')
    assert not _takes(schema, '{"o": ' + long_integer + '}')
    jsonschema.validate({"xs": [0.5], "o": 12}, bounded_numbers(schema))


# -- whitespace -------------------------------------------------------------------------------
def test_no_whitespace_but_the_separators_can_be_sampled() -> None:
    """At every point of a reply, no newline, tab or second blank is allowed: the mask the
    sampler applies has them off, so no run of newlines can be generated."""
    schema = strict_schema({"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer"}},
        "o": {"type": "object", "properties": {"s": {"type": "string"}}}}})
    text = '{"a": [1, 2], "o": {"s": "xy"}}'
    c = GRAMMARS.constraint(m.Structured(kind="json", spec=json.dumps(schema)))
    for i, byte in enumerate(text.encode()):
        allowed = c.allowed()
        assert not allowed[ord("\n")] and not allowed[ord("\r")] and not allowed[ord("\t")]
        if i == 0 or text[i - 1] in ' [{':
            assert not allowed[ord(" ")], text[:i]
        c.advance(byte)
    assert c.complete


def test_integers_past_64_bits_in_a_schema_compile() -> None:
    """JSON carries integers of any size; llguidance's reading of a Python dict refused
    those of 2**64 and more, so a schema with one was a 400."""
    big = 10 ** 20
    assert _takes({"const": big}, str(big))
    assert _takes({"enum": [1, big]}, str(big)) and _takes({"enum": [1, big]}, "1")
    assert _takes({"type": "integer", "maximum": big}, "12")


def test_a_json_object_bounds_numbers_at_any_depth() -> None:
    """`response_format: json_object` (ANY_JSON_OBJECT): any object, its values untyped in
    JSON Schema's `{"type": "object"}`, so a number there had no bound."""
    from pdmesh.services.engine.grammar import ANY_JSON_OBJECT

    long = "3." + "1" * (NUMBER_FRACTION_DIGITS + 1)
    assert _takes({"type": "object"}, '{"a": [{"b": %s}]}' % long), "the unbounded reading"
    assert not _takes(ANY_JSON_OBJECT, '{"a": [{"b": %s}]}' % long)
    assert not _takes(ANY_JSON_OBJECT, '{"a": 1e5}')
    for text in ['{}', '{"a": [{"b": 3.5}, "x", null, true, []], "c": {"d": -2}}']:
        assert _takes(ANY_JSON_OBJECT, text), text
    assert not _takes(ANY_JSON_OBJECT, "[1]"), "an object, not any value"
