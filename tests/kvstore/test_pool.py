"""Allocator, leases, epochs, scrub policies and the integrity check.

Every lifecycle test ends with `assert_nothing_leaked(pool)`.
"""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
import torch

from pdmesh.kvstore import (
    POISON_VALUE,
    KVPool,
    LeaseAccessError,
    PoolExhaustedError,
    PoolIntegrityError,
    PoolSpec,
    ScrubPolicy,
)


def make_pool(num_pages: int = 8, page_tokens: int = 4, scrub=ScrubPolicy.NONE) -> KVPool:
    spec = PoolSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_tokens=page_tokens,
                    num_pages=num_pages)
    return KVPool(spec, scrub=scrub)


def assert_nothing_leaked(pool: KVPool) -> None:
    pool.check_integrity()
    assert pool.live_leases() == []
    assert pool.num_free_pages == pool.num_pages
    assert pool.num_leased_pages == 0


def fill(pool: KVPool, lease, value: float) -> None:
    for index in range(lease.num_pages):
        pool.page_tensor(lease, index).fill_(value)
        pool.mark_written(lease, index, lease.page_tokens)


def test_spec_geometry() -> None:
    spec = PoolSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=16, num_pages=10,
                    dtype=torch.float16)
    assert spec.bytes_per_page == 3 * 2 * 2 * 8 * 2 * 16
    assert spec.capacity_tokens == 160
    assert spec.pages_for(1) == 1 and spec.pages_for(16) == 1 and spec.pages_for(17) == 2
    with pytest.raises(ValueError):
        PoolSpec(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1, num_pages=1)


