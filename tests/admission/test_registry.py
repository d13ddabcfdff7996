"""Admission routes around a decode worker whose data plane a prefill could not reach, while
that worker keeps the same address, for a bounded time."""

from __future__ import annotations

from pdmesh.services.admission.registry import UNREACHABLE_COOLDOWN_S, CapacityRegistry
from pdmesh.services.protocol import messages as m


def beat(worker_id: str, address: str) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, role=m.Role.DECODE, model="tiny",
                       data_address=address, pool_capacity_tokens=4096,
                       available_tokens=4096, page_tokens=16, served_context=4096)


def ids(reg: CapacityRegistry, now: float) -> list[str]:
    return sorted(v.worker_id for v in reg.views(m.Role.DECODE, now))


def test_an_unreachable_worker_leaves_routing_until_its_address_changes_or_time_passes():
    reg = CapacityRegistry(ttl_s=1e9)
    reg.observe(beat("d1", "tcp://10.0.0.1:9000"), now=0.0)
    reg.observe(beat("d2", "tcp://10.0.0.2:9000"), now=0.0)
    assert ids(reg, 1.0) == ["d1", "d2"]
    reg.set_aside("d1", "tcp://10.0.0.1:9000", now=1.0)
    assert ids(reg, 2.0) == ["d2"]
    reg.observe(beat("d1", "tcp://10.0.0.1:9000"), now=3.0)  # still heartbeats: still aside
    assert ids(reg, 3.0) == ["d2"]
    assert ids(reg, 1.0 + UNREACHABLE_COOLDOWN_S) == ["d1", "d2"]  # tried again later


def test_a_new_address_ends_the_exclusion_at_once():
    reg = CapacityRegistry(ttl_s=1e9)
    reg.observe(beat("d1", "tcp://127.0.0.1:9000"), now=0.0)
    reg.set_aside("d1", "tcp://127.0.0.1:9000", now=0.0)
    assert ids(reg, 1.0) == []
    reg.observe(beat("d1", "tcp://10.0.0.1:9000"), now=2.0)
    assert ids(reg, 2.0) == ["d1"]


def test_a_worker_back_after_it_expired_is_tried_again_at_once():
    """A decode host cut off (heartbeats stop, the worker expires) and back: the exclusion
    earned while it was unreachable ends with its return, not after the cooldown."""
    reg = CapacityRegistry(ttl_s=2.0)
    reg.observe(beat("d1", "tcp://10.0.0.1:9000"), now=0.0)
    reg.set_aside("d1", "tcp://10.0.0.1:9000", now=1.0)
    assert ids(reg, 1.5) == []
    assert ids(reg, 5.0) == []  # expired meanwhile
    reg.observe(beat("d1", "tcp://10.0.0.1:9000"), now=6.0)  # the link is back
    assert ids(reg, 6.0) == ["d1"]
