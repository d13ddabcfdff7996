"""Chain digests, tenant keys and sealed entries: every refusal reason from the bytes up."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import struct

import msgspec
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from pdmesh.kvstore.tiers import (
    EntryHeader,
    EntryRefused,
    Expected,
    KeyRing,
    block_digest,
    chain_digests,
    open_entry,
    root_digest,
    seal,
)
from tests.kvstore.tiers.conftest import (
    BLOCK_TOKENS,
    GEOMETRY,
    MODEL,
    TIER_KEY,
    payload,
    prompt,
)

NOW = 1_800_000_000.0


def sealed_block(keys: KeyRing, salt: str, ids: list[int], index: int, **header_changes):
    """(name, entry, expected) of block `index` of `ids` sealed for `salt`; the header may
    lie (`header_changes`), the expectation is always the truth."""
    digests = chain_digests(salt, ids, BLOCK_TOKENS)
    parent = digests[index - 1] if index else root_digest(salt)
    block_ids = ids[index * BLOCK_TOKENS:(index + 1) * BLOCK_TOKENS]
    data = payload(salt, index)
    header = EntryHeader(model=MODEL, geometry=GEOMETRY, block_index=index,
                         parent_digest=parent, token_ids=block_ids, created_at=NOW,
                         payload_len=len(data))
    tenant = keys.for_salt(salt)
    name = tenant.name(digests[index])
    entry = seal(tenant, name, msgspec.structs.replace(header, **header_changes), data)
    return name, entry, Expected(MODEL, GEOMETRY, index, parent, block_ids)


def refusal(keys: KeyRing, salt: str, name: str, entry: bytes, expected: Expected) -> str:
    with pytest.raises(EntryRefused) as info:
        open_entry(keys.for_salt(salt), name, entry, expected)
    return info.value.reason


def test_the_chain_digest_is_sha256_of_the_salt_then_each_blocks_uint32_ids():
    ids = prompt("chain", 2, extra=3)
    d0 = hashlib.sha256(hashlib.sha256(b"pdmesh-kv-chain\0acme").digest()
                        + struct.pack("<8I", *ids[:8])).digest()
    d1 = hashlib.sha256(d0 + struct.pack("<8I", *ids[8:16])).digest()
    assert chain_digests("acme", ids, BLOCK_TOKENS) == [d0, d1]  # the partial block: none
    assert block_digest(root_digest("acme"), ids[:8]) == d0
    assert chain_digests("acme2", ids, BLOCK_TOKENS)[0] != d0


def test_keys_are_hkdf_of_the_tier_key_and_names_reveal_neither_salt_nor_prompt():
    keys = KeyRing(TIER_KEY)
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
               info=b"pdmesh kv tier v1\0acme").derive(TIER_KEY)
    tenant = keys.for_salt("acme")
    assert (tenant.aead_key, tenant.naming_key) == (okm[:32], okm[32:])
    d0 = chain_digests("acme", prompt("p", 1), BLOCK_TOKENS)[0]
    assert tenant.name(d0) == hmac.new(okm[32:], b"name\0" + d0, hashlib.sha256).hexdigest()
    assert tenant.tenant_tag == hmac.new(okm[32:], b"tenant\0",
                                         hashlib.sha256).hexdigest()[:16]
    assert keys.for_salt("acme") is tenant
    assert keys.for_salt("other").tenant_tag != tenant.tenant_tag
    with pytest.raises(ValueError, match="31 bytes"):
        KeyRing(TIER_KEY[:31])


def test_a_sealed_block_opens_to_its_payload_and_shows_nothing_in_the_clear(keys):
    ids = prompt("round", 2)
    name, entry, expected = sealed_block(keys, "acme", ids, 1)
    assert open_entry(keys.for_salt("acme"), name, entry, expected) == payload("acme", 1)
    assert entry[:5] == b"PDKV\x01"
    assert b"acme" not in entry and payload("acme", 1)[:16] not in entry
    assert struct.pack("<4I", *ids[8:12]) not in entry and MODEL.encode() not in entry


def test_another_tenants_entry_planted_under_this_tenants_name_is_refused_mac(keys):
    ids = prompt("shared prompt", 1)
    _, entry_a, _ = sealed_block(keys, "tenant-a", ids, 0)
    name_b, _, expected_b = sealed_block(keys, "tenant-b", ids, 0)
    assert refusal(keys, "tenant-b", name_b, entry_a, expected_b) == "mac"
    # A's own entry moved to another of A's names fails too (the name is in the AAD).
    name_a1, _, expected_a1 = sealed_block(keys, "tenant-a", prompt("other", 1), 0)
    assert refusal(keys, "tenant-a", name_a1, entry_a, expected_a1) == "mac"
    # The same bytes under the wrong tier key.
    name_a, _, expected_a = sealed_block(keys, "tenant-a", ids, 0)
    assert refusal(KeyRing(bytes(32)), "tenant-a", name_a, entry_a, expected_a) == "mac"


@pytest.mark.parametrize("where", ["payload", "tag", "header", "nonce"])
def test_an_altered_byte_is_refused_mac(keys, where):
    name, entry, expected = sealed_block(keys, "acme", prompt("alter", 1), 0)
    offset = {"nonce": 7, "header": 5 + 12 + 10, "payload": len(entry) - 16 - 100,
              "tag": len(entry) - 1}[where]
    altered = bytearray(entry)
    altered[offset] ^= 0x01
    assert refusal(keys, "acme", name, bytes(altered), expected) == "mac"


@pytest.mark.parametrize("lie", [{"token_ids": [1] * BLOCK_TOKENS},
                                 {"parent_digest": b"\0" * 32}, {"block_index": 3}])
def test_the_right_tenants_entry_for_other_tokens_is_refused_tokens(keys, lie):
    name, entry, expected = sealed_block(keys, "acme", prompt("tokens", 2), 1, **lie)
    assert refusal(keys, "acme", name, entry, expected) == "tokens"


def test_another_model_geometry_or_version_is_refused_stale(keys):
    ids = prompt("stale", 1)
    name, entry, expected = sealed_block(keys, "acme", ids, 0, model="tiny:int8:other")
    assert refusal(keys, "acme", name, entry, expected) == "stale"
    other_shape = msgspec.structs.replace(GEOMETRY, head_dim=8)
    name, entry, expected = sealed_block(keys, "acme", ids, 0, geometry=other_shape)
    assert refusal(keys, "acme", name, entry, expected) == "stale"
    name, entry, expected = sealed_block(keys, "acme", ids, 0)
    assert refusal(keys, "acme", name, entry[:4] + b"\x02" + entry[5:], expected) == "stale"


def test_an_entry_created_before_the_salts_purge_time_is_refused_stale(keys):
    name, entry, expected = sealed_block(keys, "acme", prompt("purged", 1), 0)
    assert refusal(keys, "acme", name, entry,
                   dataclasses.replace(expected, purged_before=NOW + 1)) == "stale"
    assert open_entry(keys.for_salt("acme"), name, entry,
                      dataclasses.replace(expected, purged_before=NOW)) == payload("acme", 0)


def test_short_foreign_or_inconsistent_bytes_are_refused_malformed(keys):
    name, entry, expected = sealed_block(keys, "acme", prompt("malformed", 1), 0)
    assert refusal(keys, "acme", name, entry[:20], expected) == "malformed"
    assert refusal(keys, "acme", name, b"XXXX" + entry[4:], expected) == "malformed"
    # Authentic bytes whose header is not an entry header, or whose length lies.
    tenant, nonce = keys.for_salt("acme"), b"\1" * 12
    aad = b"PDKV\x01" + name.encode()
    for plaintext in (struct.pack("<I", 3) + b"abc", struct.pack("<I", 99) + b"abc"):
        forged = b"PDKV\x01" + nonce + AESGCM(tenant.aead_key).encrypt(nonce, plaintext, aad)
        assert refusal(keys, "acme", name, forged, expected) == "malformed"
    header = msgspec.msgpack.encode(EntryHeader(
        model=MODEL, geometry=GEOMETRY, block_index=0, parent_digest=expected.parent_digest,
        token_ids=list(expected.token_ids), created_at=NOW, payload_len=10))
    plaintext = struct.pack("<I", len(header)) + header + b"x" * 9
    forged = b"PDKV\x01" + nonce + AESGCM(tenant.aead_key).encrypt(nonce, plaintext, aad)
    assert refusal(keys, "acme", name, forged, expected) == "malformed"
