"""The stack's background writer: one thread, a queue bounded in bytes.

Sealing a block and writing it to disk and the shared store takes milliseconds to a
timeout; a prefill offering its blocks must not wait for it. `submit` queues a job or, when
the queue holds `max_bytes` already, refuses it at once (the caller counts the drop): the
queue's memory stays bounded whatever the store does. One job is always accepted into an
empty queue, so a block larger than the bound is still written.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("pdmesh.kvstore.tiers")

Job = TypeVar("Job")


class BackgroundWriter(Generic[Job]):
    """Runs `write(job)` for each submitted job, in order, on its own thread."""

    def __init__(self, write: Callable[[Job], None], max_bytes: int,
                 on_error: Callable[[], None], name: str = "kv-tier-writer") -> None:
        self.max_bytes = max_bytes
        self._write = write
        self._on_error = on_error
        self._jobs: collections.deque[tuple[Job, int]] = collections.deque()
        self._queued_bytes = 0
        self._pending = 0  # jobs queued or being written
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, num_bytes: int) -> bool:
        """Queue the job; False (nothing queued) if the queue is full or closed."""
        with self._cond:
            if self._closing or (self._jobs and
                                 self._queued_bytes + num_bytes > self.max_bytes):
                return False
            self._jobs.append((job, num_bytes))
            self._queued_bytes += num_bytes
            self._pending += 1
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Drop the jobs still queued, let the one running finish, join the thread."""
        with self._cond:
            self._closing = True
            self._pending -= len(self._jobs)
            self._jobs.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if self._closing:
                    return
                job, num_bytes = self._jobs.popleft()
                self._queued_bytes -= num_bytes
            try:
                self._write(job)
            except Exception:  # a bug loses this job, not the writer thread
                log.exception("a KV tier write failed")
                self._on_error()
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
