"""Decode batching: a plain class, tested without NATS or torch."""

from __future__ import annotations

from collections import Counter

import pytest

from pdmesh.services.decode.scheduler import DecodeScheduler


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
