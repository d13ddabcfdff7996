"""Size is never the failure.

A prompt of megabytes (far over the served context, under the body limit) is a 400
`context_length_exceeded` decided by the gateway before any control message is sent — not
a 500 from a NATS submit over its max payload. A prompt right at the served context is
served. And every control message of a prompt up to `natsauth.MAX_CONTEXT_TOKENS` fits in
the max payload the mesh's NATS servers are configured with, by construction: checked on
the largest message at the worst token-id encoding, and on the live mesh's server.
"""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest

from pdmesh.services.ops import natsauth
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh
from tests.support.meshstats import query_stats, worker_stats

MIB = 1024 * 1024


def admission_rejections(mesh: Mesh) -> float:
    """Admission's own rejection count (its worker id shares the run's suffix)."""
    suffix = next(iter(worker_stats(mesh.nats_url, listen_s=0.6))).rsplit("-", 1)[1]
    (reply,) = query_stats(mesh.nats_url, [(m.Role.ADMISSION, f"admission-{suffix}")])
    return reply.counters["rejections"]


@pytest.mark.mesh
def test_a_multi_megabyte_prompt_is_a_400_not_a_500(live_mesh: Mesh) -> None:
    rejected_before = admission_rejections(live_mesh)
    prompt = "long prompt " * 300_000  # ~3.6 MB: ~3.6 M tokens of the byte tokenizer
    ids = [65] * 1_000_000  # ~2 MB of JSON token ids
    for path, body in (
            ("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4}),
            ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                      "messages": [{"role": "user", "content": prompt}]}),
            ("/v1/completions", {"model": "tiny", "prompt": prompt}),  # default max_tokens
            ("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 4}),
            ("/v1/completions", {"model": "tiny", "prompt": ids, "stream": True})):
        status, reply = live_mesh.http("POST", path, body, timeout=120)
        assert status == 400, (path, reply)
        assert reply["error"]["code"] == "context_length_exceeded", reply
        assert f"maximum context length is {live_mesh.max_context}" in \
            reply["error"]["message"]
    # Decided by the gateway: no control message carried these prompts to admission.
    assert admission_rejections(live_mesh) == rejected_before
    # The mesh still serves.
    status, reply = live_mesh.http("POST", "/v1/completions",
                                   {"model": "tiny", "prompt": "still here", "max_tokens": 2})
    assert status == 200, reply


@pytest.mark.mesh
def test_a_prompt_right_at_the_served_context_is_served(live_mesh: Mesh) -> None:
    """prompt + max_tokens == the served context: served, as text and as token ids; one
    more token is the 400."""
    context = live_mesh.max_context
    assert context > 1000
    text = "".join(chr(97 + i % 26) for i in range(context - 1))  # one token a byte (tiny)
    for prompt in (text, [97 + i % 26 for i in range(context - 1)]):
        status, reply = live_mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
            timeout=120)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == context - 1
        assert reply["usage"]["completion_tokens"] == 1
    status, reply = live_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": text + "z", "max_tokens": 1})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply


def _largest_control_messages(context: int) -> dict[str, int]:
    """Encoded sizes of the largest messages that carry a prompt of `context` tokens, at
    the worst msgpack encoding of every id (5 bytes: ids >= 2**16, any vocabulary under
    2**32), the repetition penalty on (its distinct ids ride along) and one-token pages
    (one page id per token)."""
    ids = [(1 << 31) - 1 - i for i in range(context)]
    sampling = m.Sampling(temperature=1.0, top_p=0.9, seed=-(1 << 62), top_k=50,
                          repetition_penalty=1.1, stop_token_ids=[(1 << 31) - 1] * 64,
                          logprobs=20, penalty_prompt_ids=ids)
    request_id = "chatcmpl-" + "f" * 32 + "-7"
    submit = m.SubmitRequest(request_id=request_id, tenant="t" * 64, cache_salt="s" * 64,
                             prompt_ids=ids, max_tokens=context, sampling=sampling,
                             stream_key="k" * 64)
    ticket = m.AdmittedTicket(request_id=request_id, tenant="t" * 64, cache_salt="s" * 64,
                              prompt_len=context, max_tokens=context,
                              prefill_worker="p" * 64, decode_worker="d" * 64,
                              expires_at=1e12, nonce="n" * 64, signature="g" * 128)
    dispatch = m.PrefillDispatch(
        ticket=ticket, prompt_ids=ids, sampling=sampling, grant="g" * 128,
        stream_key="k" * 64, data_key="k" * 64,
        reservation=m.Reservation(reservation_id="r" * 64, epoch=1 << 62,
                                  page_ids=[(1 << 31) - 1 - i for i in range(context)],
                                  page_tokens=1, page_bytes=1 << 30, data_address="a" * 256))
    return {"submit": len(m.encode(submit)), "dispatch": len(m.encode(dispatch))}


def test_control_messages_fit_the_max_payload_at_the_largest_supported_context() -> None:
    sizes = _largest_control_messages(natsauth.MAX_CONTEXT_TOKENS)
    # Headroom for headers, subjects and fields added later: at most half the limit.
    assert max(sizes.values()) <= natsauth.MAX_PAYLOAD_BYTES // 2, sizes
    # ... and the check can fail: nats-server's default (1 MiB) would not carry it.
    assert max(sizes.values()) > MIB, sizes
    assert f"max_payload: {natsauth.MAX_PAYLOAD_BYTES}\n" in natsauth.server_config(
        natsauth.role_identities().values())


@pytest.mark.mesh
def test_the_live_meshs_nats_carries_the_largest_control_message(live_mesh: Mesh) -> None:
    """`pdmesh up`'s embedded nats-server announces the mesh's max payload, and a message
    of the largest control message's size goes through it."""
    size = max(_largest_control_messages(natsauth.MAX_CONTEXT_TOKENS).values())

    async def check() -> int:
        # As the processes that send and read such messages on the token stream would:
        # prefill's identity publishes there, the gateway's reads it (an id nobody uses).
        sender = await nats.connect(live_mesh.nats_url_for("prefill"))
        reader = await nats.connect(live_mesh.nats_url_for("gateway"))
        try:
            got: asyncio.Future[int] = asyncio.get_running_loop().create_future()

            async def on_msg(msg) -> None:
                if not got.done():
                    got.set_result(len(msg.data))

            subject = m.tokens_subject("size-check-" + uuid.uuid4().hex)
            await reader.subscribe(subject, cb=on_msg)
            await reader.flush()
            assert sender.max_payload == natsauth.MAX_PAYLOAD_BYTES
            await sender.publish(subject, b"\0" * size)
            return await asyncio.wait_for(got, 10)
        finally:
            await sender.close()
            await reader.close()

    assert asyncio.run(check()) == size
