"""Keys, names and sealed entries of the KV tiers: what binds a stored block to its tenant,
its exact token ids and the model that computed it.

A block's chain digest d_i covers the tenant's cache salt and every token id up to the end
of block i; the worker computes it from the request's own ids, never reads it from a store.
From the workers' secret `tier_key` and a salt, HKDF derives the tenant's AEAD key and
naming key. A block's store name is an HMAC of its digest under the naming key, and its
tenant tag (the directory or key prefix grouping a tenant's entries, for purges) an HMAC of
a constant: a store's contents reveal neither the salt nor the prompt.

An entry (the bytes disk and Redis hold) is AES-256-GCM over a msgpack header and the
payload, with the store name in the associated data, so an entry copied to another name or
tenant fails authentication. `open_entry` returns the payload only when the tag, the
header's parent digest, token ids and block index, and the model fingerprint, geometry and
purge time all match; otherwise it raises `EntryRefused` with one of `REASONS`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdmesh.kvstore.errors import KVStoreError

MAGIC = b"PDKV"
VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
TIER_KEY_BYTES = 32
_PREFIX = MAGIC + bytes([VERSION])
_HEADER_LEN = struct.Struct("<I")
_CHAIN_ROOT = b"pdmesh-kv-chain\0"
_HKDF_INFO = b"pdmesh kv tier v1\0"

REASONS = ("mac", "tokens", "stale", "malformed")


class EntryRefused(KVStoreError):
    """A stored entry that must not be used; the caller computes the block instead.

    `reason` is one of REASONS: "mac" (authentication failed: another tenant's entry, an
    altered one, a wrong key), "tokens" (authentic, but for other tokens or another place
    in the chain), "stale" (another model, geometry or entry version, or created before the
    salt's purge time), "malformed" (too short, bad magic, bad header or length).
    """

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"entry refused ({reason}): {detail}")


# --- chain digests -------------------------------------------------------------------------

def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the bytes the chain digest covers."""
    tokens = array("I", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tobytes()


def root_digest(cache_salt: str) -> bytes:
    """d_{-1}: the parent of a salt's first block."""
    return hashlib.sha256(_CHAIN_ROOT + cache_salt.encode()).digest()


def block_digest(parent_digest: bytes, token_ids: Sequence[int]) -> bytes:
    """d_i from d_{i-1} and block i's token ids."""
    return hashlib.sha256(parent_digest + token_bytes(token_ids)).digest()


def chain_digests(cache_salt: str, token_ids: Sequence[int], block_tokens: int) -> list[bytes]:
    """d_0 .. d_{n-1} of the prompt's n whole blocks (a partial last block has none)."""
    digest, out = root_digest(cache_salt), []
    for start in range(0, len(token_ids) // block_tokens * block_tokens, block_tokens):
        digest = block_digest(digest, token_ids[start:start + block_tokens])
        out.append(digest)
    return out


# --- keys ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TenantKeys:
    """One salt's keys, derived from the tier key; never stored anywhere."""

    aead_key: bytes
    naming_key: bytes

    @property
    def tenant_tag(self) -> str:
        """16 hex digits grouping the tenant's entries in a store (purges find them)."""
        return hmac.new(self.naming_key, b"tenant\0", hashlib.sha256).hexdigest()[:16]

    def name(self, digest: bytes) -> str:
        """The store name (64 hex digits) of the block whose chain digest is `digest`."""
        return hmac.new(self.naming_key, b"name\0" + digest, hashlib.sha256).hexdigest()


class KeyRing:
    """Derives and caches (a bounded number of) tenants' keys from the workers' tier key."""

    def __init__(self, tier_key: bytes, max_salts: int = 4096) -> None:
        if len(tier_key) != TIER_KEY_BYTES:
            raise ValueError(f"the KV tier key is {len(tier_key)} bytes, not "
                             f"{TIER_KEY_BYTES}")
        self._tier_key = tier_key
        self._max_salts = max_salts
        self._cache: dict[str, TenantKeys] = {}
        self._lock = threading.Lock()

    def for_salt(self, cache_salt: str) -> TenantKeys:
        with self._lock:
            keys = self._cache.get(cache_salt)
        if keys is not None:
            return keys
        okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
                   info=_HKDF_INFO + cache_salt.encode()).derive(self._tier_key)
        keys = TenantKeys(aead_key=okm[:32], naming_key=okm[32:])
        with self._lock:
            if len(self._cache) >= self._max_salts:  # drop the oldest: a re-derive is cheap
                del self._cache[next(iter(self._cache))]
            self._cache[cache_salt] = keys
        return keys


# --- entries -------------------------------------------------------------------------------

class Geometry(msgspec.Struct, frozen=True):
    """The shape of a block's payload; an entry of another shape is stale."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    dtype: str
    block_tokens: int


class EntryHeader(msgspec.Struct, frozen=True):
    model: str  # the prefill engine's fingerprint
    geometry: Geometry
    block_index: int
    parent_digest: bytes  # d_{i-1}
    token_ids: list[int]
    created_at: float  # unix seconds
    payload_len: int


@dataclass(frozen=True)
class Expected:
    """What the worker asking for block `block_index` knows from its own request."""

    model: str
    geometry: Geometry
    block_index: int
    parent_digest: bytes
    token_ids: Sequence[int]
    purged_before: float = 0.0  # unix seconds; an entry created earlier is stale


_HEADER_DECODER = msgspec.msgpack.Decoder(EntryHeader)


def _aad(name: str) -> bytes:
    return _PREFIX + name.encode("ascii")


def seal(keys: TenantKeys, name: str, header: EntryHeader, payload: bytes | memoryview) -> bytes:
    """The entry stored under `name`: MAGIC | version | nonce | AES-GCM(header, payload)."""
    assert header.payload_len == len(payload), (header.payload_len, len(payload))
    encoded = msgspec.msgpack.encode(header)
    plaintext = b"".join((_HEADER_LEN.pack(len(encoded)), encoded, payload))
    nonce = os.urandom(NONCE_BYTES)
    return _PREFIX + nonce + AESGCM(keys.aead_key).encrypt(nonce, plaintext, _aad(name))


def open_entry(keys: TenantKeys, name: str, entry: bytes, expected: Expected) -> bytes:
    """The payload of an entry read under `name`, or EntryRefused."""
    if len(entry) < len(_PREFIX) + NONCE_BYTES + TAG_BYTES or entry[:4] != MAGIC:
        raise EntryRefused("malformed", f"{len(entry)} bytes, magic {entry[:4]!r}")
    if entry[4] != VERSION:
        raise EntryRefused("stale", f"entry version {entry[4]}, this worker reads {VERSION}")
    nonce, sealed = entry[5:5 + NONCE_BYTES], entry[5 + NONCE_BYTES:]
    try:
        plaintext = AESGCM(keys.aead_key).decrypt(nonce, sealed, _aad(name))  # guard: tier-mac
    except InvalidTag:
        raise EntryRefused("mac", f"entry {name[:16]} fails authentication") from None
    header = _decode_header(plaintext)
    payload = memoryview(plaintext)[_HEADER_LEN.size + _HEADER_LEN.unpack_from(plaintext)[0]:]
    if len(payload) != header.payload_len:
        raise EntryRefused("malformed", f"payload of {len(payload)} bytes, header says "
                                        f"{header.payload_len}")
    if (header.model != expected.model or header.geometry != expected.geometry
            or header.created_at < expected.purged_before):  # guard: tier-stale
        raise EntryRefused("stale", f"model {header.model!r} geometry {header.geometry} "
                                    f"created {header.created_at:.3f}; expected "
                                    f"{expected.model!r} {expected.geometry} "
                                    f"after {expected.purged_before:.3f}")
    if (header.block_index != expected.block_index  # guard: tier-tokens
            or header.parent_digest != expected.parent_digest
            or header.token_ids != list(expected.token_ids)):
        raise EntryRefused("tokens", f"entry of block {header.block_index} for other tokens "
                                     f"than block {expected.block_index}")
    return payload.tobytes()


def _decode_header(plaintext: bytes) -> EntryHeader:
    if len(plaintext) < _HEADER_LEN.size:
        raise EntryRefused("malformed", f"plaintext of {len(plaintext)} bytes")
    (header_len,) = _HEADER_LEN.unpack_from(plaintext)
    if _HEADER_LEN.size + header_len > len(plaintext):
        raise EntryRefused("malformed", f"header of {header_len} bytes in {len(plaintext)}")
    try:
        return _HEADER_DECODER.decode(memoryview(plaintext)[_HEADER_LEN.size:
                                                            _HEADER_LEN.size + header_len])
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise EntryRefused("malformed", f"bad header: {exc}") from None
