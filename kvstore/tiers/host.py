"""Tier 1: blocks in this process's memory, plaintext, keyed by (cache salt, chain digest).

Nothing here leaves the process, so payloads are not sealed; the binding is structural,
as in tier 0's prefix cache: beside each payload lie the block's parent digest and token
ids, and `get` returns the payload only when both equal the caller's (the digest key
already covers them; the comparison does not rest on SHA-256 alone). Capacity is in bytes,
eviction S3-FIFO (kvstore.evict), so one long scan of new prompts cannot flush the blocks
that are used again and again. All methods take one lock: the stack's thread and the event
loop both call them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from pdmesh.kvstore.evict import S3FIFO
from pdmesh.kvstore.tiers.entry import token_bytes

_Key = tuple[str, bytes]  # (cache salt, chain digest)


@dataclass(frozen=True)
class _HostBlock:
    parent_digest: bytes
    token_bytes: bytes  # the block's ids as little-endian uint32
    payload: bytes


class HostTier:
    """Blocks in host memory, at most `capacity_bytes` of payload."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"host tier capacity {capacity_bytes} bytes: must be > 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: dict[_Key, _HostBlock] = {}
        self._by_salt: dict[str, set[bytes]] = {}
        self._policy = S3FIFO(capacity_bytes)
        self._lock = threading.Lock()

    def put(self, cache_salt: str, digest: bytes, parent_digest: bytes,
            token_ids: Sequence[int], payload: bytes) -> bool:
        """Keep the block (evicting others to make room); False if it is larger than the
        whole tier. A block already held is only marked used."""
        size = len(payload)
        if size > self.capacity_bytes:
            return False
        key = (cache_salt, digest)
        block = _HostBlock(parent_digest, token_bytes(token_ids), bytes(payload))
        with self._lock:
            if key in self._blocks:
                self._policy.touch(key)
                return True
            while self._policy.size + size > self.capacity_bytes:
                victim = self._policy.pop_victim()
                if victim is None:
                    break
                self._drop(victim)
            self._policy.insert(key, size)
            self._blocks[key] = block
            self._by_salt.setdefault(cache_salt, set()).add(digest)
        return True

    def get(self, cache_salt: str, digest: bytes, parent_digest: bytes,
            token_ids: Sequence[int]) -> bytes | None:
        """The payload of the block, or None if it is not held or was held for another
        parent or other token ids."""
        expected_tokens = token_bytes(token_ids)
        with self._lock:
            block = self._blocks.get((cache_salt, digest))
            if block is None:
                return None
            if (block.parent_digest != parent_digest
                    or block.token_bytes != expected_tokens):  # guard: tier-host-tokens
                return None
            self._policy.touch((cache_salt, digest))
            return block.payload

    def has(self, cache_salt: str, digest: bytes) -> bool:
        with self._lock:
            return (cache_salt, digest) in self._blocks

    def purge(self, cache_salt: str) -> int:
        """Drop every block of the salt; how many there were."""
        with self._lock:
            digests = self._by_salt.pop(cache_salt, set())
            for digest in digests:
                self._policy.remove((cache_salt, digest))
                del self._blocks[(cache_salt, digest)]
            return len(digests)

    @property
    def entries(self) -> int:
        with self._lock:
            return len(self._blocks)

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._policy.size

    def check_integrity(self) -> None:
        """The index, the per-salt sets and the eviction policy name the same blocks, and
        the payloads fit the capacity."""
        with self._lock:
            by_salt = {(s, d) for s, ds in self._by_salt.items() for d in ds}
            assert by_salt == set(self._blocks), "per-salt index differs from the blocks"
            assert len(self._policy) == len(self._blocks), (len(self._policy),
                                                             len(self._blocks))
            assert all(key in self._policy for key in self._blocks)
            assert self._policy.problems() == [], self._policy.problems()
            held = sum(len(b.payload) for b in self._blocks.values())
            assert held == self._policy.size <= self.capacity_bytes, (held, self._policy.size)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._by_salt.clear()
            self._policy = S3FIFO(self.capacity_bytes)

    def _drop(self, key: _Key) -> None:
        cache_salt, digest = key
        del self._blocks[key]
        digests = self._by_salt[cache_salt]
        digests.discard(digest)
        if not digests:
            del self._by_salt[cache_salt]
