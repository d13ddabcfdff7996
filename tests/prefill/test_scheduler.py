"""Prefill queueing: a plain class, tested without NATS or torch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pdmesh.services.prefill.scheduler import PrefillQueue


@dataclass(eq=False)
class Job:
    request_id: str


def test_prefill_queue_starts_first_come_first_served_and_tracks_jobs_until_done() -> None:
    q: PrefillQueue[Job] = PrefillQueue(max_active=2)
    a, b, c = Job("a"), Job("b"), Job("c")
    for j in (a, b, c):
        q.push(j)
    assert q.depth == 3 and len(q) == 3 and list(q) == [a, b, c]
    assert q.next_waiting() is a
    q.start(a)
    assert q.next_waiting() is b
    q.start(b)
    assert q.next_waiting() is None  # max_active started: c waits
    assert q.depth == 1 and q.active == 2 and len(q) == 3 and q.get("a") is a
    with pytest.raises(ValueError):
        q.start(c)  # next in line, but max_active are started
    q.stop(a)  # a's compute ended; its KV may still be in flight: still held
    assert q.get("a") is a and q.active == 1 and q.next_waiting() is c
    q.done(a)
    assert q.get("a") is None and len(q) == 2
    assert q.pop() is c and q.pop() is None
    q.done(b)
    q.done(c)
    assert len(q) == 0 and q.depth == 0 and q.active == 0


def test_started_prefills_take_turns_by_chunk() -> None:
    # A short prompt that arrives behind a long one gets a turn after one chunk of it.
    q: PrefillQueue[Job] = PrefillQueue(max_active=4)
    long, short = Job("long"), Job("short")
    q.push(long)
    q.start(long)
    assert [q.turn(), q.turn()] == [long, long]  # alone: every turn
    q.push(short)
    q.start(short)
    assert [q.turn(), q.turn(), q.turn(), q.turn()] == [short, long, short, long]
    q.stop(short)  # its last chunk ran
    assert [q.turn(), q.turn()] == [long, long]
    q.done(long)
    assert q.turn() is None


def test_prefill_queue_refuses_a_second_job_for_one_request() -> None:
    q: PrefillQueue[Job] = PrefillQueue()
    q.push(Job("a"))
    with pytest.raises(ValueError):
        q.push(Job("a"))


@dataclass(eq=False)
class TenantJob:
    request_id: str
    tenant: str


def test_waiting_prompts_start_fairly_between_tenants() -> None:
    """A flood of one tenant's prompts is queued first; another tenant's prompt starts as
    soon as a slot frees and, with none of its own started, even when every slot is taken."""
    q: PrefillQueue[TenantJob] = PrefillQueue(max_active=2)
    flood = [TenantJob(f"h{i}", "heavy") for i in range(5)]
    for j in flood:
        q.push(j)
    for j in flood[:2]:
        assert q.next_waiting() is j
        q.start(j)
    assert q.next_waiting() is None  # both slots are heavy's, and only heavy waits
    light = TenantJob("l0", "light")
    q.push(light)
    assert q.next_waiting() is light  # ahead of three earlier heavy prompts
    q.start(light)
    assert q.active == 3 and q.next_waiting() is None
    for j in flood[:2]:
        q.stop(j)
        q.done(j)
    q.push(TenantJob("l1", "light"))
    # Light has one started, heavy none: heavy's h2 goes before light's l1.
    assert q.next_waiting() is flood[2]
    assert q.pop() is flood[2]
    assert [j.request_id for j in q] == ["h3", "h4", "l1"]
