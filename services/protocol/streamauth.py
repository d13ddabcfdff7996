"""Per-request message authentication: only the request's own workers can speak for it.

NATS permissions say which *role* may publish on a subject; they cannot say which worker of
it serves a request. So each request gets a fresh 32-byte key, the *stream key*: the
gateway makes it (`new_key`) and sends it in its `SubmitRequest`; admission hands it to the
decode worker it reserved on (`ReserveRequest`) and to the prefill worker it dispatched to
(`PrefillDispatch`), on subjects only those workers can read. Every event on the request's
token stream (tokens, failure, progress, prefix-cache info, first-token logprobs, timing)
and every message prefill sends decode about it (`Release`, `PrefillProgress`) carries, in
the `Pdmesh-Mac` header, HMAC-SHA256 under that key over a label, the subject and the exact
payload bytes (`sign`). Receivers drop, and count, a message whose MAC does not verify
(`verify`): another worker, even one of the same role with valid NATS credentials, cannot
write a request's answer, end it or keep its reservation alive.

The subject is inside the MAC, so an event cannot be moved to another request's stream or
from the stream to decode's release subject.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping

MAC_HEADER = "Pdmesh-Mac"
KEY_BYTES = 32
_LABEL = b"pdmesh-stream-v1\x00"


def new_key() -> str:
    """A fresh stream key (hex)."""
    return secrets.token_hex(KEY_BYTES)


def parse_key(key: str) -> bytes:
    """The key's bytes; ValueError unless it is 64 hex characters."""
    if len(key) != 2 * KEY_BYTES:
        raise ValueError(f"a stream key is {2 * KEY_BYTES} hex characters, not {len(key)}")
    return bytes.fromhex(key)


def mac(key: bytes, subject: str, payload: bytes) -> str:
    return hmac.new(key, _LABEL + subject.encode() + b"\x00" + payload,
                    hashlib.sha256).hexdigest()


def sign(key: bytes, subject: str, payload: bytes) -> dict[str, str]:
    """The headers that authenticate `payload` on `subject`."""
    return {MAC_HEADER: mac(key, subject, payload)}


def verify(key: bytes | None, subject: str, payload: bytes,
           headers: Mapping[str, str] | None) -> bool:
    """Whether the message carries a valid MAC under `key` (None: no key, never valid)."""
    got = (headers or {}).get(MAC_HEADER, "")
    return key is not None and hmac.compare_digest(  # guard: stream-mac
        mac(key, subject, payload), got)
