"""The gateway's graceful drain and its resume of a choice whose worker was lost, on a real
gateway in front of a scripted mesh (tests/support/scripted_mesh.py).

Drain: `POST /drain` on the metrics port starts it; new requests get 503 `draining` with
Retry-After at once; open streams finish; one still open at the drain timeout ends with an
error event (counted as cut), never a dropped connection.
Resume: a `worker_drained` failure after some tokens makes the gateway submit the choice
again as prompt + the tokens the client got, with the sampler's index carried on and the
lost worker avoided, and splice the new stream onto the client's.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.service import ServiceState
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import DECODE, ScriptedMesh, gateways

pytestmark = pytest.mark.mesh


async def _stream(base: str, prompt: str, max_tokens: int,
                  **fields: object) -> tuple[int, list[bytes]]:
    async with aiohttp.ClientSession() as http, http.post(
            f"{base}/v1/completions", json={"model": "tiny", "prompt": prompt,
                                            "max_tokens": max_tokens, "stream": True,
                                            "temperature": 0, **fields},
            headers={"Authorization": "Bearer sk-dev-bob"}) as resp:
        return resp.status, [line async for line in resp.content if line.startswith(b"data:")]


def _letters(lines: list[bytes]) -> str:
    out = []
    for line in lines:
        body = line[6:].strip()
        if body == b"[DONE]":
            continue
        obj = json.loads(body)
        out += [c.get("text") or "" for c in obj.get("choices", [])]
    return "".join(out)


async def _letters_script(mesh: ScriptedMesh, rid: str, n: int = 40) -> None:
    for seq in range(n):
        await mesh.send(rid, m.TokenEvent(request_id=rid, seq=seq, token_ids=[ord("a")],
                                          finish=m.FINISHED_LENGTH if seq == n - 1 else None))
        await asyncio.sleep(0.05)


async def test_a_draining_gateway_refuses_new_requests_and_finishes_open_ones(
        nats_server: NatsServer) -> None:
    async with gateways(nats_server.url) as start:
        run = await start(_letters_script, drain_timeout_s=20.0)
        opened = asyncio.ensure_future(_stream(run.base, "hi", 40))
        await asyncio.sleep(0.4)  # the stream is under way
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{run.gw.rt.metrics_port}/drain") as resp:
                assert resp.status == 202
            await asyncio.sleep(0.1)
            async with http.post(f"{run.base}/v1/completions",
                                 json={"model": "tiny", "prompt": "late", "max_tokens": 2},
                                 headers={"Authorization": "Bearer sk-dev-bob"}) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "draining"
        status, lines = await opened
        assert status == 200 and lines[-1] == b"data: [DONE]\n", lines[-2:]
        assert _letters(lines) == "a" * 40
        deadline = time.monotonic() + 10
        while run.gw.rt.state is not ServiceState.CLOSED:
            assert time.monotonic() < deadline, "the drain did not end after its stream"
            await asyncio.sleep(0.05)
        assert run.gw.rt.drain_cut.labels("gateway")._value.get() == 0


async def test_a_stream_open_at_the_drain_timeout_ends_with_an_error_event(
        nats_server: NatsServer) -> None:
    async with gateways(nats_server.url) as start:
        run = await start(lambda mesh, rid: _letters_script(mesh, rid, 200),
                          drain_timeout_s=0.5)
        opened = asyncio.ensure_future(_stream(run.base, "hi", 200))
        await asyncio.sleep(0.3)
        await run.gw.rt.drain("test")
        status, lines = await asyncio.wait_for(opened, 10)
        assert status == 200
        assert b'"error"' in lines[-1] and b"shutting down" in lines[-1], lines[-1]
        assert run.gw.rt.drain_cut.labels("gateway")._value.get() == 1


async def test_a_lost_workers_choice_resumes_from_the_tokens_it_delivered(
        nats_server: NatsServer) -> None:
    """"abcde" from the first workers, then their decode drains the request away; the
    resubmission carries prompt + those 5 tokens, start_index 5, the rest of max_tokens and
    the lost worker; "fghij" from the new stream completes the client's one stream."""
    first, resumed = "abcde", "fghij"

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        if not rid.endswith("-r1"):
            for seq, ch in enumerate(first):
                await mesh.send(rid, m.TokenEvent(request_id=rid, seq=seq,
                                                  token_ids=[ord(ch)]))
            await mesh.send(rid, m.StreamFailed(request_id=rid, outcome=m.Outcome(
                code=m.Code.WORKER_DRAINED, worker="dec-gone", detail="drained")))
            return
        for seq, ch in enumerate(resumed):
            await mesh.send(rid, m.TokenEvent(
                request_id=rid, seq=seq, token_ids=[ord(ch)],
                finish=m.FINISHED_LENGTH if seq == len(resumed) - 1 else None))

    async with gateways(nats_server.url) as start:
        run = await start(script)
        status, lines = await _stream(run.base, "hi", 10)
        assert status == 200 and lines[-1] == b"data: [DONE]\n", lines[-2:]
        assert _letters(lines) == first + resumed
        original, again = run.mesh.submits
        assert again.resumes == original.request_id
        assert again.prompt_ids == [*original.prompt_ids, *map(ord, first)]
        assert again.max_tokens == original.max_tokens - len(first)
        assert again.sampling.start_index == len(first)
        assert again.sampling.seed == original.sampling.seed
        assert again.avoid_workers == ["dec-gone"]
        assert again.stream_key != original.stream_key
        assert original.request_id in run.mesh.aborts  # the lost attempt let go at once
        metrics = await run.metrics()
        assert metrics[("pdmesh:requests_migrated_total", frozenset({
            ("model_name", "tiny"), ("from_role", "decode"),
            ("cause", "worker_drained")}))] == 1


