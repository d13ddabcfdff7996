"""Containment on a real mesh: a second prefill worker's stolen credentials cannot touch a
request that worker does not serve.

`pdmesh up` with two prefill and two decode workers (each its own process and NATS user).
While a streamed request is live, the test connects with the NATS credentials of the
prefill worker that is *not* serving it (the one whose stats never heard of it) and tries
everything its permissions allow or that used to work: read every reply (`_INBOX.>`), write
the request's answer and failure on its token stream, forge its Release and progress to its
decode worker, and heartbeat, on its own subject, as another worker. The answer equals the
oracle's; NATS refuses the reads; the gateway and decode drop every write and count it
(`pdmesh:refused_messages_total`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import aiohttp
import nats
import pytest

from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, run_mesh
from tests.support.meshstats import connect
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]
PROMPT = "The quick brown fox"
MAX_TOKENS = 600  # long enough that the request is still decoding while the attack runs


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    with run_mesh("--prefill", "2", "--decode", "2", "--kv-tokens", "4096") as mesh:
        yield mesh


def _refused(metrics: str, service: str, kind: str) -> float:
    for labels, value in re.findall(r"^pdmesh:refused_messages_total\{(.*)\} (\S+)$",
                                    metrics, re.M):
        if {f'service="{service}"', f'kind="{kind}"'} <= set(labels.split(",")):
            return float(value)
    return 0.0


async def _stats(tools: nats.NATS, beats: dict[str, m.Heartbeat]) -> dict[str, m.StatsReply]:
    dec = m.Decoder(m.StatsReply)
    out = {}
    for wid, beat in beats.items():
        reply = await tools.request(m.stats_subject(beat.role.value, wid), b"", timeout=2)
        out[wid] = dec.decode("stats", reply.data)
    return out


async def _attack(mesh: Mesh) -> dict:
    tools = await connect(mesh.nats_url)
    beats: dict[str, m.Heartbeat] = {}

    async def on_beat(msg) -> None:
        beat = m.Decoder(m.Heartbeat).decode(msg.subject, msg.data)
        beats[beat.worker_id] = beat

    await tools.subscribe(m.HEARTBEAT_WILDCARD, cb=on_beat)
    deadline = time.monotonic() + 10
    while len([b for b in beats.values() if b.role is not m.Role.GATEWAY]) < 4:
        assert time.monotonic() < deadline, beats
        await asyncio.sleep(0.1)
    decodes = sorted(w for w, b in beats.items() if b.role is m.Role.DECODE)
    base = f"http://127.0.0.1:{mesh.gateway_port}"
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
                "temperature": 0},
                headers={"Authorization": "Bearer sk-dev-alice"}) as resp:
            assert resp.status == 200
            text, rid = "", ""
            lines = resp.content.__aiter__()
            while not rid:
                line = (await lines.__anext__()).decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    rid, text = chunk["id"], chunk["choices"][0]["text"]
            # The request is live: find who serves it, and steal the other prefill's keys.
            stats = await _stats(tools, beats)
            serving = {w for w, s in stats.items() if rid in s.request_ids}
            other = next(w for w, b in beats.items()
                         if b.role is m.Role.PREFILL and w not in serving)
            serving_decode = next(w for w in decodes if w in serving)
            other_decode = next(w for w in decodes if w != serving_decode)
            errors: list[str] = []

            async def on_error(exc: Exception) -> None:
                errors.append(str(exc))

            evil = await connect(mesh.nats_url_for(other.rsplit("-", 1)[0]),
                                 error_cb=on_error, allow_reconnect=False)
            assert evil.connected_url is not None
            read: list[str] = []

            async def record(msg) -> None:
                read.append(msg.subject)

            await evil.subscribe("_INBOX.>", cb=record)
            await evil.subscribe(f"{m.inbox_prefix('gateway')}.>", cb=record)
            stream = m.tokens_subject(rid)
            for seq in range(3):
                await evil.publish(stream, m.encode(m.TokenEvent(
                    request_id=rid, seq=seq, token_ids=[1, 2, 3], finish=m.FINISHED_STOP)))
            await evil.publish(stream, m.encode(m.StreamFailed(
                request_id=rid, outcome=m.Outcome(code=m.Code.ABORTED, detail="forged"))))
            for msg in (m.Release(request_id=rid, reservation_id="guessed",
                                  outcome=m.Outcome(code=m.Code.ABORTED, detail="forged")),
                        m.PrefillProgress(request_id=rid, reservation_id="guessed",
                                          done_tokens=1, total_tokens=2)):
                await evil.publish(m.release_subject(serving_decode), m.encode(msg))
            for _ in range(3):
                await evil.publish(m.heartbeat_subject("prefill", other), m.encode(
                    m.Heartbeat(worker_id=other_decode, role=m.Role.DECODE, model="tiny",
                                draining=True, ready=False, sent_at=time.time())))
            await evil.flush()
            # Still decoding after every attempt went out: they reached a live request.
            live = (await _stats(tools, {serving_decode: beats[serving_decode]}))[
                serving_decode].live_leases
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        await asyncio.sleep(0.5)  # the heartbeats' effect, if any, and the counters
        gateway_metrics = await (await http.get(mesh.metrics_url)).text()
        decode_metrics = await (await http.get(
            beats[serving_decode].http_address + "/metrics")).text()
        after = await _stats(tools, beats)
        await evil.close()
    await tools.close()
    return {"text": text, "live": live, "read": read, "errors": errors,
            "gateway": gateway_metrics, "decode": decode_metrics, "after": after,
            "other_decode": other_decode}


def test_a_second_prefills_credentials_cannot_touch_a_request_it_does_not_serve(
        mesh: Mesh) -> None:
    seen = asyncio.run(asyncio.wait_for(_attack(mesh), 90))
    assert seen["live"] >= 1, "the request ended before the attack: nothing was shown"
    assert seen["text"] == expected_text(PROMPT, MAX_TOKENS)
    assert seen["read"] == []
    assert sum("ermission" in e for e in seen["errors"]) >= 2, seen["errors"]
    assert _refused(seen["gateway"], "gateway", "stream_mac") >= 4
    assert _refused(seen["gateway"], "gateway", "heartbeat_subject") >= 3
    assert _refused(seen["decode"], "decode", "peer_mac") >= 2
    assert _refused(seen["decode"], "decode", "heartbeat_subject") >= 3
    # The decode worker named in the forged heartbeats still serves.
    assert seen["other_decode"] in seen["after"]
    status, body = mesh.http("POST", "/v1/completions",
                             {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert status == 200, body
