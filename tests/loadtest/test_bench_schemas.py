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


async def test_the_overhead_pairs_compare_equal_lengths() -> None:
    """`bench` against a stand-in server on loopback: each constrained reply at t=0 is
    followed by its prompt unconstrained with `ignore_eos` and the constrained reply's
    token count (the usage's, not the text chunks'), and the overhead is the median of
    the pairs' ratios."""
    import asyncio

    from aiohttp import web

    from pdmesh.loadtest.bench.llamacpp import Endpoint
    from pdmesh.loadtest.bench.schemas import bench

    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        constrained = "response_format" in body
        tokens = 12 if constrained else body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # Two tokens a chunk; a constrained token takes 2 ms, a free one 1 ms.
        for _ in range(tokens // 2):
            await asyncio.sleep(0.004 if constrained else 0.002)
            await resp.write(b'data: {"choices": [{"delta": {"content": "ab"}}]}\n\n')
        await resp.write(b'data: {"choices": [{"delta": {}, "finish_reason": "length"}], '
                         b'"usage": {"completion_tokens": %d}}\n\n' % tokens)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    report: dict[str, object] = {}
    try:
        await bench([Endpoint("stand", f"http://127.0.0.1:{port}/v1", "m")], [0.0, 0.7], 3,
                    256, 30.0, report)
    finally:
        await runner.cleanup()
    free = [b for b in seen if "response_format" not in b]
    assert len(free) == 3 and all(b["ignore_eos"] and b["max_tokens"] == 12 for b in free)
    assert len(seen) == 3 * 2 + 3, "no free twin at t=0.7"
    assert report["overhead_pairs_stand"] == 3
    assert report["valid_rate_stand_t0"] == 0.0  # `length`: none valid
    assert 0.5 < float(report["grammar_overhead_stand"]) < 2.0  # type: ignore[arg-type]
    assert 1.0 < float(report["tpot_ms_stand"]) < 6.0  # type: ignore[arg-type]
