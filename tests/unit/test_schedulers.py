"""Decode batching and prefill queueing: plain classes, tested without NATS or torch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from pdmesh.services.decode.scheduler import DecodeScheduler
from pdmesh.services.prefill.scheduler import PrefillQueue


def test_decode_batches_are_capped_and_round_robin() -> None:
    s: DecodeScheduler[str] = DecodeScheduler(max_batch=2)
    assert s.next_batch() == []
    for r in "abcde":
        s.add(r)
    batches = [s.next_batch() for _ in range(5)]
    assert all(len(b) == 2 for b in batches)
    assert batches[:3] == [["a", "b"], ["c", "d"], ["e", "a"]]
    # Over 5 steps of 2 every request ran exactly twice: nobody starves.
    assert Counter(r for b in batches for r in b) == {r: 2 for r in "abcde"}


def test_decode_scheduler_drops_ended_requests() -> None:
    s: DecodeScheduler[str] = DecodeScheduler(max_batch=8)
    for r in "abc":
        s.add(r)
    s.discard("b")
    s.discard("zzz")  # unknown: no error
    assert s.next_batch() == ["a", "c"] and "b" not in s and len(s) == 2
    s.discard("a")
    s.discard("c")
    assert s.next_batch() == [] and len(s) == 0


def test_decode_scheduler_refuses_an_empty_batch_size() -> None:
    with pytest.raises(ValueError):
        DecodeScheduler(max_batch=0)


@dataclass(eq=False)
class Job:
    request_id: str


def test_prefill_queue_is_fifo_and_tracks_jobs_until_done() -> None:
    q: PrefillQueue[Job] = PrefillQueue()
    a, b, c = Job("a"), Job("b"), Job("c")
    for j in (a, b, c):
        q.push(j)
    assert q.depth == 3 and len(q) == 3 and list(q) == [a, b, c]
    assert q.pop() is a
    assert q.depth == 2 and len(q) == 3 and q.get("a") is a  # running still counts
    q.done(a)
    assert q.get("a") is None and len(q) == 2
    assert [q.pop(), q.pop(), q.pop()] == [b, c, None]
    q.done(b)
    q.done(c)
    assert len(q) == 0 and q.depth == 0


def test_prefill_queue_refuses_a_second_job_for_one_request() -> None:
    q: PrefillQueue[Job] = PrefillQueue()
    q.push(Job("a"))
    with pytest.raises(ValueError):
        q.push(Job("a"))
