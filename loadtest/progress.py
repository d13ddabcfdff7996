"""A small live progress bar on stderr (tqdm is not a dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from pdmesh.loadtest.client import RequestResult


class ProgressBar:
    """`label |#####-----| done/total  ok rej err  in-flight  req/s  elapsed`, redrawn in
    place at most every `min_interval_s`. Disabled bars ignore every call."""

    def __init__(self, total: int, label: str, enabled: bool, stream: TextIO | None = None,
                 width: int = 30, min_interval_s: float = 0.1) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.width = width
        self.min_interval_s = min_interval_s
        self.issued = self.done = self.ok = self.rejected = self.errors = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def on_event(self, kind: str, result: RequestResult | None) -> None:
        if kind == "issued":
            self.issued += 1
        elif result is not None:
            self.done += 1
            if result.success:
                self.ok += 1
            elif result.status == 400:
                self.rejected += 1
            else:
                self.errors += 1
        self.draw()

    def line(self) -> str:
        elapsed = time.perf_counter() - self._start
        filled = int(self.width * self.done / self.total) if self.total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return (f"{self.label} |{bar}| {self.done}/{self.total} ok={self.ok} "
                f"rej={self.rejected} err={self.errors} inflight={max(0, self.issued - self.done)} "
                f"{rate:.1f} req/s {elapsed:.1f}s")

    def draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < self.min_interval_s and self.done < self.total:
            return
        self._last_draw = now
        self.stream.write("\r" + self.line() + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
