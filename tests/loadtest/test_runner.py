"""Arrival processes (seeded) and the bounds of a run: count, concurrency, duration, stop."""

import asyncio
import math
import time

import numpy as np
import pytest

from pdmesh.loadtest.client import RequestResult
from pdmesh.loadtest.runner import LoadShape, arrival_offsets, run_load
from pdmesh.loadtest.workload import RequestSpec


def _requests(n):
    return [RequestSpec(i, 0, "p" * 10, 4) for i in range(n)]


def _sleeper(delay_s, tracker=None):
    async def send(req):
        if tracker is not None:
            tracker["active"] += 1
            tracker["peak"] = max(tracker["peak"], tracker["active"])
        try:
            await asyncio.sleep(delay_s)
        finally:
            if tracker is not None:
                tracker["active"] -= 1
        result = RequestResult.for_request(req)
        result.success, result.status = True, 200
        return result
    return send


def test_arrivals_are_seeded_and_start_at_zero():
    a = arrival_offsets(100, 10.0, "poisson", seed=3)
    assert np.array_equal(a, arrival_offsets(100, 10.0, "poisson", seed=3))
    assert not np.array_equal(a, arrival_offsets(100, 10.0, "poisson", seed=4))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert arrival_offsets(5, math.inf).tolist() == [0.0] * 5


@pytest.mark.parametrize(("arrival", "burstiness", "cv2"),
                         [("poisson", 1.0, 1.0), ("gamma", 0.25, 4.0), ("gamma", 4.0, 0.25)])
def test_arrival_gaps_have_the_rate_and_burstiness(arrival, burstiness, cv2):
    gaps = np.diff(arrival_offsets(20001, 50.0, arrival, burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(cv2, rel=0.1)


def test_bad_arrival_parameters_are_refused():
    for kwargs in (dict(arrival="uniform"), dict(request_rate=0.0), dict(burstiness=0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, **{"request_rate": 1.0, **kwargs})


async def test_concurrency_cap_is_never_exceeded_and_every_request_completes():
    tracker = {"active": 0, "peak": 0}
    outcome = await run_load(_requests(20), _sleeper(0.01, tracker), LoadShape(max_concurrency=3))
    assert tracker["peak"] == 3
    assert [r.index for r in outcome.results] == list(range(20))
    assert all(r.success for r in outcome.results) and outcome.issued == 20


async def test_request_rate_spreads_requests_over_time():
    started = time.perf_counter()
    outcome = await run_load(_requests(5), _sleeper(0.0), LoadShape(request_rate=50.0, seed=2))
    expected = arrival_offsets(5, 50.0, seed=2)[-1]
    assert time.perf_counter() - started >= expected - 0.005
    assert outcome.issued == 5


async def test_duration_stops_issuing_and_drain_timeout_cancels():
    shape = LoadShape(request_rate=20.0, duration_s=0.3, drain_timeout_s=0.2, seed=0)
    started = time.perf_counter()
    outcome = await run_load(_requests(1000), _sleeper(5.0), shape)
    assert time.perf_counter() - started < 1.5
    assert outcome.deadline_reached and 0 < outcome.issued < 1000
    assert outcome.not_issued == 1000 - outcome.issued
    assert len(outcome.results) == outcome.issued
    assert {r.error_kind for r in outcome.results} == {"cancelled"}


async def test_stop_event_stops_issuing_and_keeps_partial_results():
    stop = asyncio.Event()
    shape = LoadShape(max_concurrency=2, cancel_grace_s=0.1)
    seen = []

    def on_event(kind, result):
        if kind == "done":
            seen.append(result)
            if len(seen) == 3:
                stop.set()

    async def send(req):
        await asyncio.sleep(0.01 if req.index < 3 else 10.0)
        return await _sleeper(0.0)(req)

    started = time.perf_counter()
    outcome = await run_load(_requests(50), send, shape, stop, on_event)
    assert time.perf_counter() - started < 2.0
    assert outcome.interrupted
    done = [r for r in outcome.results if r.success]
    assert len(done) == 3
    assert all(r.error_kind == "cancelled" for r in outcome.results if not r.success)
    assert outcome.issued < 50


async def test_send_exceptions_become_client_errors():
    async def boom(req):
        raise RuntimeError("bug")

    outcome = await run_load(_requests(2), boom, LoadShape())
    assert [r.error_kind for r in outcome.results] == ["client_error", "client_error"]
