"""The protocol trace: every protocol action of a process, one JSON object per line.

With `--protocol-trace-dir DIR` (`PDMESH_PROTOCOL_TRACE_DIR`) each service process appends
to `DIR/<role>-<pid>.jsonl`, opened once by its `ServiceRuntime`, written and flushed line
by line, for tests/model/tracecheck.py to read back. Every line carries `ts`
(`time.time_ns()`), `p` (`<role>:<pid>`) and `ev`, then the event's own fields.

Off (the default, an empty directory) there is no writer at all: `ServiceRuntime.trace`,
`KVPool.observer` and the receive table's `trace` stay None, and each call site tests for
None before it builds anything. The pool and the data plane import nothing from services:
they take a plain callback `(ev, fields)`, which `attach` points at `ProtocolTrace.observe`.

Events, by who emits them (fields after `ev`):
  pool (kvstore/pool.py; each with `pool`): lease, free, quarantine, cache, evict, written,
    read
  receive table (transports/receiver.py; `lease` is the reservation id): expect, accept,
    land, commit, fail, fence, drop
  decode: reserve_in; admission: decide, reserve, cancel, dispatch; prefill: job,
    commit_sent, release_sent, tier_load (a block copied from a KV tier after its check:
    req, lease, block, tier, verified, pages; services/prefill/tiers.py); gateway: submit;
    every process: tell (a request's terminal stream event, written by
    `ServiceRuntime.publish` as it leaves, whatever path sent it),
    start, then stop as the last line of a clean shutdown (a killed process has none).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, TextIO


def _plain(value: Any) -> Any:
    """What json cannot write by itself: numpy scalars and the like as int, else str."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return str(value)


class ProtocolTrace:
    """The append-only trace file of one process. Thread-safe: the engine thread records
    pool events (prefill's writes, decode's read checks) beside the event loop's."""

    def __init__(self, directory: str, role: str) -> None:
        os.makedirs(directory, exist_ok=True)
        pid = os.getpid()
        self.path = os.path.join(directory, f"{role}-{pid}.jsonl")
        self._process = f"{role}:{pid}"
        self._lock = threading.Lock()
        self._file: TextIO | None = open(self.path, "a", buffering=1, encoding="utf-8")

    @classmethod
    def open(cls, directory: str, role: str) -> ProtocolTrace | None:
        """The trace of this process, or None when `directory` is empty (tracing off)."""
        return cls(directory, role) if directory else None

    def emit(self, ev: str, **fields: Any) -> None:
        self.observe(ev, fields)

    def observe(self, ev: str, fields: dict[str, Any]) -> None:
        """Write one line (the callback shape the pool and the receive table take). After
        `close` nothing is written."""
        with self._lock:
            if self._file is None:
                return
            line = json.dumps({"ts": time.time_ns(), "p": self._process, "ev": ev, **fields},
                              separators=(",", ":"), default=_plain)
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def attach(trace: ProtocolTrace, pool: Any, transport: Any = None) -> None:
    """Point a worker's pool (and, on the receiving side, its transport's receive table)
    at `trace`. A transport without a receive table (a test's stand-in) is left alone."""
    pool.observer = trace.observe
    if transport is not None:
        set_trace = getattr(transport, "set_trace", None)
        if set_trace is not None:
            set_trace(trace.observe)
