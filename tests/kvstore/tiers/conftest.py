"""Fixtures of the KV tier tests: a small block geometry, prompts and payloads made from a
seed, a key ring, and a real redis-server on a free loopback port (nothing saved)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from pdmesh.kvstore.tiers import Geometry, KeyRing, TierStack, chain_digests
from tests.support.redisproc import RedisServer, running_redis

BLOCK_TOKENS = 8
GEOMETRY = Geometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4, dtype="float32",
                    block_tokens=BLOCK_TOKENS)
PAYLOAD_BYTES = 2 * 2 * 1 * 4 * 4 * BLOCK_TOKENS  # K and V, layers, heads, head_dim, fp32
MODEL = "tiny:fp32:test"
TIER_KEY = bytes(range(32))


def prompt(seed: str, blocks: int, extra: int = 0) -> list[int]:
    """`blocks` whole blocks (and `extra` more tokens) of ids derived from `seed`."""
    digest = hashlib.sha256(seed.encode()).digest()
    return [(digest[i % 32] * 131 + i) % 50_000 for i in range(blocks * BLOCK_TOKENS + extra)]


def payload(seed: str, index: int, size: int = PAYLOAD_BYTES) -> bytes:
    block = hashlib.sha256(f"{seed}/{index}".encode()).digest()
    return (block * (size // 32 + 1))[:size]


def put_prompt(stack: TierStack, salt: str, ids: list[int], blocks: range | None = None,
               seed: str = "kv") -> list[bytes]:
    """Put the prompt's whole blocks (or those in `blocks`); its chain digests."""
    digests = chain_digests(salt, ids, BLOCK_TOKENS)
    for i in blocks if blocks is not None else range(len(digests)):
        stack.put(salt, digests[i - 1] if i else None, digests[i], i,
                  ids[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS], payload(seed, i))
    return digests


@pytest.fixture
def keys() -> KeyRing:
    return KeyRing(TIER_KEY)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh server per test: several tests kill, pause or fill theirs. Without
    redis-server installed the test fails, naming `apt-get install redis-server`."""
    with running_redis() as server:
        yield server
