"""`pdmesh bench structured-valid`: valid structured outputs, pdmesh beside llama.cpp.

The same chat requests with `response_format: json_schema` (`strict: true`, as the openai
client's `parse()` sends it) go to pdmesh's default mesh and to llama.cpp's `llama-server` on
the same GGUF (the binary `pdmesh bench llamacpp` builds and caches), for a fixed set of
schemas (`SCHEMAS`: seeded, the kinds of schema applications send, among them the ones
that ran to `max_tokens` on a small model: `number` fields with no bound, strict objects
that do not say `additionalProperties`, free strings), at each temperature of
`--temperatures` (default 0 and 0.7; the sampling seed fixed per request). A reply is
valid when it ends by itself (`finish_reason: stop`), parses as JSON, validates against its
schema (jsonschema, Draft 2020-12) and carries no key its schema does not declare (strict).

Per server and temperature: `valid_rate_<server>_t<temperature>`, `failures_<...>` by
reason (`length`: cut by `max_tokens`). The grammar's cost per token: each constrained
reply at temperature 0 is followed by the same prompt unconstrained with `ignore_eos` and
`max_tokens` set to the constrained reply's token count, so that both generate as many
tokens at the same positions, one after the other (load drifts hit both); the time per
token of each (streamed: first to last text chunk over the usage's completion tokens less
one) gives `tpot_ms_<server>` and `tpot_ms_free_<server>` (medians over the pairs), and
`grammar_overhead_<server>` is the median of the pairs' ratios less 1. One flat JSON object
(the last stdout line with `--json`); validation needs `jsonschema` (the test extra).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdmesh.loadtest.bench import print_report
from pdmesh.loadtest.bench.disagg import API_KEY, MODEL_CONTEXT, started
from pdmesh.loadtest.bench.llamacpp import (
    PDMESH,
    REFERENCE,
    Endpoint,
    Missing,
    _on_sigterm,
    find_llama_server,
    server_version,
    start_llama_server,
)
from pdmesh.services.engine import checkpoint
from pdmesh.services.engine.grammar import strict_schema

N_SCHEMAS = 52
LLAMA_ARGS = "-t 2 -c 8192 -np 1"

# -- the schema set -----------------------------------------------------------------------
TOPICS = ["city", "book", "product", "employee", "movie", "planet", "recipe", "car",
          "restaurant", "song", "country", "laptop", "museum", "river", "bird"]
STR_FIELDS = ["name", "title", "author", "brand", "category", "description", "color",
              "genre", "owner", "origin", "language", "summary"]
NUM_FIELDS = ["price", "rating", "population_millions", "weight_kg", "length_km",
              "score", "temperature_c", "latitude", "longitude", "area_km2"]
INT_FIELDS = ["year", "pages", "count", "age", "rank", "floors", "seats", "episodes"]
BOOL_FIELDS = ["available", "verified", "open_now", "electric"]
ENUMS = {"size": ["small", "medium", "large"], "status": ["active", "retired"],
         "kind": ["new", "used", "refurbished"]}


def _field(rng: random.Random, key: str) -> dict[str, Any]:
    if key in STR_FIELDS:
        # Mostly free strings, as pydantic's `str` sends them; some bounded.
        return ({"type": "string"} if rng.random() < 0.7
                else {"type": "string", "maxLength": rng.choice([20, 40, 80])})
    if key in NUM_FIELDS:
        return {"type": "number"}  # no bound: what ran to max_tokens
    if key in INT_FIELDS:
        return {"type": "integer"}
    if key in BOOL_FIELDS:
        return {"type": "boolean"}
    if key in ENUMS:
        return {"type": "string", "enum": ENUMS[key]}
    if key == "tags":
        return {"type": "array", "items": {"type": "string"}}
    if key == "scores":
        return {"type": "array", "items": {"type": "number"}, "maxItems": 5}
    return {"type": "object", "properties": {"street": {"type": "string"},
                                             "zip": {"type": "string"}},
            "required": ["street", "zip"]}  # "address": strict closes it


def _schema(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    topic = TOPICS[i % len(TOPICS)]
    if i % 4 == 0:  # the pydantic model of the issue: str, str, float
        keys = [rng.choice(STR_FIELDS[:2]), rng.choice(STR_FIELDS[2:]), rng.choice(NUM_FIELDS)]
    else:
        pools = [STR_FIELDS, NUM_FIELDS, INT_FIELDS, BOOL_FIELDS, list(ENUMS),
                 ["tags", "scores", "address"]]
        keys = []
        while len(keys) < rng.randint(2, 5):
            key = rng.choice(rng.choice(pools))
            if key not in keys:
                keys.append(key)
    props = {key: _field(rng, key) for key in keys}
    schema = {"type": "object", "properties": props, "required": list(keys),
              "title": topic.capitalize()}
    return topic, schema  # no additionalProperties: strict mode must close it


SCHEMAS: list[tuple[str, dict[str, Any]]] = [_schema(random.Random(i), i)
                                             for i in range(N_SCHEMAS)]


def check_reply(schema: dict[str, Any], text: str, finish_reason: str | None) -> str:
    """'' for a valid reply, else why not: `length`, `json`, `schema`."""
    import jsonschema

    if finish_reason != "stop":
        return "length" if finish_reason == "length" else f"finish:{finish_reason}"
    try:
        value = json.loads(text)
    except ValueError:
        return "json"
    try:
        # Every object closed, as strict mode means it.
        jsonschema.validate(value, strict_schema(schema),
                            cls=jsonschema.Draft202012Validator)
    except jsonschema.ValidationError:
        return "schema"
    return ""


def request_body(model: str, topic: str, schema: dict[str, Any], temperature: float,
                 seed: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    fields = ", ".join(schema["properties"])
    body: dict[str, Any] = {
        "model": model, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
        "stream": True, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content":
                      f"Describe a {topic} as JSON with the fields {fields}."}]}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": schema["title"], "schema": schema, "strict": True}}
    return body


# -- the client ---------------------------------------------------------------------------
@dataclass
class Answer:
    text: str
    finish_reason: str | None
    chunks: int
    tpot_s: float | None  # first to last text chunk / (tokens - 1)
    error: str = ""
    tokens: int = 0  # the usage's completion tokens (the text chunks where none came)


async def ask(session: aiohttp.ClientSession, endpoint: Endpoint, body: dict[str, Any],
              timeout_s: float) -> Answer:
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    text, finish, times, tokens = [], None, [], 0
    try:
        async with session.post(endpoint.base_url + "/chat/completions", json=body,
                                headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return Answer("", None, 0, None, f"HTTP {resp.status}: "
                              f"{(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        times.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Answer("".join(text), finish, len(times), None, f"{type(exc).__name__}: {exc}")
    tokens = tokens or len(times)
    tpot = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
    return Answer("".join(text), finish, len(times), tpot, tokens=tokens)


async def bench(endpoints: list[Endpoint], temperatures: list[float], n: int,
                max_tokens: int, timeout_s: float, report: dict[str, object]) -> None:
    # A connection per request: llama-server closes a streamed reply's connection, and a
    # reused one then fails the next request before it is sent.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for endpoint in endpoints:
            pairs: list[tuple[float, float]] = []  # (constrained, free) time per token
            for temperature in temperatures:
                failures: dict[str, int] = {}
                valid = 0
                for i, (topic, schema) in enumerate(SCHEMAS[:n]):
                    answer = await ask(session, endpoint, request_body(
                        endpoint.model, topic, schema, temperature, 1000 + i, max_tokens,
                        True), timeout_s)
                    why = answer.error and "error" or check_reply(schema, answer.text,
                                                                 answer.finish_reason)
                    if why:
                        failures[why] = failures.get(why, 0) + 1
                        if len(report.setdefault(f"examples_{endpoint.label}", [])) < 4:
                            report[f"examples_{endpoint.label}"].append(  # type: ignore[union-attr]
                                {"schema": i, "t": temperature, "why": why,
                                 "text": (answer.error or answer.text)[-160:]})
                    else:
                        valid += 1
                    if temperature == 0.0 and answer.tpot_s is not None and answer.tokens >= 8:
                        free_body = request_body(endpoint.model, topic, schema, 0.0, 1000 + i,
                                                 answer.tokens, False)
                        free_body["ignore_eos"] = True
                        free = await ask(session, endpoint, free_body, timeout_s)
                        if free.tpot_s is not None and free.tokens == answer.tokens:
                            pairs.append((answer.tpot_s, free.tpot_s))
                key = f"{endpoint.label}_t{temperature:g}"
                report[f"valid_rate_{key}"] = valid / n
                report[f"failures_{key}"] = failures
                print(f"pdmesh bench structured-valid: {key}: {valid}/{n} valid {failures}",
                      file=sys.stderr, flush=True)
            if pairs:
                report[f"tpot_ms_{endpoint.label}"] = statistics.median(
                    c for c, _ in pairs) * 1000
                report[f"tpot_ms_free_{endpoint.label}"] = statistics.median(
                    f for _, f in pairs) * 1000
                report[f"grammar_overhead_{endpoint.label}"] = statistics.median(
                    c / f for c, f in pairs) - 1
                report[f"overhead_pairs_{endpoint.label}"] = len(pairs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdmesh bench structured-valid",
                                     description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", default="smollm2", help="a GGUF model both servers load (default smollm2)")
    add("--schemas", type=int, default=N_SCHEMAS, help=f"how many of the {N_SCHEMAS} schemas")
    add("--temperatures", default="0,0.7")
    add("--max-tokens", type=int, default=256)
    add("--request-timeout-s", type=float, default=120.0)
    add("--no-llamacpp", action="store_true", help="pdmesh alone (no llama-server)")
    add("--llama-server", default=None, help="a llama-server binary of your own")
    add("--llama-args", default=LLAMA_ARGS)
    add("--no-build", action="store_true", help="never build llama-server (use the cached one)")
    add("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.schemas <= N_SCHEMAS:
        parser.error(f"--schemas: 1..{N_SCHEMAS}")
    try:
        args.temperature_list = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        parser.error("--temperatures: comma-separated numbers, e.g. 0,0.7")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        print("pdmesh bench structured-valid: validation needs jsonschema "
              "(pip install 'pdmesh[test]')", file=sys.stderr)
        return 2
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    source = checkpoint.resolve(args.model)
    report: dict[str, object] = {"load_avg_1m_start": os.getloadavg()[0],
                                 "model": args.model, "schemas": args.schemas,
                                 "temperatures": args.temperatures,
                                 "max_tokens": args.max_tokens}
    started_at = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            endpoints = []
            if not args.no_llamacpp:
                if source.kind != "gguf" or source.path is None:
                    print(f"pdmesh bench structured-valid: --model {args.model} is not a "
                          "GGUF (or use --no-llamacpp)", file=sys.stderr)
                    return 2
                version, binary = find_llama_server(args.llama_server, None,
                                                    not args.no_build, 2, 3600.0)
                llama, llama_args, _ = start_llama_server(stack, binary, source.path,
                                                          args.llama_args.split())
                report.update(llama_server_version=server_version(binary),
                              llama_cpp_python_version=version,
                              llama_args=" ".join(llama_args))
                endpoints.append(Endpoint(REFERENCE, llama.root + "/v1", source.name))
            context = MODEL_CONTEXT.get(args.model, 4096)
            mesh = stack.enter_context(started(PDMESH, args.model, context, False))
            endpoints.insert(0, Endpoint(PDMESH, mesh.root + "/v1", source.name, API_KEY))
            asyncio.run(bench(endpoints, args.temperature_list, args.schemas,
                              args.max_tokens, args.request_timeout_s, report))
    except Missing as exc:
        print(f"pdmesh bench structured-valid: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"pdmesh bench structured-valid: {exc}", file=sys.stderr, flush=True)
        report["error"] = str(exc).splitlines()[0][:500]
    report.update(load_avg_1m_end=os.getloadavg()[0], wall_s=time.monotonic() - started_at)
    print_report(report, args.json, 4)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    sys.exit(main())
