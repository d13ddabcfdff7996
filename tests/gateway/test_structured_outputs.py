"""Structured outputs through the mesh (tiny model): `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` (json, regex, choice, grammar). Prefill samples
the first token under the grammar, decode the rest; the reply must satisfy the constraint
and equal the oracle's constrained run token for token (I4), greedy and seeded, on the
disaggregated mesh and on `--colocated`."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from pdmesh.services.engine.grammar import ANY_JSON_OBJECT
from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, run_mesh

pytestmark = pytest.mark.mesh

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog"]},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["id", "name", "kind", "flags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def colocated_mesh() -> Iterator[Mesh]:
    with run_mesh("--colocated", "--kv-tokens", "4096") as mesh:
        yield mesh


def _spec(kind: str, value: Any) -> m.Structured:
    return m.Structured(kind=kind, spec=value if isinstance(value, str) else
                        json.dumps(value, separators=(",", ":")))


def _complete(mesh: Mesh, prompt: str, max_tokens: int, **fields: Any) -> dict:
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **fields})
    assert status == 200, body
    return body


def _oracle_text(prompt: str, max_tokens: int, structured: m.Structured,
                 temperature: float = 0.0, seed: int | None = None) -> tuple[str, str]:
    ref = reference("tiny")
    sampling = m.Sampling(temperature=temperature, seed=seed, structured=structured)
    expected = ref.answer(ref.prompt_ids(prompt), max_tokens, sampling)
    return expected.text, expected.finish_reason


@pytest.mark.parametrize("which", ["mesh", "colocated"])
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 1234)])
def test_json_schema_reply_validates_and_equals_the_oracle(
        which: str, temperature: float, seed: int | None, live_mesh: Mesh,
        colocated_mesh: Mesh) -> None:
    mesh = live_mesh if which == "mesh" else colocated_mesh
    prompt = "Describe a pet as JSON:"
    body = _complete(mesh, prompt, 200, temperature=temperature, seed=seed,
                     response_format={"type": "json_schema", "json_schema": {
                         "name": "pet", "schema": SCHEMA, "strict": True}})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice  # the grammar ended it, not the limit
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)
    text, finish = _oracle_text(prompt, 200, _spec("json", SCHEMA), temperature, seed)
    assert (choice["text"], choice["finish_reason"]) == (text, finish)


def test_chat_json_object_and_streamed(live_mesh: Mesh) -> None:
    status, body = live_mesh.http("POST", "/v1/chat/completions", {
        "model": "tiny", "max_tokens": 300, "temperature": 0,
        "messages": [{"role": "user", "content": "any JSON object"}],
        "response_format": {"type": "json_object"}})
    assert status == 200, body
    content = body["choices"][0]["message"]["content"]
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # an open-ended object may outrun max_tokens: still a valid prefix
        assert content.startswith("{")
    ref = reference("tiny")
    ids = ref.prompt_ids("any JSON object", "chat")
    expected = ref.answer(ids, 300, m.Sampling(structured=_spec("json", ANY_JSON_OBJECT)))
    assert content == expected.text


@pytest.mark.parametrize("kind,value,check", [
    ("regex", r"[a-z]{3}-\d{2,4}", lambda t: re.fullmatch(r"[a-z]{3}-\d{2,4}", t)),
    ("choice", ["alpha", "beta", "gamma"], lambda t: t in ("alpha", "beta", "gamma")),
    ("grammar", 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/',
     lambda t: re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", t)),
])
def test_structured_outputs_regex_choice_grammar(kind: str, value: Any, check: Any,
                                                  live_mesh: Mesh) -> None:
    prompt = f"constrained by a {kind}"
    body = _complete(live_mesh, prompt, 64, temperature=0,
                     structured_outputs={kind: value})
    text = body["choices"][0]["text"]
    if body["choices"][0]["finish_reason"] == "stop":
        assert check(text), text
    assert (text, body["choices"][0]["finish_reason"]) == _oracle_text(
        prompt, 64, _spec(kind, value))


def _varied_schema(rng: random.Random, depth: int = 0) -> dict:
    """A random bounded schema: every value it allows is short, so a reply ends."""
    leaves = [
        lambda: {"type": "integer", "minimum": rng.randint(-50, 0),
                 "maximum": rng.randint(1, 500)},
        lambda: {"type": "string", "maxLength": rng.randint(1, 6)},
        lambda: {"enum": rng.sample(["red", "green", "blue", "x", "y", "z"], 3)},
        lambda: {"type": "boolean"},
        lambda: {"type": "null"},
        lambda: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                 "maxItems": rng.randint(1, 3)},
    ]
    props = {}
    for i in range(rng.randint(1, 4)):
        if depth < 1 and rng.random() < 0.25:
            props[f"k{i}"] = _varied_schema(rng, depth + 1)
        else:
            props[f"k{i}"] = rng.choice(leaves)()
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def test_fifty_varied_json_schemas_all_validate(live_mesh: Mesh) -> None:
    """50 random bounded schemas, 4 at a time: every reply parses and validates against its
    schema with jsonschema (a reply that ran out of tokens would fail to parse)."""
    rng = random.Random(7)
    schemas = [_varied_schema(rng) for _ in range(50)]

    def one(i: int) -> tuple[int, str, str]:
        body = _complete(live_mesh, f"record {i}:", 400, temperature=0.7, seed=i,
                         response_format={"type": "json_schema", "json_schema": {
                             "name": f"s{i}", "schema": schemas[i]}})
        return i, body["choices"][0]["text"], body["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(len(schemas))))
    for i, text, finish in results:
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schemas[i])


OPEN_SCHEMA = {"type": "object", "properties": {  # no additionalProperties: JSON Schema's open
    "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]}


def test_strict_replies_carry_no_undeclared_key(live_mesh: Mesh) -> None:
    """OpenAI's strict mode on the mesh: under `strict: true` the object is closed, so no
    reply carries a key the schema does not declare; without it the same requests do
    (the random model invents keys), so this test can fail."""
    declared, extra = set(OPEN_SCHEMA["properties"]), 0
    for seed in range(6):
        replies = {}
        for strict in (True, False):
            body = _complete(live_mesh, "a person:", 120, temperature=1.0, seed=seed,
                             response_format={"type": "json_schema", "json_schema": {
                                 "name": "p", "schema": OPEN_SCHEMA, "strict": strict}})
            replies[strict] = body["choices"][0]
        text = replies[True]["text"]
        assert replies[True]["finish_reason"] == "stop", text
        assert set(json.loads(text)) <= declared, text
        jsonschema.validate(json.loads(text), {**OPEN_SCHEMA, "additionalProperties": False})
        if replies[False]["finish_reason"] == "stop":
            extra += bool(set(json.loads(replies[False]["text"])) - declared)
        else:  # an open object may outrun max_tokens with invented keys
            extra += 1
    assert extra, "without strict the random model never invented a key: no contrast"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": True}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_bad_structured_output_requests_are_a_clear_400(fields: dict, param: str,
                                                         live_mesh: Mesh) -> None:
    status, body = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "x", "max_tokens": 4, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param, body