def test_pool_tensor_layout_makes_pages_contiguous_byte_ranges() -> None:
    pool = make_pool()
    assert pool.tensor.shape == (8, 2, 2, 4, 2, 4)
    assert pool.tensor.is_contiguous()
    lease = pool.allocate("r", 5)
    buf = pool.page_buffer(lease, 1)
    assert len(buf) == pool.spec.bytes_per_page
    buf[:] = bytes(range(256)) * (len(buf) // 256) + bytes(len(buf) % 256)
    raw = pool.tensor[lease.page_ids[1]].contiguous().view(torch.uint8).flatten()
    assert bytes(raw.numpy()) == bytes(buf)
    pool.release(lease, "done")
    assert_nothing_leaked(pool)


def test_allocate_release_lifecycle_and_counts() -> None:
    pool = make_pool(num_pages=8, page_tokens=4)
    assert pool.capacity_tokens == 32 and pool.free_tokens == 32
    a = pool.allocate("req-a", 9)  # 3 pages
    assert a.num_pages == 3 and a.num_tokens == 9 and a.capacity_tokens == 12
    assert a.is_live and a.request_id == "req-a"
    # The lease id is a UUID in its canonical form: a decode lease's id is its reservation id.
    assert str(uuid.UUID(a.lease_id)) == a.lease_id
    assert pool.num_free_pages == 5 and pool.num_leased_pages == 3 and pool.free_tokens == 20
    b = pool.allocate("req-b", 4)
    assert b.epoch > a.epoch
    assert set(a.page_ids).isdisjoint(b.page_ids)
    assert {lease.lease_id for lease in pool.live_leases()} == {a.lease_id, b.lease_id}
    pool.check_integrity()
    pool.release(a, "finished")
    assert not a.is_live and a.release_cause == "finished"
    pool.release(a, "again")  # idempotent
    assert a.release_cause == "finished"
    assert pool.num_free_pages == 7
    pool.release(b, "aborted")
    assert_nothing_leaked(pool)


def test_lifo_reuse_returns_the_same_pages_in_order() -> None:
    pool = make_pool(num_pages=8, page_tokens=4)
    a = pool.allocate("a", 12)
    pool.release(a, "done")
    b = pool.allocate("b", 12)
    assert b.page_ids == a.page_ids
    assert b.epoch > a.epoch
    assert pool.page_generation(a.page_ids[0]) == 1
    pool.release(b, "done")
    assert_nothing_leaked(pool)


def test_exhaustion_allocates_nothing() -> None:
    pool = make_pool(num_pages=4, page_tokens=4)
    a = pool.allocate("a", 8)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate("b", 9)
    assert info.value.requested_pages == 3 and info.value.free_pages == 2
    assert pool.num_free_pages == 2 and len(pool.live_leases()) == 1
    assert pool.stats.exhausted == 1
    with pytest.raises(ValueError):
        pool.allocate("c", 0)
    pool.release(a, "done")
    assert_nothing_leaked(pool)


def test_epochs_are_unique_and_monotonic() -> None:
    pool = make_pool(num_pages=8, page_tokens=4)
    epochs = []
    for i in range(20):
        lease = pool.allocate(f"r{i}", 1 + i % 7)
        epochs.append(lease.epoch)
        pool.release(lease, "done")
    assert epochs == sorted(set(epochs))
    assert_nothing_leaked(pool)


def test_written_counts_and_read_coverage() -> None:
    pool = make_pool(num_pages=8, page_tokens=4)
    lease = pool.allocate("r", 10)  # 3 pages
    pool.check_readable(lease, 0)
    with pytest.raises(LeaseAccessError, match="only 0 written"):
        pool.check_readable(lease, 1)
    pool.mark_written(lease, 0, 4)
    pool.mark_written(lease, 2, 2)  # a hole at page 1: not readable past token 4
    assert lease.page_written == [4, 0, 2] and lease.written_tokens == 6
    pool.check_readable(lease, 4)
    with pytest.raises(LeaseAccessError) as info:
        pool.check_readable(lease, 5)
    assert info.value.page_id == lease.page_ids[1]
    pool.mark_written(lease, 1, 4)
    pool.check_readable(lease, 10)
    assert pool.written_prefix(lease) == 10
    with pytest.raises(LeaseAccessError):
        pool.mark_written(lease, 3, 1)
    with pytest.raises(LeaseAccessError):
        pool.mark_written(lease, 0, 5)
    pool.release(lease, "done")
    assert_nothing_leaked(pool)


def test_the_read_checks_fast_path_still_sees_every_pages_epoch() -> None:
    """After reads have warmed the check's fast path (every decode step's case), a page of
    a live lease that carries another epoch (handed to another holder by a bug elsewhere,
    the lease's written prefix intact) is still refused, naming that page."""
    pool = make_pool(num_pages=8, page_tokens=4)
    lease = pool.allocate("tenant-a", 12)
    fill(pool, lease, 1.0)
    pool.check_readable(lease, 12)
    pool.check_readable(lease, 12)  # the fast path
    pool._page_epoch[lease.page_ids[1]] = lease.epoch + 1
    with pytest.raises(LeaseAccessError) as info:
        pool.check_readable(lease, 12)
    assert info.value.page_id == lease.page_ids[1] and "epoch" in info.value.reason
    pool._page_epoch[lease.page_ids[1]] = lease.epoch
    pool.check_readable(lease, 12)
    pool.release(lease, "done")
    assert_nothing_leaked(pool)


def test_read_through_stale_epoch_raises() -> None:
    """The incident's shape: a dead request's lease reads pages now holding another
    tenant's KV. Both the lease-liveness check and the per-page epoch tag must refuse."""
    pool = make_pool(num_pages=8, page_tokens=4)
    victim = pool.allocate("tenant-a", 8)
    fill(pool, victim, 1.0)
    pool.release(victim, "finished")
    other = pool.allocate("tenant-b", 8)  # LIFO: the very same pages
    assert other.page_ids == victim.page_ids
    fill(pool, other, 2.0)
    with pytest.raises(LeaseAccessError) as info:
        pool.check_readable(victim, 8)
    assert info.value.lease_id == victim.lease_id
    # A control-path bug that judges the dead lease live (the incident) must still be
    # stopped by the page tags: the pages carry the new epoch.
    victim._live = True
    with pytest.raises(LeaseAccessError) as info:
        pool.check_readable(victim, 1)
    assert "stale epoch" in info.value.reason and info.value.page_id == victim.page_ids[0]
    with pytest.raises(LeaseAccessError):
        pool.page_buffer(victim, 0)
    with pytest.raises(LeaseAccessError):
        pool.check_writable(victim, 0, 1)
    victim._live = False
    pool.check_readable(other, 8)
    pool.release(other, "finished")
    assert_nothing_leaked(pool)


def test_read_through_foreign_lease_raises() -> None:
    """A lease object naming pages it does not hold (forged, or mixed up by a bug)."""
    pool = make_pool(num_pages=8, page_tokens=4)
    a = pool.allocate("tenant-a", 8)
    fill(pool, a, 1.0)
    b = pool.allocate("tenant-b", 8)
    fill(pool, b, 2.0)
    forged = dataclasses.replace(b, page_ids=a.page_ids)
    assert forged.is_live
    with pytest.raises(LeaseAccessError) as info:
        pool.check_readable(forged, 1)
    assert info.value.page_id == a.page_ids[0] and "another lease" in info.value.reason
    with pytest.raises(LeaseAccessError):
        pool.page_buffer(forged, 0)
    with pytest.raises(LeaseAccessError):
        pool.mark_written(forged, 0, 1)
    # A lease from another pool with colliding epochs is refused too.
    other_pool = make_pool(num_pages=8, page_tokens=4)
    with pytest.raises(LeaseAccessError, match="another pool"):
        other_pool.check_readable(a, 1)
    pool.release(forged, "not ours")  # a forged copy cannot release the real lease
    assert b.is_live
    pool.release(a, "done")
    pool.release(b, "done")
    assert_nothing_leaked(pool)


def test_released_lease_cannot_write() -> None:
    pool = make_pool()
    lease = pool.allocate("r", 4)
    pool.release(lease, "aborted")
    with pytest.raises(LeaseAccessError, match="released"):
        pool.mark_written(lease, 0, 1)
    with pytest.raises(LeaseAccessError):
        pool.page_buffer(lease, 0)
    assert pool.stats.access_denied >= 2
    assert_nothing_leaked(pool)


@pytest.mark.parametrize("policy", list(ScrubPolicy))
def test_scrub_policies(policy: ScrubPolicy) -> None:
    pool = make_pool(num_pages=4, page_tokens=4, scrub=policy)
    lease = pool.allocate("r", 8)
    fill(pool, lease, 7.0)
    untouched = pool.allocate("keep", 4)
    fill(pool, untouched, 3.0)
    pages = list(lease.page_ids)
    pool.release(lease, "done")
    freed = pool.tensor[pages]
    expected = {ScrubPolicy.NONE: 7.0, ScrubPolicy.ZERO: 0.0, ScrubPolicy.POISON: POISON_VALUE}
    assert torch.all(freed == expected[policy])
    assert torch.all(pool.tensor[untouched.page_ids[0]] == 3.0)
    scrubbed = 0 if policy is ScrubPolicy.NONE else 2
    assert pool.stats.pages_scrubbed == scrubbed
    pool.release(untouched, "done")
    assert_nothing_leaked(pool)


def test_scrub_policy_parse() -> None:
    assert ScrubPolicy.parse("ZERO") is ScrubPolicy.ZERO
    with pytest.raises(ValueError, match="unknown scrub policy"):
        ScrubPolicy.parse("shred")


def test_integrity_check_detects_leaks_and_double_placement() -> None:
    pool = make_pool(num_pages=4, page_tokens=4)
    lease = pool.allocate("r", 4)
    pool.check_integrity()
    pool._free.append(lease.page_ids[0])  # page both free and leased
    with pytest.raises(PoolIntegrityError, match="both free and leased"):
        pool.check_integrity()
    pool._free.pop()
    pool._free.pop()  # a page vanished: leaked
    with pytest.raises(PoolIntegrityError, match="!= total"):
        pool.check_integrity()


def test_random_lifecycles_never_share_pages() -> None:
    rng = np.random.default_rng(0)
    pool = make_pool(num_pages=32, page_tokens=4)
    live = []
    for step in range(500):
        if live and (rng.random() < 0.45 or pool.num_free_pages == 0):
            lease = live.pop(int(rng.integers(len(live))))
            pool.release(lease, "done")
        else:
            try:
                live.append(pool.allocate(f"r{step}", int(rng.integers(1, 40))))
            except PoolExhaustedError:
                continue
        owned = [p for lease in live for p in lease.page_ids]
        assert len(owned) == len(set(owned))
        assert pool.num_leased_pages == len(owned)
    pool.check_integrity()
    for lease in live:
        pool.release(lease, "shutdown")
    assert_nothing_leaked(pool)
