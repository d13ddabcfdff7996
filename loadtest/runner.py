"""Load shape: arrival processes, a concurrency cap, and the bounds of a run.

A run issues requests in order at seeded arrival times (Poisson, or gamma with a
burstiness factor, like `vllm bench serve`), optionally never more than `max_concurrency`
at once. It is bounded three ways: the request count, `duration_s` (no request is issued
after it), and `drain_timeout_s` (in-flight requests are cancelled after it). A set stop
event (Ctrl-C / SIGTERM) stops issuing at once and cancels in-flight requests after
`cancel_grace_s`; every issued request still yields a result (cancelled ones say so).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdmesh.loadtest.client import RequestResult
from pdmesh.loadtest.workload import RequestSpec

ARRIVALS = ("poisson", "gamma")
SendFn = Callable[[RequestSpec], Awaitable[RequestResult]]


def arrival_offsets(num_requests: int, request_rate: float, arrival: str = "poisson",
                    burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds from the start at which each request is issued (the first at 0).

    Gaps are gamma distributed with mean 1/rate and shape `burstiness` (Poisson: shape 1,
    exponential gaps); burstiness < 1 is burstier, > 1 more regular. An infinite rate
    issues everything at once."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}: {arrival!r}")
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be positive")
    if num_requests == 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    shape = 1.0 if arrival == "poisson" else burstiness
    gaps = np.random.default_rng([seed, 11]).gamma(shape, 1.0 / (request_rate * shape),
                                                   size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf
    arrival: str = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration_s: float | None = None  # issue nothing after this
    drain_timeout_s: float = 60.0  # after issuing ends, in-flight requests get this long
    cancel_grace_s: float = 2.0  # after a stop, in-flight requests get this long
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("duration_s must be positive")


@dataclass
class RunOutcome:
    results: list[RequestResult] = field(default_factory=list)
    started_s: float = 0.0  # perf_counter
    ended_s: float = 0.0
    issued: int = 0
    not_issued: int = 0
    interrupted: bool = False  # the stop event ended the run
    deadline_reached: bool = False  # duration_s ended issuing

    @property
    def duration_s(self) -> float:
        return max(self.ended_s - self.started_s, 1e-9)


async def _wait_stop(stop: asyncio.Event, timeout_s: float) -> bool:
    """Sleep up to `timeout_s`; True if the stop event was set meanwhile."""
    if timeout_s > 0 and not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout_s)
        except TimeoutError:
            pass
    return stop.is_set()


async def _acquire(sem: asyncio.Semaphore, stop: asyncio.Event, timeout_s: float) -> bool:
    """Acquire `sem` unless the stop event or the timeout comes first."""
    if timeout_s <= 0 or stop.is_set():
        return False
    acquire = asyncio.ensure_future(sem.acquire())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({acquire, stopper}, timeout=min(timeout_s, 1e9),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (acquire, stopper):
            task.cancel()
        await asyncio.wait({acquire, stopper})
    acquired = not acquire.cancelled() and acquire.exception() is None
    if acquired and stop.is_set():
        sem.release()
        return False
    return acquired


async def run_load(requests: Sequence[RequestSpec], send: SendFn, shape: LoadShape,
                   stop: asyncio.Event | None = None,
                   on_event: Callable[[str, RequestResult | None], None] | None = None,
                   ) -> RunOutcome:
    """Issue `requests` with `shape` through `send`; return every issued request's result.

    `on_event("issued", None)` / `on_event("done", result)` feed a progress display."""
    stop = stop or asyncio.Event()
    notify = on_event or (lambda kind, result: None)
    offsets = arrival_offsets(len(requests), shape.request_rate, shape.arrival,
                              shape.burstiness, shape.seed)
    sem = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    outcome = RunOutcome(started_s=time.perf_counter())
    deadline = outcome.started_s + (shape.duration_s or math.inf)
    in_flight: dict[asyncio.Task, tuple[RequestSpec, float]] = {}

    def finished(task: asyncio.Task) -> None:
        req, issued_at = in_flight.pop(task)
        if sem is not None:
            sem.release()
        if task.cancelled():
            result = RequestResult.for_request(req).fail("cancelled", "cancelled by the run")
            result.start_s, result.e2el_s = issued_at, time.perf_counter() - issued_at
        elif task.exception() is not None:
            exc = task.exception()
            result = RequestResult.for_request(req).fail("client_error", repr(exc))
            result.start_s, result.e2el_s = issued_at, time.perf_counter() - issued_at
        else:
            result = task.result()
        outcome.results.append(result)
        notify("done", result)

    for i, req in enumerate(requests):
        target = outcome.started_s + float(offsets[i])
        if target >= deadline:
            outcome.deadline_reached = True
            break
        if await _wait_stop(stop, target - time.perf_counter()):
            break
        if sem is not None and not await _acquire(sem, stop, deadline - time.perf_counter()):
            outcome.deadline_reached = not stop.is_set()
            break
        if time.perf_counter() >= deadline:
            if sem is not None:
                sem.release()
            outcome.deadline_reached = True
            break
        task = asyncio.create_task(send(req), name=f"loadtest-request-{req.index}")
        in_flight[task] = (req, time.perf_counter())
        task.add_done_callback(finished)
        outcome.issued += 1
        notify("issued", None)
    outcome.not_issued = len(requests) - outcome.issued

    await _drain(in_flight, stop, shape)
    outcome.interrupted = stop.is_set()
    outcome.ended_s = time.perf_counter()
    outcome.results.sort(key=lambda r: r.index)
    return outcome


async def _drain(in_flight: dict[asyncio.Task, tuple[RequestSpec, float]],
                 stop: asyncio.Event, shape: LoadShape) -> None:
    """Let in-flight requests finish within the bounds, then cancel and await the rest."""
    now = time.perf_counter()
    drain_end = now + (shape.cancel_grace_s if stop.is_set() else shape.drain_timeout_s)
    stop_seen = stop.is_set()
    stopper = asyncio.ensure_future(stop.wait())
    try:
        while in_flight:
            remaining = drain_end - time.perf_counter()
            if remaining <= 0:
                break
            waiters = [*in_flight] if stop_seen else [*in_flight, stopper]
            await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set() and not stop_seen:
                stop_seen = True
                drain_end = min(drain_end, time.perf_counter() + shape.cancel_grace_s)
    finally:
        stopper.cancel()
        await asyncio.wait([stopper])
        pending = list(in_flight)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        await asyncio.sleep(0)  # let the done callbacks of the cancelled tasks run
