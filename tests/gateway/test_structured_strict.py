"""OpenAI's strict mode through the gateway's HTTP API: `response_format` json_schema with
`strict: true` reaches the workers with every object closed (and a keyword outside OpenAI's
subset is a 400 naming it); without strict the schema goes as the client wrote it. A real
gateway on a real nats-server, in front of a scripted mesh that records what it is sent."""

from __future__ import annotations

import json

import aiohttp

from pdmesh.services.protocol import messages as m
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import ScriptedMesh, gateways

OPEN = {"type": "object", "properties": {
    "city": {"type": "string"},
    "where": {"type": "object", "properties": {"country": {"type": "string"}}},
    "tags": {"type": "array", "items": {"type": "object",
                                         "properties": {"t": {"type": "string"}}}}},
    "required": ["city"]}


async def _one_token(mesh: ScriptedMesh, rid: str) -> None:
    await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord("{")],
                                      finish=m.FINISHED_LENGTH))


def _format(strict: bool | None, schema: dict) -> dict:
    spec: dict = {"name": "city", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


def _objects(schema: dict) -> list[dict]:
    found = [schema] if schema.get("type") == "object" else []
    subs = [*schema.get("properties", {}).values(), *([schema["items"]] if "items" in schema
                                                       else [])]
    for sub in subs:
        found += _objects(sub)
    return found


async def test_strict_closes_every_object_and_non_strict_keeps_the_schema(
        nats_server: NatsServer) -> None:
    async with gateways(nats_server.url) as start:
        gw = await start(_one_token)
        for strict in (True, False, None):
            for path, body in (
                    ("/v1/completions", {"prompt": "city"}),
                    ("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "city"}]})):
                status, reply, _ = await gw.post({**body, "max_tokens": 1,
                                                  "response_format": _format(strict, OPEN)},
                                                 path)
                assert status == 200, reply
                sent = json.loads(gw.mesh.submits[-1].sampling.structured.spec)
                objects = _objects(sent)
                assert len(objects) == 3
                if strict:
                    assert all(o["additionalProperties"] is False for o in objects), sent
                else:  # JSON Schema's meaning: other keys allowed where it does not say
                    assert sent == OPEN


async def test_strict_refuses_a_keyword_outside_its_subset(nats_server: NatsServer) -> None:
    schema = {**OPEN, "properties": {**OPEN["properties"], "code": {
        "type": "object", "properties": {}, "minProperties": 1}}}
    async with gateways(nats_server.url) as start:
        gw = await start(_one_token)
        status, reply, _ = await gw.post({"prompt": "city", "max_tokens": 1,
                                          "response_format": _format(True, schema)})
        assert status == 400, reply
        assert reply["error"]["param"] == "response_format"
        assert "'minProperties'" in reply["error"]["message"]
        assert "properties.code" in reply["error"]["message"]
        status, reply, _ = await gw.post({"prompt": "city", "max_tokens": 1,
                                          "response_format": _format(True, {
                                              **OPEN, "additionalProperties": True})})
        assert status == 400 and "additionalProperties" in reply["error"]["message"], reply
        # without strict the same schema compiles as JSON Schema
        status, reply, _ = await gw.post({"prompt": "city", "max_tokens": 1,
                                          "response_format": _format(False, schema)})
        assert status == 200, reply
        assert len(gw.mesh.submits) == 1, "a refused request never reaches the mesh"



def _nested_body(depth: int, strict: bool) -> bytes:
    """A completion request whose schema nests `depth` objects, written as text (the
    client's own JSON encoder has a depth limit of its own)."""
    schema = '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth
    return ('{"model": "tiny", "prompt": "city", "max_tokens": 1, "response_format": '
            '{"type": "json_schema", "json_schema": {"name": "deep", "strict": %s, '
            '"schema": %s}}}' % ("true" if strict else "false", schema)).encode()


async def test_a_body_nested_too_deeply_is_a_400_not_a_crash(nats_server: NatsServer) -> None:
    """The JSON decoder stops at a nesting depth with RecursionError: a clear 400, and the
    gateway serves the next request."""
    async with gateways(nats_server.url) as start:
        gw = await start(_one_token)
        async with aiohttp.ClientSession() as http:
            for strict in (True, False):
                async with http.post(gw.base + "/v1/completions",
                                     data=_nested_body(5000, strict), headers={
                                         "Authorization": "Bearer sk-dev-alice",
                                         "Content-Type": "application/json"}) as resp:
                    reply = await resp.json()
                    assert resp.status == 400, reply
                    assert "too deeply" in reply["error"]["message"], reply
        status, reply, _ = await gw.post({"prompt": "city", "max_tokens": 1,
                                          "response_format": _format(True, OPEN)})
        assert status == 200, reply
