"""Live capacity registry: the workers admission may use, fed only by their heartbeats.

A worker that stops heartbeating leaves the registry after `ttl_s`. Admission reads live
capacity from here, never from configuration (invariant I5). Between heartbeats admission
charges its own reservations against the cached free figure so a burst of requests does not
all pick the same worker on a stale view.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services import messages as m
from services.admission.policy import WorkerView
from services.capacity import pages_for


@dataclass
class _Entry:
    beat: m.Heartbeat
    seen_at: float
    charged_tokens: int = 0


class CapacityRegistry:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._workers: dict[str, _Entry] = {}

    def observe(self, beat: m.Heartbeat, now: float | None = None) -> None:
        """Record a heartbeat; a draining worker leaves at once."""
        if beat.draining or not beat.ready:
            self._workers.pop(beat.worker_id, None)
            return
        self._workers[beat.worker_id] = _Entry(beat, time.monotonic() if now is None else now)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = [w for w, e in self._workers.items() if now - e.seen_at > self._ttl_s]
        for w in gone:
            del self._workers[w]
        return gone

    def charge(self, worker_id: str, num_tokens: int) -> None:
        entry = self._workers.get(worker_id)
        if entry is not None:
            pages = pages_for(num_tokens, max(entry.beat.page_tokens, 1))
            entry.charged_tokens += pages * entry.beat.page_tokens

    def views(self, role: m.Role, now: float | None = None) -> list[WorkerView]:
        self.expire(now)
        out = []
        for e in self._workers.values():
            b = e.beat
            if b.role is not role:
                continue
            out.append(WorkerView(worker_id=b.worker_id, capacity_tokens=b.pool_capacity_tokens,
                                  free_tokens=max(b.free_tokens - e.charged_tokens, 0),
                                  page_tokens=max(b.page_tokens, 1),
                                  served_context=b.served_context, queue_depth=b.queue_depth))
        return out

    def heartbeats(self) -> list[m.Heartbeat]:
        self.expire()
        return [e.beat for e in self._workers.values()]

    def get(self, worker_id: str) -> m.Heartbeat | None:
        e = self._workers.get(worker_id)
        return None if e is None else e.beat
