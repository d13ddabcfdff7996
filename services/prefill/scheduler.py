"""Prefill's queueing policy as a plain class: no I/O, no asyncio, unit-tested alone.

Chunk-level round robin. Up to `max_active` dispatches are *started* (their lease is taken)
and take turns one prefill chunk at a time, so a short prompt that arrives behind a long one
gets its first token after one chunk of the long one, not after all of it (SGLang/vLLM
chunked prefill mix chunks the same way). Waiting dispatches start fairly between tenants:
next is the first to arrive of the tenants with the fewest started jobs, and a tenant with
none started may start one even when `max_active` are, so one tenant's flood of long
prompts delays another's first token by a chunk, not by the flood. A
job leaves the turns when its compute ends (its KV may still be in flight: it stays held
in `jobs` until `done()`). A job ended while waiting (an abort) stays in the queue and is
handed out like any other so that the service counts it; it is never run.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    @property
    def request_id(self) -> str: ...

    # and optionally `tenant: str` (jobs without one share the tenant "")


def _tenant(job: Queued) -> str:
    return getattr(job, "tenant", "")


J = TypeVar("J", bound=Queued)


class PrefillQueue(Generic[J]):
    """Waiting jobs (in arrival order, started fairly between tenants), started jobs taking
    turns (round robin by chunk), and `jobs`: every job the worker holds (waiting, started,
    or sending its KV) until `done()`."""

    def __init__(self, max_active: int = 4) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be at least 1, got {max_active}")
        self.max_active = max_active
        self._waiting: collections.deque[J] = collections.deque()
        self._active: collections.deque[J] = collections.deque()
        self.jobs: dict[str, J] = {}

    def push(self, job: J) -> None:
        if job.request_id in self.jobs:
            raise ValueError(f"request {job.request_id} is already queued or running")
        self._waiting.append(job)
        self.jobs[job.request_id] = job

    def _next(self) -> J | None:
        """The waiting job to start next: the first of the tenants with fewest started."""
        if not self._waiting:
            return None
        started = collections.Counter(_tenant(j) for j in self._active)
        job = min(self._waiting, key=lambda j: started[_tenant(j)])  # guard: prefill-fair
        if len(self._active) >= self.max_active and started[_tenant(job)]:
            return None
        return job

    def next_waiting(self) -> J | None:
        """The job to start next (still waiting until `start` or `pop`), or None when
        none waits or `max_active` jobs are started (and every waiting tenant has one)."""
        return self._next()

    def pop(self) -> J | None:
        """Take the next waiting job out of the line without starting it (to skip or fail
        it); None when none is next."""
        job = self._next()
        if job is not None:
            self._waiting.remove(job)
        return job

    def start(self, job: J) -> None:
        """The next waiting job got its lease: it takes turns from now on."""
        if self._next() is not job:
            raise ValueError(f"request {job.request_id} is not next in line")
        self._waiting.remove(job)
        self._active.appendleft(job)  # its first chunk comes next

    def turn(self) -> J | None:
        """The started job whose turn it is (one chunk), moved to the back; None if none."""
        if not self._active:
            return None
        job = self._active[0]
        self._active.rotate(-1)
        return job

    def stop(self, job: J) -> None:
        """The job's compute ended (last chunk done, aborted or failed): no more turns."""
        try:
            self._active.remove(job)
        except ValueError:
            pass

    def done(self, job: J) -> None:
        """The job left the worker (sent, failed or skipped)."""
        self.stop(job)
        self.jobs.pop(job.request_id, None)

    def get(self, request_id: str) -> J | None:
        return self.jobs.get(request_id)

    @property
    def depth(self) -> int:
        """Jobs waiting to start."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Jobs started and still computing."""
        return len(self._active)

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[J]:
        return iter(self._waiting)
