"""Admission's fair line (start-time fair queueing) as a plain class."""

from __future__ import annotations

import pytest

from pdmesh.services.admission.fairqueue import FairQueue


def serve_all(q: FairQueue, eligible=lambda _w: True) -> list[str]:
    out = []
    while (w := q.first(eligible)) is not None:
        q.leave(w, served=True)
        out.append(w.tenant)
    return out


def test_a_flood_does_not_keep_a_light_tenant_waiting() -> None:
    q = FairQueue()
    for _ in range(10):
        q.enter("heavy", cost=100)
    q.enter("light", cost=100)
    order = serve_all(q)
    assert order.index("light") <= 1  # behind at most the heavy request tagged first
    assert len(q) == 0


def test_equal_tenants_alternate_and_weights_share_in_proportion() -> None:
    q = FairQueue()
    for _ in range(4):
        q.enter("a", cost=10)
        q.enter("b", cost=10)
    assert serve_all(q) == ["a", "b"] * 4
    q = FairQueue()
    for _ in range(6):
        q.enter("two", cost=10, weight=2.0)
    for _ in range(3):
        q.enter("one", cost=10)
    first_six = serve_all(q)[:6]
    assert first_six.count("two") == 4 and first_six.count("one") == 2


def test_costs_count_a_long_request_as_many_short_ones() -> None:
    q = FairQueue()
    q.enter("long", cost=1000)
    q.enter("long", cost=1000)
    for _ in range(5):
        q.enter("short", cost=100)
    order = serve_all(q)
    assert order[:2] == ["long", "short"]
    assert order.index("long", 1) == 6  # the second long one after all five short ones


def test_an_idle_tenant_earns_no_credit_and_ineligible_waiters_are_skipped() -> None:
    q = FairQueue()
    for _ in range(3):
        q.enter("busy", cost=10)
    assert serve_all(q) == ["busy"] * 3
    # "idle" sent nothing meanwhile: its requests start at the virtual time, so they take
    # turns with busy's instead of going first as a run.
    q.enter("busy", cost=10)
    q.enter("busy", cost=10)
    q.enter("idle", cost=10)
    q.enter("idle", cost=10)
    assert serve_all(q) == ["idle", "busy", "idle", "busy"]
    w = q.enter("capped", cost=10)
    q.enter("other", cost=10)
    assert q.first(lambda x: x.tenant != "capped").tenant == "other"
    q.leave(w, served=False)


def test_a_waiter_that_gives_up_is_not_charged() -> None:
    q = FairQueue()
    gone = q.enter("a", cost=1000)
    q.leave(gone, served=False)
    q.enter("a", cost=10)
    q.enter("b", cost=10)
    assert serve_all(q) == ["a", "b"]
    with pytest.raises(ValueError):
        q.enter("a", cost=1, weight=0)


def test_priority_orders_a_tenants_own_requests_not_its_share() -> None:
    """vLLM's priority (lower first) among one tenant's waiters; the other tenant keeps its
    turns exactly as without priorities."""
    q = FairQueue()
    names = {}
    for i, prio in enumerate((5, 5, 0, 1)):
        names[id(q.enter("a", cost=10, item=f"a{i}", priority=prio))] = f"a{i}"
        q.enter("b", cost=10, item=f"b{i}", priority=-100 if i == 0 else 0)
    order = []
    while (w := q.first()) is not None:
        q.leave(w, served=True)
        order.append(w.item)
    assert [x for x in order if x.startswith("a")] == ["a2", "a3", "a0", "a1"]
    # b's priorities reorder only b's own; the tenants still alternate.
    assert [x[0] for x in order] == ["a", "b"] * 4
    assert [x for x in order if x.startswith("b")] == ["b0", "b1", "b2", "b3"]


def test_priority_takes_only_an_eligible_place() -> None:
    q = FairQueue()
    low = q.enter("a", cost=10, item="low", priority=1)
    high = q.enter("a", cost=10, item="high", priority=0)
    assert q.first(lambda w: w is not high) is low  # the better one may not go: no swap
    assert q.first() is high and q.first() is high  # asked again: the same answer