async def test_a_structured_choice_resumes_with_its_grammar_state(
        nats_server: NatsServer) -> None:
    """A structured output resumed after "abc": the resubmission carries the same grammar
    and the delivered tokens to replay into it (prior_output_ids), so the new decode masks
    from where the lost one was, not from the grammar's start."""
    async def script(mesh: ScriptedMesh, rid: str) -> None:
        if not rid.endswith("-r1"):
            for seq, ch in enumerate("abc"):
                await mesh.send(rid, m.TokenEvent(request_id=rid, seq=seq,
                                                  token_ids=[ord(ch)]))
            await mesh.send(rid, m.StreamFailed(request_id=rid, outcome=m.Outcome(
                code=m.Code.WORKER_LOST, worker="dec-gone", detail="lost")))
            return
        await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord("d")],
                                          finish=m.FINISHED_LENGTH))

    async with gateways(nats_server.url) as start:
        run = await start(script)
        status, lines = await _stream(run.base, "hi", 4,
                                      structured_outputs={"regex": "[a-z]{4}"}, priority=-2)
        assert status == 200 and _letters(lines) == "abcd", lines[-2:]
        original, again = run.mesh.submits
        assert original.sampling.structured == m.Structured(kind="regex", spec="[a-z]{4}")
        assert again.sampling.structured == original.sampling.structured
        assert again.sampling.prior_output_ids == [ord(c) for c in "abc"]
        assert again.sampling.start_index == 3
        assert original.priority == again.priority == -2  # admission's order, resumed too


async def test_a_lost_worker_heard_again_is_no_longer_avoided(
        nats_server: NatsServer) -> None:
    """The choice loses dec-0 (resumed on dec-1), dec-0 comes back (heartbeats again, as a
    restarted worker does), then the choice loses dec-2: the third submit avoids dec-2
    alone, so a mesh whose workers restart one at a time never runs out of them."""

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        if rid.endswith("-r2"):
            await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord("c")],
                                              finish=m.FINISHED_LENGTH))
            return
        letter, lost = ("b", "dec-2") if rid.endswith("-r1") else ("a", "dec-0")
        await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord(letter)]))
        if lost == "dec-2":
            await asyncio.sleep(1.5)
            await mesh.nc.publish(m.heartbeat_subject("decode", "dec-0"), m.encode(
                m.Heartbeat(worker_id="dec-0", role=m.Role.DECODE, model="tiny")))
            await asyncio.sleep(0.2)
        await mesh.send(rid, m.StreamFailed(request_id=rid, outcome=m.Outcome(
            code=m.Code.WORKER_LOST, worker=lost, detail=f"{lost} lost")))

    async with gateways(nats_server.url) as start:
        run = await start(script)
        status, lines = await _stream(run.base, "hi", 3)
        assert status == 200 and _letters(lines) == "abc", lines[-2:]
        _, second, third = run.mesh.submits
        assert second.avoid_workers == ["dec-0"]
        assert third.avoid_workers == ["dec-2"]


async def test_a_choice_is_not_resumed_onto_the_worker_it_lost(
        nats_server: NatsServer) -> None:
    """An admission that places the resumed request on the lost worker again (the scripted
    one always answers dec-1) gets no second try there: the stream ends with the loss and
    why it was not resumed."""

    async def script(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.send(rid, m.TokenEvent(request_id=rid, seq=0, token_ids=[ord("a")]))
        mesh.silent = frozenset({DECODE})  # dead: heard no more
        await mesh.send(rid, m.StreamFailed(request_id=rid, outcome=m.Outcome(
            code=m.Code.WORKER_LOST, worker=DECODE, detail="decode worker dec-1 lost")))

    async with gateways(nats_server.url) as start:
        run = await start(script)
        status, lines = await _stream(run.base, "hi", 10)
        assert status == 200
        assert b'"code":"worker_lost"' in lines[-1], lines[-1]
        assert b"placed it on lost worker dec-1 again" in lines[-1], lines[-1]
        assert len(run.mesh.submits) == 2
