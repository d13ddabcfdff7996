"""The HTTP edge's bookkeeping without a socket: a listener's connection cap fits the
process's file-descriptor limit, and a repeating event logs one line per interval with its
count."""

from __future__ import annotations

import logging
import resource

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.services.runtime import edge
from pdmesh.services.runtime.config import resolve


def _table(monkeypatch: pytest.MonkeyPatch, soft: int, **settings: str) -> edge.ConnectionTable:
    monkeypatch.setattr(edge.resource, "getrlimit", lambda _which: (soft, soft))
    limits = edge.EdgeLimits.of(resolve("gateway", settings, {}))
    return edge.ConnectionTable(limits, edge.EdgeMetrics(CollectorRegistry(), "gateway"),
                                "http")


def test_the_cap_fits_the_file_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (_table(monkeypatch, 20000).max_open, _table(monkeypatch, 20000).max_per_client) \
        == (1024, 256)  # the defaults
    low = _table(monkeypatch, 128)
    assert (low.max_open, low.max_per_client) == (96, 96)  # 32 kept for the rest
    assert _table(monkeypatch, resource.RLIM_INFINITY, http_max_connections="5000").max_open \
        == 5000
    table = _table(monkeypatch, 20000, http_max_connections="2",
                   http_max_connections_per_client="1")
    assert [table.admit(a) for a in ("a", "a", "b", "c")] == [
        None, "per_client", None, "max_connections"]
    table.release("a")
    assert table.admit("a") is None and table.by_client == {"a": 1, "b": 1}


def test_a_repeating_event_logs_once_per_interval_with_its_count(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    every = edge.EveryInterval(logging.WARNING, "accept() failed", 10.0, lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="pdmesh.http")
    logged = []
    for step in range(300):  # 30 s of an event every 0.1 s
        now[0] = step * 0.1
        logged.append(every.event("Too many open files"))
    assert sum(logged) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "accept() failed: Too many open files (1)"
    assert lines[1] == "accept() failed: Too many open files (100 in the last 10s)"
