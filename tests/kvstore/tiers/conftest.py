"""Fixtures of the KV tier tests: a small block geometry, prompts and payloads made from a
seed, a key ring, and a real redis-server on a free loopback port (nothing saved)."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from pdmesh.kvstore.tiers import Geometry, KeyRing, TierStack, chain_digests

BLOCK_TOKENS = 8
GEOMETRY = Geometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4, dtype="float32",
                    block_tokens=BLOCK_TOKENS)
PAYLOAD_BYTES = 2 * 2 * 1 * 4 * 4 * BLOCK_TOKENS  # K and V, layers, heads, head_dim, fp32
MODEL = "tiny:fp32:test"
TIER_KEY = bytes(range(32))
MISSING_REDIS = ("redis-server is not installed: the KV tier-3 tests need it "
                 "(`apt-get install redis-server`; the Makefile's test set-up installs it)")


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


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(MISSING_REDIS)
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(proc, port)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port),
                                                                         0.2):
                break
            assert time.monotonic() < deadline, "redis-server did not listen within 10 s"
            time.sleep(0.02)
        yield server
    finally:
        server.kill()
