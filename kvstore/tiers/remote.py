"""Tier 3: sealed entries in a Redis store shared by the workers, `pdmesh:kv:<tag>:<name>`.

The store is not trusted with anything: entries are sealed (kvstore.tiers.entry) and their
keys are HMACs, so whoever reads or writes Redis learns no salt or prompt and can at worst
make a worker recompute. Each entry is SET with an expiry; a purge SCANs the tenant's
prefix and UNLINKs what it finds.

The store can be down, slow or full, and none of that may fail or stall a request: every
command runs with a small socket timeout and no retry, a connection or timeout failure
marks the store down for `down_s` (commands meanwhile are skipped and counted as `down`,
so a lookup of many blocks waits for one timeout, not one per block), and every failure is
a miss or a dropped put counted in `errors` by operation. No method raises a store error.
"""

from __future__ import annotations

import collections
import threading
import time

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

KEY_PREFIX = "pdmesh:kv:"
_UNLINK_BATCH = 256


class RemoteTier:
    """Sealed entries in the Redis store at `url` (redis://host:port/db)."""

    name = "remote"

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 0.5,
                 down_s: float = 2.0) -> None:
        if ttl_s <= 0 or timeout_s <= 0:
            raise ValueError(f"remote tier ttl_s {ttl_s} and timeout_s {timeout_s}: both > 0")
        self.url = url
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.down_s = down_s
        self.errors: collections.Counter[str] = collections.Counter()  # by operation
        self._down_until = 0.0  # time.monotonic()
        self._lock = threading.Lock()
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)

    @staticmethod
    def key(tenant_tag: str, name: str) -> str:
        return f"{KEY_PREFIX}{tenant_tag}:{name}"

    def put(self, tenant_tag: str, name: str, entry: bytes) -> bool:
        """SET the entry with the tier's expiry; False if it was dropped (store down,
        slow, or out of memory)."""
        if self._skip():
            return False
        try:
            self._client.set(self.key(tenant_tag, name), entry, px=self.ttl_ms)
        except (RedisError, OSError) as exc:
            self._failed("put", exc)
            return False
        return True

    def get(self, tenant_tag: str, name: str) -> bytes | None:
        """The entry's bytes, or None if the store has none or cannot answer in time."""
        if self._skip():
            return None
        try:
            value = self._client.get(self.key(tenant_tag, name))
        except (RedisError, OSError) as exc:
            self._failed("get", exc)
            return None
        assert value is None or isinstance(value, bytes), type(value)
        return value

    def delete(self, tenant_tag: str, name: str) -> None:
        """Remove one entry (a refused one)."""
        if self._skip():
            return
        try:
            self._client.unlink(self.key(tenant_tag, name))
        except (RedisError, OSError) as exc:
            self._failed("delete", exc)

    def purge(self, tenant_tag: str) -> int:
        """UNLINK every key of the tenant; how many were removed. Tried even while the
        store is marked down; a failure part way counts an error and returns the keys
        removed so far."""
        removed, batch = 0, []
        try:
            for key in self._client.scan_iter(match=f"{KEY_PREFIX}{tenant_tag}:*", count=1000):
                batch.append(key)
                if len(batch) >= _UNLINK_BATCH:
                    removed += self._client.unlink(*batch)
                    batch = []
            if batch:
                removed += self._client.unlink(*batch)
        except (RedisError, OSError) as exc:
            self._failed("purge", exc)
        return removed

    @property
    def entries(self) -> None:
        """Not known: the store is shared, and counting a prefix means scanning it."""
        return None

    def close(self) -> None:
        self._client.close()

    def _skip(self) -> bool:
        with self._lock:
            if time.monotonic() >= self._down_until:
                return False
            self.errors["down"] += 1
            return True

    def _failed(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self.errors[op] += 1
            if isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError)):
                self._down_until = time.monotonic() + self.down_s
