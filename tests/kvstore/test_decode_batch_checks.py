"""The decode step's batched lease checks (`check_decode_batch`, `mark_decode_batch`): the
same verdicts as the per-lease checks they replace (I2), for every request of a batch."""

from __future__ import annotations

import random

import pytest

from pdmesh.kvstore import KVPool, LeaseAccessError, PoolSpec

PAGE = 4


def make_pool(num_pages: int = 32) -> KVPool:
    return KVPool(PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=PAGE,
                           num_pages=num_pages))


def filled(pool: KVPool, request_id: str, tokens: int, capacity: int):
    lease = pool.allocate(request_id, capacity)
    if tokens:
        pool.mark_written_range(lease, 0, tokens)
    return lease


def per_lease_verdict(pool: KVPool, lease, position: int) -> bool:
    """What the decode step checked before the batched check: append at the written
    length, write one token there, read every token before it."""
    try:
        if position != pool.written_prefix(lease):
            return False
        pool.check_writable(lease, position, 1)
        pool.check_readable(lease, position)
    except LeaseAccessError:
        return False
    return True


def test_a_valid_batch_passes_and_marks_like_per_lease_marks() -> None:
    pool, twin = make_pool(), make_pool()
    lengths = [1, 3, 4, 7, 8, 13]  # inside a page, at a page's last slot, at a page start
    leases = [filled(pool, f"r{i}", n, 20) for i, n in enumerate(lengths)]
    twins = [filled(twin, f"r{i}", n, 20) for i, n in enumerate(lengths)]
    for step in range(6):  # crosses page boundaries for every lease
        positions = [n + step for n in lengths]
        pool.check_decode_batch(leases, positions)
        pool.mark_decode_batch(leases, positions)
        for lease, position in zip(twins, positions, strict=True):
            twin.mark_written(lease, position // PAGE, position % PAGE + 1)
        for lease, other, position in zip(leases, twins, positions, strict=True):
            assert pool.written_prefix(lease) == twin.written_prefix(other) == position + 1
            assert lease.page_written == other.page_written
            assert (pool._page_written[list(lease.page_ids)].tolist()
                    == twin._page_written[list(other.page_ids)].tolist())
    pool.check_integrity()


def test_the_batch_check_refuses_a_page_of_another_epoch_after_the_fast_path_warmed() -> None:
    """A live lease whose page carries another epoch (handed on by a bug elsewhere; the
    written prefix intact) is refused, naming the page, wherever the page sits: a page it
    reads or the page it writes, alone or among good leases."""
    pool = make_pool()
    good = filled(pool, "good", 9, 20)
    bad = filled(pool, "bad", 9, 20)
    for batch in ([bad], [good, bad], [bad, good]):
        pool.check_decode_batch(batch, [9] * len(batch))  # warm: the fast path's case
    for index in (0, 1, 2):  # pages read: 0 and 1; page 2 takes the token at position 9
        page = bad.page_ids[index]
        pool._page_epoch[page] = bad.epoch + 1
        for batch in ([bad], [good, bad], [bad, good]):
            with pytest.raises(LeaseAccessError) as info:
                pool.check_decode_batch(batch, [9] * len(batch))
            assert info.value.page_id == page and info.value.lease_id == bad.lease_id
        pool._page_epoch[page] = bad.epoch
    pool.check_decode_batch([good, bad], [9, 9])


def test_the_batch_check_refuses_reading_what_the_lease_never_wrote() -> None:
    """The incident: a long prompt's pages reserved, one token written; a decode step at
    the prompt's length would read never-written pages."""
    pool = make_pool()
    good = filled(pool, "good", 5, 20)
    stub = filled(pool, "stub", 1, 20)
    for position in (16, 2, 0):  # past the written length, or before it
        with pytest.raises(LeaseAccessError, match="append at position"):
            pool.check_decode_batch([good, stub], [5, position])
    pool.mark_written(stub, 2, PAGE)  # written pages after a hole do not count
    with pytest.raises(LeaseAccessError):
        pool.check_decode_batch([stub, good], [12, 5])
    pool.check_decode_batch([stub, good], [1, 5])


def test_the_batch_check_refuses_released_foreign_and_full_leases() -> None:
    pool, other = make_pool(), make_pool()
    good = filled(pool, "good", 5, 20)
    dead = filled(pool, "dead", 5, 20)
    pool.release(dead, "finished")
    taker = filled(pool, "taker", 5, 20)  # LIFO: dead's pages, the same positions written
    assert taker.page_ids[:2] == dead.page_ids[:2]
    with pytest.raises(LeaseAccessError, match="released"):
        pool.check_decode_batch([good, dead], [5, 5])
    dead._live = True  # a control-path bug judges the dead request live
    with pytest.raises(LeaseAccessError):
        pool.check_decode_batch([good, dead], [5, 5])
    with pytest.raises(LeaseAccessError):
        pool.mark_decode_batch([dead], [5])
    dead._live = False
    foreign = filled(other, "foreign", 5, 20)
    with pytest.raises(LeaseAccessError, match="another pool"):
        pool.check_decode_batch([good, foreign], [5, 5])
    full = filled(pool, "full", 8, 8)
    with pytest.raises(LeaseAccessError, match="capacity"):
        pool.check_decode_batch([good, full], [5, 8])
    assert pool.written_prefix(good) == 5 and pool.written_prefix(taker) == 5


def test_the_batch_mark_refuses_a_page_of_another_epoch() -> None:
    pool = make_pool()
    lease = filled(pool, "a", 5, 20)
    page = lease.page_ids[1]
    pool._page_epoch[page] = lease.epoch + 1
    with pytest.raises(LeaseAccessError) as info:
        pool.mark_decode_batch([lease], [5])
    assert info.value.page_id == page
    assert pool.written_prefix(lease) == 5
    pool._page_epoch[page] = lease.epoch
    pool.mark_decode_batch([lease], [5])
    assert pool.written_prefix(lease) == 6


def test_a_lease_holding_shared_prefix_pages_is_checked_page_by_page() -> None:
    pool = make_pool()
    lease = filled(pool, "sharer", 9, 20)
    pool.share(lease, 0)  # its first page goes to the prefix cache, pinned by it
    good = filled(pool, "good", 3, 20)
    pool.check_decode_batch([good, lease], [3, 9])
    pool.mark_decode_batch([good, lease], [3, 9])
    assert pool.written_prefix(lease) == 10
    pool._page_epoch[lease.page_ids[1]] = lease.epoch + 1
    with pytest.raises(LeaseAccessError) as info:
        pool.check_decode_batch([good, lease], [4, 10])
    assert info.value.page_id == lease.page_ids[1]


def test_random_batches_get_the_per_lease_verdict() -> None:
    """Seeded, bounded: random batches of live, released, re-leased, tampered and
    mispositioned leases; the batch passes exactly when every lease's own checks pass."""
    rng = random.Random(17)
    pool = make_pool(num_pages=48)
    leases = []
    for round_ in range(300):
        if len(leases) < 6 or rng.random() < 0.2:
            capacity = rng.randint(1, 24)
            if pool.num_free_pages * PAGE >= capacity:
                leases.append(filled(pool, f"r{round_}", rng.randint(0, capacity - 1),
                                     capacity))
        if rng.random() < 0.15:
            pool.release(rng.choice(leases), "random")
        batch = rng.sample(leases, rng.randint(1, min(6, len(leases))))
        batch = list({id(lease): lease for lease in batch}.values())
        positions = [pool.written_prefix(lease) + rng.choice((0, 0, 0, 1, -1))
                     for lease in batch]
        tampered = None
        live = [lease for lease in batch if lease.is_live and lease.num_pages]
        if live and rng.random() < 0.2:
            victim = rng.choice(live)
            tampered = victim.page_ids[rng.randrange(victim.num_pages)]
            saved = int(pool._page_epoch[tampered])
            pool._page_epoch[tampered] = saved + 1
        expected = all(per_lease_verdict(pool, lease, position)
                       for lease, position in zip(batch, positions, strict=True))
        try:
            pool.check_decode_batch(batch, positions)
            verdict = True
        except LeaseAccessError:
            verdict = False
        if tampered is not None:
            pool._page_epoch[tampered] = saved
        assert verdict == expected, (round_, positions)
        if verdict:
            pool.mark_decode_batch(batch, positions)
        leases = [lease for lease in leases if lease.is_live]
    pool.check_integrity()
