"""Live capacity registry: the workers admission may use, fed only by their heartbeats.

A worker that stops heartbeating leaves the registry after `ttl_s`. A decode worker whose
advertised data address a prefill could not connect to (`set_aside`) is left out of routing
while it keeps that address, for `UNREACHABLE_COOLDOWN_S` (then it is tried again: the
network may have healed); a new address, or its return after it expired (it stopped
heartbeating: a host cut off and back), ends the exclusion at once. Admission reads live
capacity from here, never from configuration (invariant I5). Between heartbeats admission
charges its own reservations against the cached free figure (and queue depth) so a burst of
requests does not all pick the same worker on a stale view.

Each view carries the worker's engine fingerprint, by which `policy.decide` pairs workers.

Prefix-cache routing: prefill heartbeats carry chain hashes of cached prefixes
(`kvstore.prefix_key`); `views(..., cache_salt=, prompt_ids=)` turns them into each worker's
cached prefix length *for this request under its tenant's salt*. Only hashes are compared
here: a collision can misroute, never leak (the worker matches token ids under the salt).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pdmesh.kvstore.prefix_key import aligned_prefix_hashes
from pdmesh.kvstore.spec import pages_for
from pdmesh.services.admission.policy import WorkerView
from pdmesh.services.protocol import messages as m

UNREACHABLE_COOLDOWN_S = 30.0


@dataclass
class _Entry:
    beat: m.Heartbeat
    seen_at: float
    charged_tokens: int = 0
    charged_requests: int = 0
    charged_tenants: dict[str, int] = field(default_factory=dict)
    prefix_set: frozenset[int] = field(default_factory=frozenset)


class CapacityRegistry:
    """Entries are keyed by (role, worker id): a colocated worker heartbeats as both a
    prefill and a decode worker under one id."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._workers: dict[tuple[m.Role, str], _Entry] = {}
        # worker id -> (data address found unreachable, until when it stays set aside)
        self._set_aside: dict[str, tuple[str, float]] = {}

    def set_aside(self, worker_id: str, data_address: str, now: float | None = None,
                  cooldown_s: float = UNREACHABLE_COOLDOWN_S) -> None:
        """A peer could not reach `data_address` of `worker_id`: route around it."""
        now = time.monotonic() if now is None else now
        self._set_aside[worker_id] = (data_address, now + cooldown_s)

    def is_set_aside(self, beat: m.Heartbeat, now: float) -> bool:
        entry = self._set_aside.get(beat.worker_id)
        if entry is None:
            return False
        address, until = entry
        if now >= until or beat.data_address != address:
            del self._set_aside[beat.worker_id]
            return False
        return True

    def observe(self, beat: m.Heartbeat, now: float | None = None) -> None:
        """Record a heartbeat; a draining worker leaves at once."""
        key = (beat.role, beat.worker_id)
        if beat.draining or not beat.ready:
            self._workers.pop(key, None)
            return
        if key not in self._workers:
            # New, or back after it expired (a host that was cut off returns): whatever was
            # unreachable before is tried again at once.
            self._set_aside.pop(beat.worker_id, None)
        self._workers[key] = _Entry(beat, time.monotonic() if now is None else now,
                                    prefix_set=frozenset(beat.prefix_hashes))

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        gone = [k for k, e in self._workers.items() if now - e.seen_at > self._ttl_s]
        for k in gone:
            del self._workers[k]
        return [f"{role.value} {wid}" for role, wid in gone]

    def charge(self, role: m.Role, worker_id: str, num_tokens: int, tenant: str = "") -> None:
        entry = self._workers.get((role, worker_id))
        if entry is not None:
            pages = pages_for(num_tokens, max(entry.beat.page_tokens, 1))
            entry.charged_tokens += pages * entry.beat.page_tokens
            entry.charged_requests += 1
            if tenant:
                entry.charged_tenants[tenant] = (entry.charged_tenants.get(tenant, 0)
                                                 + pages * entry.beat.page_tokens)

    def tenant_tokens(self, tenant: str) -> int:
        """Decode KV tokens `tenant` holds across the live decode workers: their latest
        heartbeats' figures plus what admission reserved since."""
        self.expire()
        return sum(e.beat.tenant_tokens.get(tenant, 0) + e.charged_tenants.get(tenant, 0)
                   for (role, _), e in self._workers.items() if role is m.Role.DECODE)

    def decode_capacity_tokens(self) -> int:
        """The live decode workers' pools together (tokens)."""
        self.expire()
        return sum(e.beat.pool_capacity_tokens
                   for (role, _), e in self._workers.items() if role is m.Role.DECODE)

    def views(self, role: m.Role, now: float | None = None, *, cache_salt: str = "",
              prompt_ids: Sequence[int] = (), avoid: Collection[str] = ()
              ) -> list[WorkerView]:
        """Live views of one role's workers; with `cache_salt` and `prompt_ids`, each
        prefill view says how much of this prompt its prefix cache holds for that salt.
        `avoid`: workers left out whatever their heartbeats say (a resumed request's lost
        workers, whose last heartbeats stay here for up to the TTL)."""
        self.expire(now)
        now = time.monotonic() if now is None else now
        entries = [e for e in self._workers.values()
                   if e.beat.role is role
                   and e.beat.worker_id not in avoid  # guard: avoid-workers
                   and not self.is_set_aside(e.beat, now)]  # guard: unreachable-set-aside
        cached = self._cached_prefixes(entries, cache_salt, prompt_ids)
        out = []
        for e in entries:
            b = e.beat
            out.append(WorkerView(worker_id=b.worker_id, capacity_tokens=b.pool_capacity_tokens,
                                  available_tokens=max(b.available_tokens - e.charged_tokens, 0),
                                  page_tokens=max(b.page_tokens, 1),
                                  served_context=b.served_context,
                                  queue_depth=b.queue_depth + e.charged_requests,
                                  cached_prefix_tokens=cached.get(b.worker_id, 0),
                                  fingerprint=b.fingerprint))
        return out

    @staticmethod
    def _cached_prefixes(entries: list[_Entry], cache_salt: str,
                         prompt_ids: Sequence[int]) -> dict[str, int]:
        """worker_id -> longest advertised cached prefix of the prompt under the salt."""
        out: dict[str, int] = {}
        if not cache_salt or not prompt_ids:
            return out
        groups: dict[tuple[int, int], list[_Entry]] = {}
        for e in entries:
            if e.prefix_set and e.beat.prefix_align_tokens > 0:
                groups.setdefault((e.beat.page_tokens, e.beat.prefix_align_tokens), []).append(e)
        for (page, align), group in groups.items():
            # A worker's summary holds a prefix's shorter prefixes too, so stop at the
            # first hash no worker of the group has: the cost is the length matched.
            alive = group
            hashes = aligned_prefix_hashes(cache_salt, prompt_ids, page, align,
                                           len(prompt_ids) - 1)
            for k, h in enumerate(hashes, start=1):
                alive = [e for e in alive if h in e.prefix_set]
                if not alive:
                    break
                for e in alive:
                    out[e.beat.worker_id] = k * align
        return out

    def heartbeats(self) -> list[m.Heartbeat]:
        self.expire()
        return [e.beat for e in self._workers.values()]

    def get(self, worker_id: str, now: float | None = None) -> m.Heartbeat | None:
        """The worker's latest heartbeat (any role), or None once older than the TTL."""
        now = time.monotonic() if now is None else now
        fresh = [e for (_, wid), e in self._workers.items()
                 if wid == worker_id and now - e.seen_at <= self._ttl_s]
        return max(fresh, key=lambda e: e.seen_at).beat if fresh else None
