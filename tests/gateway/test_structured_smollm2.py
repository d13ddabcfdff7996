"""Structured outputs on the real model: SmolLM2-135M-Instruct through the mesh.

The openai client's `beta.chat.completions.parse` with a Pydantic model gets a parsed
object back (disaggregated and `--colocated`); 50 seeded, varied JSON schemas (nested
objects, enums, bounded integers, strings and arrays, booleans), 4 at a time, all end with
the grammar (`finish_reason` `stop`) and validate with jsonschema; a constrained reply,
greedy and seeded, is the oracle's token for token (I4) on SmolLM2's 49,152-token vocabulary.
tests/gateway/test_structured_outputs.py covers the same on the tiny model in every run.

Slow (SmolLM2 loads in every worker and in this process for the oracle), so it runs in
`make test-long` (PDMESH_LONG_TESTS=1), not in `make test`.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, run_mesh

pytestmark = [
    pytest.mark.mesh,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                       reason="SmolLM2 structured outputs: make test-long (PDMESH_LONG_TESTS=1)"),
]

MODEL = "smollm2"
KEY = "sk-dev-alice"
SENTENCE = "Maria Lopez is 34 years old and works as a nurse in Madrid."


def _smollm2_mesh(*args: str) -> Any:
    # run_mesh passes `--model tiny` first; a later `--model` wins (argparse's last value).
    return run_mesh("--model", MODEL, *args, ready_timeout=300)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with _smollm2_mesh() as running:
        yield running


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)


def _parse_person(base_url: str) -> tuple[Person, str]:
    with OpenAI(base_url=base_url, api_key=KEY, max_retries=0, timeout=120) as client:
        completion = client.beta.chat.completions.parse(
            model=MODEL, temperature=0, max_tokens=100, response_format=Person,
            messages=[{"role": "user", "content": "Extract the person's name and age "
                       f"from this sentence as JSON: {SENTENCE}"}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert choice.message.content is not None
    parsed = choice.message.parsed
    assert isinstance(parsed, Person), choice
    return parsed, choice.message.content


@pytest.mark.timeout(600)
@pytest.mark.parametrize("which", ["mesh", "colocated"])
def test_openai_parse_returns_the_pydantic_model(which: str, request: pytest.FixtureRequest
                                                 ) -> None:
    if which == "mesh":
        parsed, content = _parse_person(request.getfixturevalue("mesh").base_url)
    else:  # its own mesh, stopped before the module's other tests load the machine
        with _smollm2_mesh("--colocated") as colocated:
            parsed, content = _parse_person(colocated.base_url)
    assert isinstance(parsed.name, str) and isinstance(parsed.age, int), parsed
    assert Person.model_validate_json(content) == parsed
    # What the model read, not something the grammar could make up: the name and the age
    # are the sentence's own.
    assert parsed.name and parsed.name in SENTENCE, parsed
    assert str(parsed.age) in SENTENCE.split(), parsed


# -- 50 varied schemas -----------------------------------------------------------------------
TOPICS = ["person", "hotel", "book", "city", "car", "employee", "restaurant", "movie", "pet",
          "product", "school", "concert", "flight", "garden", "laptop"]
INTEGERS = [("age", 0, 120), ("year", 1900, 2030), ("count", 0, 50), ("score", 0, 100),
            ("rooms", 1, 12), ("floor", -3, 40), ("rating", 1, 5), ("price", 1, 999)]
STRINGS = ["name", "city", "title", "color", "owner", "country", "label", "brand"]
ENUMS = [("status", ["active", "inactive", "pending"]), ("size", ["small", "medium", "large"]),
         ("day", ["monday", "tuesday", "friday"]), ("priority", ["low", "normal", "high"]),
         ("kind", ["new", "used"])]
BOOLEANS = ["verified", "available", "open", "electric", "featured"]
ARRAYS = ["tags", "scores", "flags", "nicknames"]
OBJECTS = ["address", "contact", "details", "location"]


def _field(rng: random.Random, key: str, depth: int) -> dict:
    """The schema of one field, `key` naming which of the pools above it comes from."""
    for name, lo, hi in INTEGERS:
        if key == name:
            return {"type": "integer", "minimum": lo, "maximum": hi}
    if key in STRINGS:
        return {"type": "string", "maxLength": rng.randint(4, 16)}
    for name, values in ENUMS:
        if key == name:
            return {"enum": values}
    if key in BOOLEANS:
        return {"type": "boolean"}
    if key == "tags" or key == "nicknames":
        items: dict = {"type": "string", "maxLength": rng.randint(3, 10)}
    elif key == "scores":
        items = {"type": "integer", "minimum": 0, "maximum": 100}
    elif key == "flags":
        items = {"type": "boolean"}
    else:
        return _object(rng, depth + 1, rng.randint(1, 3))
    return {"type": "array", "items": items, "maxItems": rng.randint(1, 4)}


def _object(rng: random.Random, depth: int, n: int) -> dict:
    pools = [[k for k, *_ in INTEGERS], STRINGS, [k for k, _ in ENUMS], BOOLEANS, ARRAYS]
    if depth == 0:
        pools.append(OBJECTS)
    keys: list[str] = []
    while len(keys) < n:
        key = rng.choice(rng.choice(pools))
        if key not in keys:
            keys.append(key)
    props = {key: _field(rng, key, depth) for key in keys}
    return {"type": "object", "properties": props, "required": keys,
            "additionalProperties": False}


def _describe(schema: dict) -> str:
    parts = []
    for key, sub in schema["properties"].items():
        if sub.get("type") == "object":
            parts.append(f"{key} (an object with {_describe(sub)})")
        elif "enum" in sub:
            parts.append(f"{key} (one of {', '.join(sub['enum'])})")
        elif sub.get("type") == "array":
            parts.append(f"{key} (a list of {sub['items']['type']}s)")
        else:
            parts.append(f"{key} ({sub['type']})")
    return ", ".join(parts)


PROMPTS = [
    "Describe a {topic} as JSON with the fields {fields}.",
    "Create a sample {topic} record in JSON. Fields: {fields}.",
    "Give me JSON data about a fictional {topic}, with {fields}.",
    "Invent a {topic} and answer only with a JSON object containing {fields}.",
    "Fill in this JSON for a {topic}: {fields}.",
]


def _cases(n: int, seed: int = 20251203) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        schema = _object(rng, 0, rng.randint(2, 5))
        prompt = rng.choice(PROMPTS).format(topic=rng.choice(TOPICS), fields=_describe(schema))
        cases.append((prompt, schema))
    return cases


def _chat(mesh: Mesh, prompt: str, max_tokens: int, schema: dict | None = None,
          **fields: Any) -> tuple[dict, float]:
    body: dict = {"model": MODEL, "max_tokens": max_tokens,
                  "messages": [{"role": "user", "content": prompt}], **fields}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "record", "schema": schema, "strict": True}}
    t0 = time.monotonic()
    status, reply = mesh.http("POST", "/v1/chat/completions", body, key=KEY, timeout=300)
    elapsed = time.monotonic() - t0
    assert status == 200, (body, reply)
    return reply, elapsed


@pytest.mark.timeout(600)
def test_fifty_varied_json_schemas_all_validate(mesh: Mesh) -> None:
    """50 seeded schemas with prompts asking for them, 4 at a time, sampled (temperature
    0.7, a seed each): every reply ends with its grammar, parses and validates."""
    cases = _cases(50)

    def one(i: int) -> tuple[int, dict, float]:
        prompt, schema = cases[i]
        reply, elapsed = _chat(mesh, prompt, 300, schema, temperature=0.7, seed=1000 + i)
        return i, reply, elapsed

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(len(cases))))
    wall = time.monotonic() - t0
    for i, reply, _ in results:
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", (cases[i], reply)
        jsonschema.validate(json.loads(choice["message"]["content"]), cases[i][1])
    latencies = [elapsed for _, _, elapsed in results]
    tokens = sum(reply["usage"]["completion_tokens"] for _, reply, _ in results)
    print(f"\n50 json_schema requests (4 at a time): {wall:.1f}s wall, mean latency "
          f"{sum(latencies) / len(latencies):.2f}s, max {max(latencies):.2f}s, "
          f"{tokens} completion tokens ({tokens / wall:.1f} tokens/s overall)")


# -- the oracle ------------------------------------------------------------------------------
ORACLE_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 16},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "pets", "employed"], "additionalProperties": False}
ORACLE_PROMPT = "Invent a person and describe them as JSON: name, age, city, pets, employed."


@pytest.mark.timeout(600)
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 4242)])
def test_constrained_reply_equals_the_oracle(temperature: float, seed: int | None,
                                             mesh: Mesh) -> None:
    fields: dict[str, Any] = {"temperature": temperature}
    if seed is not None:
        fields["seed"] = seed
    reply, _ = _chat(mesh, ORACLE_PROMPT, 200, ORACLE_SCHEMA, **fields)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", reply
    content = choice["message"]["content"]
    jsonschema.validate(json.loads(content), ORACLE_SCHEMA)
    ref = reference(MODEL)
    expected = ref.answer(ref.prompt_ids(ORACLE_PROMPT, "chat"), 200, m.Sampling(
        temperature=temperature, seed=seed,
        structured=m.Structured(kind="json", spec=json.dumps(ORACLE_SCHEMA))))
    assert (content, choice["finish_reason"]) == (expected.text, expected.finish_reason)
    assert reply["usage"]["completion_tokens"] == expected.num_tokens


@pytest.mark.timeout(600)
def test_tokens_per_second_with_and_without_a_schema(mesh: Mesh) -> None:
    """Not a bound: the same prompt and max_tokens, constrained and not, timed (each run
    twice, the second timed, so that neither pays a first compile)."""
    prompt = "Describe a fictional hotel in JSON: name, city, rooms, rating, open, tags."
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "rooms": {"type": "integer", "minimum": 1, "maximum": 5000},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "open": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "maxItems": 5}},
        "required": ["name", "city", "rooms", "rating", "open", "tags"],
        "additionalProperties": False}
    lines = []
    for label, constraint in (("unconstrained", None), ("json_schema", schema)):
        for _ in range(2):
            reply, elapsed = _chat(mesh, prompt, 160, constraint, temperature=0)
        tokens = reply["usage"]["completion_tokens"]
        assert tokens > 0, reply
        lines.append(f"{label}: {tokens} tokens in {elapsed:.2f}s = {tokens / elapsed:.1f} "
                     f"tokens/s ({reply['choices'][0]['finish_reason']})")
        if constraint is not None:
            jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)
    print("\n" + "\n".join(lines))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", [14, 42])
def test_a_reply_that_loops_is_closed_as_the_oracle_closes_it(index: int, mesh: Mesh) -> None:
    """Two of `pdmesh bench structured-valid`'s schemas on which SmolLM2 at temperature 0
    repeats an item (`"tags": ["revised", "revised", ...`) until max_tokens: with the loop
    guard the mesh's reply ends by itself as valid strict JSON, token for token what the
    oracle writes (prefill's first token, decode's others: one guard state); the oracle
    without the guard runs to max_tokens."""
    from pdmesh.loadtest.bench.schemas import SCHEMAS, check_reply, request_body
    from pdmesh.services.engine.grammar import Grammars, strict_schema

    topic, schema = SCHEMAS[index]
    body = request_body(MODEL, topic, schema, 0.0, 1000 + index, 256, True)
    body.pop("stream_options")
    body["stream"] = False
    status, reply = mesh.http("POST", "/v1/chat/completions", body, key=KEY, timeout=300)
    assert status == 200, reply
    choice = reply["choices"][0]
    content = choice["message"]["content"]
    assert check_reply(schema, content, choice["finish_reason"]) == "", content
    ref = reference(MODEL)
    ids = ref.prompt_ids(body["messages"][0]["content"], "chat")
    # The constraint as the gateway builds it from a strict json_schema.
    structured = m.Structured(kind="json", spec=json.dumps(
        strict_schema(schema), separators=(",", ":"), ensure_ascii=False))
    expected = ref.answer(ids, 256, m.Sampling(temperature=0.0, seed=1000 + index,
                                               structured=structured))
    assert (content, choice["finish_reason"]) == (expected.text, expected.finish_reason)
    guarded = ref.grammars
    try:
        ref.grammars = Grammars(ref.tokenizer, guarded.vocab_size, loop_span=0)
        unguarded = ref.answer(ids, 256, m.Sampling(temperature=0.0, seed=1000 + index,
                                                    structured=structured))
    finally:
        ref.grammars = guarded
    assert unguarded.finish_reason == "length", unguarded.text[-200:]
