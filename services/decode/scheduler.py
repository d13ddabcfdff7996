"""Decode's batching policy as a plain class: no I/O, no asyncio, unit-tested alone.

Requests join when their KV is verified (`add`) and leave when they end (`discard`). Each
step takes up to `max_batch` of them, round-robin, so that more than `max_batch` requests
all make progress. The engine's batch invariance (I4) means the choice of neighbours never
changes a request's output, only its speed.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

R = TypeVar("R", bound=Hashable)


class DecodeScheduler(Generic[R]):
    def __init__(self, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch = max_batch
        self._running: dict[R, None] = {}  # insertion-ordered set
        self._next = 0  # round-robin start

    def add(self, req: R) -> None:
        self._running[req] = None

    def discard(self, req: R) -> None:
        self._running.pop(req, None)

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, req: object) -> bool:
        return req in self._running

    def next_batch(self) -> list[R]:
        """The requests of the next step (empty when none is running)."""
        running = list(self._running)
        if not running:
            return []
        start = self._next % len(running)
        batch = (running[start:] + running[:start])[: self.max_batch]
        self._next = start + len(batch)
        return batch
