import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh.transports import FrameError, make_transport
from pdmesh.transports.framing import (
    HEADER_SIZE,
    Kind,
    decode_header,
    encode_header,
    reservation_bytes,
)
from tests.support.fuzz import EXAMPLES


def test_roundtrip():
    key = reservation_bytes(str(uuid.uuid4()))
    raw = encode_header(Kind.DATA, key, 5, seq=2, dest_page_id=9, page_index=2, token_count=16,
                        aux=-1, payload_len=4096, payload_checksum=123)
    assert len(raw) == HEADER_SIZE == 96
    h = decode_header(raw)
    assert (h.kind, h.reservation, h.epoch, h.seq, h.dest_page_id, h.page_index) == (
        Kind.DATA, key, 5, 2, 9, 2)
    assert (h.token_count, h.aux, h.payload_len, h.payload_checksum) == (16, -1, 4096, 123)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE))
def test_random_bytes_only_raise_frame_error(data):
    with pytest.raises(FrameError):
        decode_header(data)


_VALID = encode_header(Kind.DATA, bytes(range(16)), 1, payload_len=10, payload_checksum=1)


def test_every_single_bit_flip_is_detected():
    for bit in range(HEADER_SIZE * 8):  # all of them
        raw = bytearray(_VALID)
        raw[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FrameError):
            decode_header(bytes(raw))


def test_non_buffer_and_bad_ids():
    with pytest.raises(FrameError):
        decode_header(12345)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reservation_bytes("not-a-uuid")


def test_make_transport_kinds():
    with pytest.raises(ValueError, match="unknown transport kind"):
        make_transport("carrier-pigeon")
    assert make_transport("tcp").scheme == "tcp"
