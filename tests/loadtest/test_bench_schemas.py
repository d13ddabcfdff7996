"""The schema set and the reply check of `pdmesh bench structured-valid` (the served run
itself needs SmolLM2 and llama-server: docs/benchmarks.md)."""

from __future__ import annotations

import json

import jsonschema

from pdmesh.loadtest.bench.schemas import N_SCHEMAS, SCHEMAS, check_reply
from pdmesh.services.engine.grammar import grammar_text, strict_schema
from pdmesh.services.protocol import messages as m


def test_the_set_has_fifty_schemas_that_are_json_schemas_and_compile_strict() -> None:
    assert len(SCHEMAS) == N_SCHEMAS >= 50
    assert len({json.dumps(s, sort_keys=True) for _, s in SCHEMAS}) == N_SCHEMAS
    for _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)
        grammar_text(m.Structured(kind="json", spec=json.dumps(strict_schema(schema))))


def test_the_set_holds_what_ran_to_max_tokens() -> None:
    """Unbounded numbers, free strings, and objects that leave additionalProperties out."""
    fields = [f for _, s in SCHEMAS for f in s["properties"].values()]
    assert sum(f == {"type": "number"} for f in fields) >= 10
    assert sum(f == {"type": "string"} for f in fields) >= 10
    assert all("additionalProperties" not in s for _, s in SCHEMAS)


def test_a_reply_is_valid_only_if_it_ends_parses_validates_and_adds_no_key() -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "price": {"type": "number"}},
              "required": ["name", "price"]}
    assert check_reply(schema, '{"name": "x", "price": 1.5}', "stop") == ""
    assert check_reply(schema, '{"name": "x", "price": 1.5', "length") == "length"
    assert check_reply(schema, '{"name": "x", "price": ', "stop") == "json"
    assert check_reply(schema, '{"name": "x"}', "stop") == "schema"
    assert check_reply(schema, '{"name": "x", "price": 1, "extra": 2}', "stop") == "schema"
    assert "additionalProperties" not in schema  # checked closed, the schema untouched
