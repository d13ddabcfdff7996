"""TierStack: consecutive lookups across the tiers, promotion, purge in every tier, the
writer's bounded queue, and the metrics."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry

from pdmesh.kvstore.tiers import DiskTier, HostTier, RemoteTier, TierStack, chain_digests
from tests.kvstore.tiers.conftest import (
    BLOCK_TOKENS,
    GEOMETRY,
    MODEL,
    PAYLOAD_BYTES,
    payload,
    prompt,
    put_prompt,
)


@pytest.fixture
def stack(keys, tmp_path, redis_server):
    registry = CollectorRegistry()
    stack = TierStack(keys, MODEL, GEOMETRY, host=HostTier(64 * PAYLOAD_BYTES),
                      disk=DiskTier(tmp_path / "disk", 1 << 20),
                      remote=RemoteTier(redis_server.url, ttl_s=60, timeout_s=0.3),
                      registry=registry)
    stack.registry_for_test = registry
    yield stack
    stack.close()
    stack.host.check_integrity()


def hold_disk_writes(stack: TierStack) -> tuple[threading.Event, threading.Event]:
    """Make the writer wait inside its next disk put: (entered, release)."""
    entered, release = threading.Event(), threading.Event()
    real_put = stack.lower[0].put

    def put(*args):
        entered.set()
        assert release.wait(10)
        return real_put(*args)
    stack.lower[0].put = put
    return entered, release


def metric(stack: TierStack, name: str, **labels: str) -> float | None:
    return stack.registry_for_test.get_sample_value(name, labels)


def test_lookup_returns_consecutive_blocks_and_stops_at_the_first_missing(stack):
    ids = prompt("gap", 5, extra=3)
    put_prompt(stack, "acme", ids, blocks=[0, 1, 3, 4])
    assert stack.flush(10)
    found = stack.lookup("acme", ids, 0, 5)
    assert [(b.index, b.tier, b.payload) for b in found] == [
        (0, "host", payload("kv", 0)), (1, "host", payload("kv", 1))]
    assert [b.index for b in stack.lookup("acme", ids, 3, 9)] == [3, 4]  # past the prompt
    assert stack.lookup("acme", ids, 2, 5) == []
    assert stack.lookup("other", ids, 0, 5) == []
    # Block 2 was asked of every tier: one miss each.
    assert metric(stack, "pdmesh:kv_tier_misses_total", tier="remote") == 3


def test_a_block_found_below_host_memory_is_promoted_to_it(stack, keys):
    ids = prompt("promote", 3)
    digests = put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    stack.host.purge("acme")  # only disk and the store hold the prompt now
    assert [b.tier for b in stack.lookup("acme", ids, 0, 3)] == ["disk"] * 3
    assert all(stack.host_has("acme", d) for d in digests)
    assert [b.tier for b in stack.lookup("acme", ids, 0, 3)] == ["host"] * 3
    stack.host.purge("acme")
    stack.lower[0].purge(keys.for_salt("acme").tenant_tag)  # disk emptied too
    assert [b.tier for b in stack.lookup("acme", ids, 0, 3)] == ["remote"] * 3
    assert [b.payload for b in stack.lookup("acme", ids, 0, 3)] == [
        payload("kv", i) for i in range(3)]


def test_purge_removes_only_that_tenants_entries_in_every_tier(stack, redis_server):
    ids = prompt("purge", 2)
    for salt in ("acme", "globex"):
        put_prompt(stack, salt, ids)
    assert stack.flush(10)
    assert stack.purge("acme") == {"host": 2, "disk": 2, "remote": 2}
    assert stack.lookup("acme", ids, 0, 2) == []
    assert stack.counters()["kv_tier_misses_remote"] == 1
    assert [b.tier for b in stack.lookup("globex", ids, 0, 2)] == ["host"] * 2
    stack.host.purge("globex")
    assert [b.tier for b in stack.lookup("globex", ids, 0, 2)] == ["disk"] * 2
    client = redis_server.client()
    assert len(client.keys("pdmesh:kv:*")) == 2
    client.close()


def test_blocks_put_before_a_purge_never_come_back(stack, keys):
    """A write still queued at the purge is not made, and an entry created before the
    purge that reaches a store anyway (another worker's) is refused as stale."""
    ids = prompt("queued", 1)
    entered, release = hold_disk_writes(stack)
    put_prompt(stack, "acme", prompt("in flight", 1))
    assert entered.wait(10)  # sealed, being written
    put_prompt(stack, "acme", ids)  # queued behind it
    stack.purge("acme")
    release.set()
    assert stack.flush(10)
    assert stack.lookup("acme", ids, 0, 1) == []
    tenant = keys.for_salt("acme")
    assert stack.lower[0].get(tenant.tenant_tag,
                              tenant.name(chain_digests("acme", ids, BLOCK_TOKENS)[0])) is None
    stale = stack.lookup("acme", prompt("in flight", 1), 0, 1)  # written after the purge
    assert stale == [] and stack.counters()["kv_tier_refused_remote_stale"] == 1


def test_a_full_write_queue_drops_and_counts_and_put_never_blocks(keys, tmp_path):
    registry = CollectorRegistry()
    stack = TierStack(keys, MODEL, GEOMETRY, disk=DiskTier(tmp_path / "queue", 1 << 20),
                      queue_bytes=2 * PAYLOAD_BYTES, registry=registry)
    entered, release = hold_disk_writes(stack)
    ids = prompt("queue", 6)
    put_prompt(stack, "acme", ids, blocks=[0])
    assert entered.wait(10)  # the writer holds block 0
    put_prompt(stack, "acme", ids, blocks=range(1, 6))  # 2 queued, 3 dropped
    release.set()
    assert stack.flush(10)
    assert stack.errors() == {("disk", "queue"): 3}
    assert registry.get_sample_value("pdmesh:kv_tier_errors_total",
                                     {"tier": "disk", "op": "queue"}) == 3
    assert stack.counters()["kv_tier_errors_disk"] == 3
    assert [b.index for b in stack.lookup("acme", ids, 0, 6)] == [0, 1, 2]
    stack.close()


def test_put_refuses_a_digest_that_is_not_its_blocks(stack):
    ids = prompt("lying caller", 2)
    digests = chain_digests("acme", ids, BLOCK_TOKENS)
    with pytest.raises(ValueError, match="not the chain digest"):
        stack.put("acme", digests[0], digests[0], 1, ids[8:16], payload("kv", 1))
    with pytest.raises(ValueError, match="block of 7 tokens"):
        stack.put("acme", None, digests[0], 0, ids[:7], payload("kv", 0))


def test_metrics_count_hits_misses_bytes_refusals_and_load_time(stack, redis_server):
    ids = prompt("metrics", 2)
    put_prompt(stack, "acme", ids)
    assert stack.flush(10)
    stack.host.purge("acme")
    client = redis_server.client()
    for key in client.keys("pdmesh:kv:*"):  # the store's copies altered: refused
        value = bytearray(client.get(key))
        value[-1] ^= 1
        client.set(key, bytes(value))
    client.close()
    stack.lookup("acme", ids, 0, 2)
    stack.lower[0].purge(stack.keys.for_salt("acme").tenant_tag)
    stack.host.purge("acme")
    assert stack.lookup("acme", ids, 0, 2) == []
    entry_bytes = metric(stack, "pdmesh:kv_tier_stored_bytes_total", tier="disk")
    expected = {
        ("hits", "host"): 0, ("hits", "disk"): 2, ("hits", "remote"): 0,
        ("misses", "host"): 3, ("misses", "disk"): 1, ("misses", "remote"): 1,
        ("loaded_bytes", "disk"): 2 * PAYLOAD_BYTES, ("loaded_bytes", "remote"): 0,
        ("stored_bytes", "host"): 4 * PAYLOAD_BYTES,  # 2 puts + 2 promotions
        ("stored_bytes", "remote"): entry_bytes}
    for (what, tier), value in expected.items():
        assert metric(stack, f"pdmesh:kv_tier_{what}_total", tier=tier) == value, (what, tier)
    assert entry_bytes > 2 * PAYLOAD_BYTES
    assert metric(stack, "pdmesh:kv_tier_refused_total", tier="remote", reason="mac") == 1
    assert metric(stack, "pdmesh:kv_tier_refused_total", tier="disk", reason="mac") == 0
    assert metric(stack, "pdmesh:kv_tier_load_seconds_count") == 2
    assert metric(stack, "pdmesh:kv_tier_entries", tier="host") == 0
    assert metric(stack, "pdmesh:kv_tier_entries", tier="disk") == 0
    assert metric(stack, "pdmesh:kv_tier_entries", tier="remote") is None
    counters = stack.counters()
    assert counters["kv_tier_hits_disk"] == 2 and counters["kv_tier_refused_remote_mac"] == 1
    assert counters["kv_tier_errors_remote"] == 0 and counters["kv_tier_entries_host"] == 0
