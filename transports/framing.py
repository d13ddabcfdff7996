"""Binary frame header of the KV data plane, shared by every transport.

One fixed 96-byte little-endian header precedes every payload:

    magic 4s | version u8 | kind u8 | flags u16 | reservation 16s | epoch u64 | seq u32 |
    dest_page_id u32 | page_index u32 | token_count u32 | aux i64 | payload_len u64 |
    payload_checksum u64 | mac 16s | header_checksum u64

`mac` is HMAC-SHA256 (first 16 bytes) of the 72 body bytes under the reservation's key
(`transfer_key()`: derived from the data key admission made for this reservation, the
reservation id and the epoch; admission sends the data key to the chosen decode and prefill
workers only, so no other worker can compute it). The receiver verifies it against
the live expectation's key before it acts on the header (no payload byte lands, no state
changes otherwise); the COMMIT's body carries the digest of every page checksum, so its MAC
covers every page digest. ACKs are MACed the same way; a NACK for a reservation the
receiver does not hold cannot be (it changes nothing but the sender's own send).

- DATA: one page; `token_count` = valid tokens in that page; payload = the page bytes.
  `flags` may carry `PAUSE`: the sender streams and the pages after this one
  are not final yet, so the next frame may come much later (the receiver then waits for
  it as long as the transfer is live instead of within the progress timeout). `flags` may
  carry `DEFERRED`: `payload_checksum` is not given (0); the receiver checksums the page
  once it landed and the COMMIT's digest verifies it (the ucx sender posts a run of pages
  before it checksums them, so the checksum runs while the receiver copies: transports/
  README.md). Either way no transfer commits unless every page's checksum, as landed,
  matches what the sender computed.
- COMMIT: `page_index` = pages sent, `token_count` = total prompt tokens, `aux` = first
  token, `payload_checksum` = `commit_digest()` of the page checksums in order; no payload.
- ACK: the receiver verified and committed; `token_count` echoes the total.
- NACK: the receiver failed the reservation; `aux` = `Reason`, payload = UTF-8 detail.

Checksum choice: XXH3-64 (xxhash). It runs at memory bandwidth (tens of GB/s on one
core), so checking every page costs a few percent of a loopback transfer, and it has full
64-bit avalanche, unlike Adler-32 (the weak upstream choice: 32 bits, poor mixing on short
or zero-heavy inputs, trivially collidable). crc32c would need a third-party package here
and gives only 32 bits. The header itself carries an XXH3-64 of its first 88 bytes (the
body and the MAC), so a flipped bit anywhere in the header (a page id, an epoch) is
detected before it is trusted.
The header checksum is integrity against faults; the MAC is authentication against
anyone who can reach the port without the key.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
import uuid
from typing import NamedTuple

import xxhash

from .errors import FrameError

MAGIC = b"PDKV"
VERSION = 2
_BODY = struct.Struct("<4sBBH16sQIIIIqQQ")
MAC_SIZE = 16
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + MAC_SIZE + _CHECK.size  # 96
_KEY_LABEL = b"pdmesh-kv\x00"
MAX_PAYLOAD = 1 << 31  # one page is far smaller; bounds scratch drains on a corrupt length
MAX_NACK_DETAIL = 4096
PAUSE = 0x1  # DATA flag: the next frame of this transfer may come late (streamed send)
DEFERRED = 0x2  # DATA flag: no page checksum in this header: the COMMIT's digest verifies it

# accepts any buffer (memoryview, numpy) without copying
checksum = xxhash.xxh3_64_intdigest  # guard: checksum


class Kind(enum.IntEnum):
    DATA = 1
    COMMIT = 2
    ACK = 3
    NACK = 4


_KNOWN_FLAGS = {Kind.DATA: PAUSE | DEFERRED}  # the flags each kind may carry (others: none)


class FrameHeader(NamedTuple):
    kind: Kind
    reservation: bytes  # 16 bytes
    epoch: int
    seq: int
    dest_page_id: int
    page_index: int
    token_count: int
    aux: int
    payload_len: int
    payload_checksum: int
    mac: bytes = bytes(MAC_SIZE)
    flags: int = 0  # PAUSE on a DATA frame, else 0 (covered by the MAC)


def transfer_key(data_key: str | bytes, reservation_id: str, epoch: int) -> bytes:
    """The per-reservation data-plane key: HMAC-SHA256(data key, label | reservation id
    bytes | epoch). The data key is admission's, fresh per reservation
    (`ReserveRequest.data_key`, `PrefillDispatch.data_key`)."""
    secret = data_key.encode() if isinstance(data_key, str) else bytes(data_key)
    msg = _KEY_LABEL + reservation_bytes(reservation_id) + struct.pack("<Q", epoch)
    return hmac.digest(secret, msg, hashlib.sha256)


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.digest(key, body, hashlib.sha256)[:MAC_SIZE]


def mac_ok(h: FrameHeader, key: bytes) -> bool:
    """Whether a decoded header's MAC verifies under `key` (constant-time compare)."""
    body = _BODY.pack(MAGIC, VERSION, int(h.kind), h.flags, h.reservation, h.epoch, h.seq,
                      h.dest_page_id, h.page_index, h.token_count, h.aux, h.payload_len,
                      h.payload_checksum)
    return hmac.compare_digest(_mac(key, body), h.mac)


