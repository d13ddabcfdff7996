"""Fuzzing of every decoder at the trust boundaries (I8): HTTP bodies, control messages,
transport frame headers: no crash, no hang, a clean rejection (the boundary's own error
type) or a well-formed accepted value.

`make test` draws 1,000 cases each; `make test-fuzz` (PDMESH_FUZZ_EXAMPLES=10000, a CI
stage) draws 10,000."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdmesh.gateway.schema import ApiError, parse_chat, parse_completion
from pdmesh.services.protocol import messages as m
from pdmesh.transports.base import ExpectedTransfer, TransportStats
from pdmesh.transports.framing import HEADER_SIZE, FrameError, Kind, decode_header, encode_header
from pdmesh.transports.receiver import ReceiveTable
from tests.support.fuzz import EXAMPLES

pytestmark = pytest.mark.slow
CASES = settings(max_examples=EXAMPLES, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))

json_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | \
    st.floats(allow_nan=True) | st.text(max_size=20)
# Shallow values keep 10,000 cases cheap; nesting one level deep still reaches every
# nested field the schema has (messages[].role/content, stream_options.include_usage).
json_values = json_scalars | st.lists(json_scalars, max_size=3) | st.dictionaries(
    st.sampled_from(["role", "content", "include_usage", "type", "text"]),
    json_scalars | st.lists(st.dictionaries(st.sampled_from(["role", "content", "type"]),
                                            json_scalars, max_size=3), max_size=2), max_size=3)
KEYS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
        "stream", "stream_options", "n", "logprobs", "echo", "user", "role", "content",
        "include_usage", "cache_salt", "max_completion_tokens", "suffix", "best_of",
        "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "ignore_eos", "min_tokens", "stop_token_ids", "top_logprobs", "skip_special_tokens"]
bodies = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8)


def _body_bytes(draw_body: object, raw: bytes | None) -> bytes:
    return raw if raw is not None else json.dumps(draw_body, allow_nan=True).encode()


@CASES
@given(body=bodies, raw=st.none() | st.binary(max_size=64), chat=st.booleans())
def test_http_bodies(body: dict, raw: bytes | None, chat: bool) -> None:
    data = _body_bytes(body, raw)
    try:
        parsed = (parse_chat if chat else parse_completion)(data)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message
        assert set(exc.body()["error"]) == {"message", "type", "param", "code"}
        return
    # Accepted: the validated struct respects every documented bound.
    assert parsed.model is not None
    assert parsed.max_tokens is None or parsed.max_tokens >= 1
    assert not hasattr(parsed, "cache_salt")  # a client can never carry a salt


MESSAGE_TYPES = [m.SubmitRequest, m.SubmitReply, m.ReserveRequest, m.ReserveReply,
                 m.PrefillDispatch, m.Release, m.Abort, m.StreamEvent, m.Heartbeat,
                 m.StatsReply]
SAMPLES = [
    m.SubmitRequest(request_id="r", tenant="t", cache_salt="s", prompt_ids=[1, 2],
                    max_tokens=3),
    m.TokenEvent(request_id="r", seq=0, token_ids=[5]),
    m.Heartbeat(worker_id="w", role=m.Role.DECODE, model="tiny"),
    m.Release(request_id="r", reservation_id="x", outcome=m.Outcome(code=m.Code.ABORTED)),
    m.Rejected(request_id="r", outcome=m.Outcome(code=m.Code.SATURATED, detail="busy")),
    m.Reserved(request_id="r", reservation=m.Reservation(
        reservation_id="x", epoch=3, page_ids=[1, 2], page_tokens=16, page_bytes=64,
        data_address="tcp://127.0.0.1:1")),
    m.StreamFailed(request_id="r", outcome=m.Outcome(code=m.Code.INTERNAL)),
]


@st.composite
def control_payloads(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=128))
    base = bytearray(m.encode(draw(st.sampled_from(SAMPLES))))
    for _ in range(draw(st.integers(1, 4))):
        if not base:
            break
        i = draw(st.integers(0, len(base) - 1))
        base[i] = draw(st.integers(0, 255))
    return bytes(base[: draw(st.integers(0, len(base)))])


DECODERS = {t: m.Decoder(t) for t in MESSAGE_TYPES}


@CASES
@given(data=control_payloads(), typ=st.sampled_from(MESSAGE_TYPES))
def test_control_messages(data: bytes, typ: type) -> None:
    try:
        obj = DECODERS[typ].decode("fuzz", data)
    except m.MessageError as exc:
        assert exc.size == len(data)
        return
    assert isinstance(obj, typ)
    assert msgspec.msgpack.decode(m.encode(obj), type=typ) == obj


PAGE_BYTES, PAGE_TOKENS, NUM_TOKENS = 64, 4, 10
RID = "0123456789abcdef0123456789abcdef"
fields = st.fixed_dictionaries({
    "kind": st.sampled_from(list(Kind)),
    "reservation": st.sampled_from([bytes.fromhex(RID), bytes(16)]) | st.binary(min_size=16,
                                                                                max_size=16),
    "epoch": st.sampled_from([7, 6, 8]) | st.integers(0, 2**64 - 1),
    "seq": st.integers(0, 5) | st.integers(0, 2**32 - 1),
    "dest_page_id": st.sampled_from([3, 9, 4]) | st.integers(0, 2**32 - 1),
    "page_index": st.integers(0, 4) | st.integers(0, 2**32 - 1),
    "token_count": st.integers(0, 12) | st.integers(0, 2**32 - 1),
    "aux": st.integers(-2**63, 2**63 - 1),
    "payload_len": st.sampled_from([PAGE_BYTES, 0]) | st.integers(0, 2**64 - 1),
    "payload_checksum": st.integers(0, 2**64 - 1),
})


@CASES
@given(f=fields, flip=st.none() | st.integers(0, HEADER_SIZE * 8 - 1))
def test_frame_headers_against_a_live_lease(f: dict, flip: int | None) -> None:
    """A checksummed header with arbitrary fields, optionally with one bit flipped, is
    decoded and validated against a live expectation: rejected, or accepted only when it
    names exactly the live reservation, epoch, next page and its length."""
    raw = bytearray(encode_header(**f))
    if flip is not None:
        raw[flip // 8] ^= 1 << (flip % 8)
    try:
        h = decode_header(bytes(raw))
    except FrameError:
        return
    assert flip is None or bytes(raw) == encode_header(**f)  # a flip is always detected

    async def check() -> None:
        pages = [memoryview(bytearray(PAGE_BYTES)) for _ in range(3)]
        table = ReceiveTable(TransportStats(), None)
        fut = table.expect(ExpectedTransfer(
            reservation_id=RID, epoch=7, page_ids=(3, 9, 4), page_buffers=pages,
            page_bytes=PAGE_BYTES, page_tokens=PAGE_TOKENS, num_tokens=NUM_TOKENS))
        if h.kind is Kind.DATA:
            slot, nack = table.check_data(h, conn_id=1)
            if slot is not None:
                assert nack is None
                assert (h.reservation, h.epoch, h.page_index, h.dest_page_id,
                        h.payload_len) == (bytes.fromhex(RID), 7, 0, 3, PAGE_BYTES)
                assert h.token_count == PAGE_TOKENS
            else:
                assert nack is not None
        elif h.kind is Kind.COMMIT:
            reply = table.check_commit(h, conn_id=1)
            assert reply  # nothing was sent: a commit can only be refused
            assert not fut.done() or fut.exception() is not None
        table.close()
        fut.cancel()

    _LOOP.run_until_complete(check())


_LOOP = asyncio.new_event_loop()  # one loop for all 10,000 cases (asyncio.run is slow)


@pytest.fixture(scope="module", autouse=True)
def _close_loop() -> object:
    yield
    _LOOP.close()
