"""HostTier: plaintext blocks bound to their salt, parent and token ids; bytes capacity."""

from __future__ import annotations

import pytest

from pdmesh.kvstore.tiers import HostTier, chain_digests, root_digest
from tests.kvstore.tiers.conftest import BLOCK_TOKENS, PAYLOAD_BYTES, payload, prompt


def block(salt: str, seed: str, index: int = 0):
    """(digest, parent, token ids) of block `index` of the prompt made from `seed`."""
    ids = prompt(seed, index + 1)
    digests = chain_digests(salt, ids, BLOCK_TOKENS)
    parent = digests[index - 1] if index else root_digest(salt)
    return digests[index], parent, ids[index * BLOCK_TOKENS:]


def test_a_block_comes_back_for_its_salt_parent_and_ids_only():
    host = HostTier(capacity_bytes=4 * PAYLOAD_BYTES)
    digest, parent, ids = block("acme", "round", 1)
    assert host.put("acme", digest, parent, ids, payload("acme", 1))
    assert host.get("acme", digest, parent, ids) == payload("acme", 1)
    assert host.has("acme", digest) and not host.has("other", digest)
    assert host.get("other", digest, parent, ids) is None
    assert (host.entries, host.size_bytes) == (1, PAYLOAD_BYTES)
    host.check_integrity()


def test_a_block_held_under_the_asked_digest_for_other_ids_or_parent_is_not_returned():
    host = HostTier(capacity_bytes=4 * PAYLOAD_BYTES)
    digest, parent, ids = block("acme", "held")
    host.put("acme", digest, parent, ids, payload("acme", 0))
    other_ids = [t + 1 for t in ids]
    assert host.get("acme", digest, parent, other_ids) is None
    assert host.get("acme", digest, b"\0" * 32, ids) is None
    assert host.get("acme", digest, parent, ids) == payload("acme", 0)


def test_capacity_in_bytes_evicts_and_refuses_a_block_larger_than_the_tier():
    host = HostTier(capacity_bytes=3 * PAYLOAD_BYTES)
    held = [block("acme", f"cap{i}") for i in range(5)]
    for i, (digest, parent, ids) in enumerate(held):
        assert host.put("acme", digest, parent, ids, payload("acme", i))
        assert host.size_bytes <= 3 * PAYLOAD_BYTES
        host.check_integrity()
    assert host.entries == 3
    assert host.has("acme", held[-1][0])  # the newest stays
    digest, parent, ids = block("acme", "huge")
    assert not host.put("acme", digest, parent, ids, b"x" * (3 * PAYLOAD_BYTES + 1))
    assert host.entries == 3
    with pytest.raises(ValueError, match="capacity 0"):
        HostTier(capacity_bytes=0)


def test_purge_drops_only_that_salts_blocks():
    host = HostTier(capacity_bytes=8 * PAYLOAD_BYTES)
    for salt in ("acme", "globex"):
        for i in range(3):
            digest, parent, ids = block(salt, f"purge{i}")
            host.put(salt, digest, parent, ids, payload(salt, i))
    assert host.purge("acme") == 3
    assert host.purge("acme") == 0
    assert host.entries == 3
    digest, parent, ids = block("globex", "purge1")
    assert host.get("globex", digest, parent, ids) == payload("globex", 1)
    host.check_integrity()