def reservation_bytes(reservation_id: str) -> bytes:
    """The 16 wire bytes of a reservation id (a UUID, hex with or without dashes)."""
    try:
        return uuid.UUID(hex=reservation_id).bytes
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"reservation id must be a UUID string, got {reservation_id!r}") from exc


def commit_digest(page_checksums: list[int]) -> int:
    """Digest over the ordered page checksums: binds coverage and order into the commit."""
    return checksum(struct.pack(f"<{len(page_checksums)}Q", *page_checksums))


def encode_header(
    kind: Kind,
    reservation: bytes,
    epoch: int,
    seq: int = 0,
    dest_page_id: int = 0,
    page_index: int = 0,
    token_count: int = 0,
    aux: int = 0,
    payload_len: int = 0,
    payload_checksum: int = 0,
    mac: bytes = b"",
    flags: int = 0,
    *,
    key: bytes = b"",
) -> bytes:
    """One header, MACed under `key` (a given `mac`, e.g. from a decoded header's fields,
    is ignored: the MAC is always computed)."""
    body = _BODY.pack(
        MAGIC, VERSION, int(kind), flags, reservation, epoch, seq, dest_page_id, page_index,
        token_count, aux, payload_len, payload_checksum,
    )
    signed = body + _mac(key, body)
    return signed + _CHECK.pack(checksum(signed))


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and verify one header. Raises FrameError (only) on anything malformed."""
    try:
        raw = bytes(data)
    except Exception as exc:  # not a buffer at all
        raise FrameError(f"header is not bytes-like: {type(data).__name__}") from exc
    if len(raw) != HEADER_SIZE:
        raise FrameError(f"header length {len(raw)} != {HEADER_SIZE}")
    signed = raw[: _BODY.size + MAC_SIZE]
    (declared,) = _CHECK.unpack_from(raw, _BODY.size + MAC_SIZE)
    if declared != checksum(signed):
        raise FrameError("header checksum mismatch")
    body = raw[: _BODY.size]
    (magic, version, kind, flags, reservation, epoch, seq, dest_page_id, page_index,
     token_count, aux, payload_len, payload_checksum) = _BODY.unpack(body)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    if flags & ~_KNOWN_FLAGS.get(kind, 0):
        raise FrameError(f"unknown flags {flags:#x} on a {kind.name} frame")
    if payload_len > MAX_PAYLOAD:
        raise FrameError(f"payload length {payload_len} > {MAX_PAYLOAD}")
    if kind is Kind.DATA and payload_len == 0:
        raise FrameError("DATA frame without payload")
    if kind in (Kind.COMMIT, Kind.ACK) and payload_len != 0:
        raise FrameError(f"{kind.name} frame with payload")
    if kind is Kind.NACK and payload_len > MAX_NACK_DETAIL:
        raise FrameError("NACK detail too long")
    return FrameHeader(kind, reservation, epoch, seq, dest_page_id, page_index, token_count,
                       aux, payload_len, payload_checksum,
                       raw[_BODY.size: _BODY.size + MAC_SIZE], flags)


def tokens_in_page(page_index: int, num_tokens: int, page_tokens: int) -> int:
    return max(0, min(page_tokens, num_tokens - page_index * page_tokens))


__all__ = [
    "DEFERRED", "HEADER_SIZE", "MAC_SIZE", "MAGIC", "MAX_PAYLOAD", "PAUSE", "VERSION",
    "FrameError",
    "FrameHeader", "Kind", "checksum", "commit_digest", "decode_header", "encode_header", "mac_ok",
    "reservation_bytes", "tokens_in_page", "transfer_key",
]
