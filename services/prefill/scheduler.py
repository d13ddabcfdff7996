"""Prefill's queueing policy as a plain class: no I/O, no asyncio, unit-tested alone.

FIFO, one prompt at a time: the service pops the next job when its engine is free. A job
ended while queued (an abort) stays in the queue and is handed out like any other so that
the service counts it; it is never run (`PrefillJob.lifecycle` is terminal).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    @property
    def request_id(self) -> str: ...


J = TypeVar("J", bound=Queued)


class PrefillQueue(Generic[J]):
    """Jobs waiting for the engine, first come first served; `jobs` maps request id to
    every job the worker holds (queued or running) until `done()` is called for it."""

    def __init__(self) -> None:
        self._queue: collections.deque[J] = collections.deque()
        self.jobs: dict[str, J] = {}

    def push(self, job: J) -> None:
        if job.request_id in self.jobs:
            raise ValueError(f"request {job.request_id} is already queued or running")
        self._queue.append(job)
        self.jobs[job.request_id] = job

    def pop(self) -> J | None:
        """The next job to run, or None when none is waiting."""
        return self._queue.popleft() if self._queue else None

    def done(self, job: J) -> None:
        """The job left the worker (ran, failed or was skipped)."""
        self.jobs.pop(job.request_id, None)

    def get(self, request_id: str) -> J | None:
        return self.jobs.get(request_id)

    @property
    def depth(self) -> int:
        """Jobs waiting (not the one running)."""
        return len(self._queue)

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[J]:
        return iter(self._queue)
