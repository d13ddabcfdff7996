"""Tokenization never stalls the gateway's event loop, and one tenant cannot take the
tokenizer threads from the others.

A real gateway (in this process) on a real nats-server in front of the scripted mesh of
tests/support/scripted_mesh.py. One tenant sends prompts that take seconds to tokenize
while another tenant's stream runs: the stream keeps its pace (no gap between its SSE events
over 1 s) and finishes. The tokenizer is SmolLM2's (HF `tokenizers`, when its GGUF is in the
cache: nothing is downloaded here) or a stand-in whose `encode` sleeps as long, without the
GIL, as HF's batch calls run.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

from pdmesh.gateway import app as gateway_app
from pdmesh.services.engine import checkpoint
from pdmesh.services.engine.tokenizer import ByteTokenizer, Tokenizer
from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import Running, ScriptedMesh, gateways

SLOW_S = 1.5  # how long the stand-in tokenizer takes for a long text
MAX_GAP_S = 1.0  # the most a stream may wait between two SSE events
BIG_BYTES = 1_500_000  # a prompt SmolLM2's tokenizer takes ~1.5 s for on a 2-core machine


class SlowTokenizer(ByteTokenizer):
    """The byte tokenizer, but a long text takes SLOW_S (slept: no GIL held, as in HF's
    batch calls)."""

    def encode(self, text: str) -> list[int]:
        if len(text) > 4096:
            time.sleep(SLOW_S)
        return super().encode(text)


@functools.cache
def _smollm2() -> Tokenizer:
    return checkpoint.load_tokenizer("smollm2")[0]


def _tokenizer(kind: str) -> Tokenizer:
    if kind == "slow-bytes":
        return SlowTokenizer()
    if not (checkpoint.cache_dir() / checkpoint.SMOLLM2_FILE).exists():
        pytest.skip("SmolLM2's GGUF is not in the cache (make up fetches it)")
    return _smollm2()


@pytest.fixture
async def gateway(nats_server: NatsServer, monkeypatch
                  ) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    async with gateways(nats_server.url) as start_mesh:

        async def start(tokenizer: Tokenizer, script, **settings) -> Running:
            monkeypatch.setattr(gateway_app, "load_tokenizer",
                                lambda _spec: (tokenizer, "tiny"))
            return await start_mesh(script, **settings)

        yield start


def _big_text(num_bytes: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["the", "quick", "über", "数据", "🙂", "lorem"]
    text = " ".join(rng.choice(words) for _ in range(num_bytes // 5))
    return text.encode()[:num_bytes].decode(errors="ignore")


async def _post(http: aiohttp.ClientSession, run: Running, path: str, body: dict,
                key: str) -> tuple[int, dict]:
    payload = io.BytesIO(json.dumps({"model": "tiny", **body}).encode())
    async with http.post(run.base + path, data=payload,
                         headers={"Authorization": f"Bearer {key}",
                                  "Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("kind", ["smollm2", "slow-bytes"])
async def test_long_tokenizations_do_not_stall_another_tenants_stream(gateway, kind) -> None:
    """alice: two long /tokenize prompts, one long /tokenize chat, one long chat completion
    (over the served context once tokenized: 400), all at once, while bob streams. bob's
    SSE events never stop for 1 s, his stream ends cleanly, and alice gets her answers."""
    tokenizer = _tokenizer(kind)
    attack_done = asyncio.Event()

    async def stream(mesh: ScriptedMesh, rid: str) -> None:
        seq = 0
        while not attack_done.is_set() or seq < 10:
            await mesh.token(rid, seq)
            seq += 1
            await asyncio.sleep(0.05)
        await mesh.token(rid, seq, finish=True)

    run = await gateway(tokenizer, stream, request_timeout_s=30.0, prefill_stall_s=30.0)
    big = _big_text(BIG_BYTES)
    chat = [{"role": "user", "content": big}]

    async def bob() -> tuple[int, list[bytes], float]:
        events, gap, last = [], 0.0, None
        async with aiohttp.ClientSession() as http, http.post(
                run.base + "/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 4000, "stream": True},
                headers={"Authorization": "Bearer sk-dev-bob"}) as resp:
            async for line in resp.content:
                if line.startswith(b"data:"):
                    now = time.monotonic()
                    gap = max(gap, now - last) if last is not None else 0.0
                    last = now
                    events.append(line)
            return resp.status, events, gap

    async def alice() -> list[tuple[int, dict]]:
        await asyncio.sleep(0.3)  # bob's tokens are flowing
        try:
            async with aiohttp.ClientSession() as http:
                return await asyncio.gather(*(
                    _post(http, run, path, body, "sk-dev-alice") for path, body in (
                        ("/tokenize", {"prompt": big}), ("/tokenize", {"prompt": big}),
                        ("/tokenize", {"messages": chat}),
                        ("/v1/chat/completions", {"messages": chat, "max_tokens": 1}))))
        finally:
            attack_done.set()

    (status, events, gap), answers = await asyncio.gather(bob(), alice())
    assert status == 200
    assert not any(b'"error"' in e for e in events), events[-2:]
    assert events[-1].strip() == b"data: [DONE]"
    assert gap < MAX_GAP_S, f"bob's stream stalled {gap:.2f}s"
    (s1, t1), (s2, t2), (s3, t3), (s4, t4) = answers
    assert (s1, s2, s3) == (200, 200, 200), answers
    assert t1["tokens"] == t2["tokens"] and t1["count"] == len(t1["tokens"]) > 0
    assert t3["count"] > t1["count"]  # the chat template's turns around the same text
    assert s4 == 400 and t4["error"]["code"] == "context_length_exceeded", t4
    async with aiohttp.ClientSession() as http:  # short prompts: the same ids as before
        status, small = await _post(http, run, "/tokenize", {"prompt": "über 数据 🙂"},
                                    "sk-dev-alice")
        assert status == 200 and small["tokens"] == tokenizer.encode("über 数据 🙂")
        status, text = await _post(http, run, "/detokenize", {"tokens": small["tokens"]},
                                   "sk-dev-alice")
        assert status == 200 and text["prompt"] == "über 数据 🙂"


async def test_a_tenant_over_its_share_of_the_tokenizer_gets_429_and_others_keep_theirs(
        gateway) -> None:
    """With --max-body-bytes 64 KiB a tenant may have 128 KiB of text in the tokenizer and
    run at most two of its four threads. alice sends eight 20 KiB prompts at once: six are
    taken (two run, four wait without a thread) and two are refused, 429 `tokenizer_busy`;
    bob's prompt meanwhile is tokenized at once, on a thread alice could not take."""

    async def answer(mesh: ScriptedMesh, rid: str) -> None:
        await mesh.token(rid, 0, finish=True)

    run = await gateway(SlowTokenizer(), answer, max_body_bytes=64 * 1024)
    prompt = "x" * 20_000

    async def bob() -> tuple[int, float]:
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as http:
            status, _ = await _post(http, run, "/tokenize", {"prompt": "hello"}, "sk-dev-bob")
        return status, time.monotonic() - t0

    async def alice() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as http:
            return await asyncio.gather(*(
                _post(http, run, "/tokenize", {"prompt": prompt}, "sk-dev-alice")
                for _ in range(8)))

    (bob_status, bob_s), answers = await asyncio.gather(bob(), alice())
    statuses = sorted(status for status, _ in answers)
    assert statuses == [200] * 6 + [429] * 2, answers
    refused = next(reply for status, reply in answers if status == 429)["error"]
    assert refused["code"] == "tokenizer_busy" and refused["type"] == "rate_limit_error"
    assert "too much tokenization in flight" in refused["message"]
    assert bob_status == 200 and bob_s < 0.5 * SLOW_S, f"bob waited {bob_s:.2f}s"
    async with aiohttp.ClientSession() as http:  # alice's share is hers again once done
        status, reply = await _post(http, run, "/v1/completions",
                                    {"prompt": prompt, "max_tokens": 1}, "sk-dev-alice")
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
