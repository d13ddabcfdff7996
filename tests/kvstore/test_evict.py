"""S3-FIFO (kvstore.evict): the queues' rules, sizes, skipping, and hit rates against LRU.

Every test ends with the policy's own consistency check (`problems()` empty).
"""

from __future__ import annotations

import random

import pytest

from pdmesh.kvstore.evict import (
    MAX_FREQ,
    S3FIFO,
    cyclic_trace,
    hit_rates,
    scan_trace,
    zipf_trace,
)


def fill(policy: S3FIFO, keys) -> list:
    """Insert each key, evicting while over capacity; the victims, in order."""
    victims = []
    for key in keys:
        policy.insert(key)
        while policy.over_capacity:
            victims.append(policy.pop_victim())
    return victims


def test_new_keys_leave_small_in_fifo_order() -> None:
    policy = S3FIFO(10)  # small 1, main 9
    assert fill(policy, range(13)) == [0, 1, 2]
    assert len(policy) == 10 and policy.size == 10 and not policy.over_capacity
    assert policy.problems() == []


def test_a_key_hit_in_small_moves_to_main_instead_of_leaving() -> None:
    policy = S3FIFO(10)
    fill(policy, range(10))
    policy.touch(0)
    assert fill(policy, [10, 11]) == [1, 2]  # 0 is promoted, not evicted
    assert 0 in policy and policy.frequency(0) == 1
    assert policy.problems() == []


def test_a_key_seen_again_after_eviction_enters_main() -> None:
    """The ghost: 0 evicted from small, inserted again, then survives a scan of one-offs
    that flushes small over and over."""
    policy = S3FIFO(10)
    fill(policy, range(11))  # evicts 0 into the ghost
    assert 0 not in policy
    fill(policy, [0])
    victims = fill(policy, range(100, 140))
    assert 0 in policy and 0 not in victims
    assert policy.problems() == []


def test_main_reinserts_keys_with_frequency_and_caps_it() -> None:
    policy = S3FIFO(10)
    for key in range(10):
        policy.insert(key)
    for _ in range(10):
        policy.touch(5)
    assert policy.frequency(5) == MAX_FREQ
    order = list(policy.order())
    assert order[-1] == 5 and sorted(order) == list(range(10))
    assert policy.problems() == []


def test_remove_forgets_the_key_without_a_ghost() -> None:
    policy = S3FIFO(10)
    fill(policy, range(5))
    policy.remove(2)
    assert 2 not in policy and len(policy) == 4 and policy.size == 4
    policy.insert(2)
    assert list(policy.order())[-1] == 2  # back in small, newest: not promoted to main
    with pytest.raises(KeyError):
        policy.remove(99)
    with pytest.raises(KeyError):
        policy.touch(99)
    assert policy.problems() == []


def test_sizes_and_capacity() -> None:
    policy = S3FIFO(100)
    policy.insert("a", 60)
    policy.insert("b", 30)
    assert policy.size == 90 and not policy.over_capacity
    policy.insert("c", 20)
    assert policy.over_capacity
    assert policy.pop_victim() == "a" and policy.size == 50
    policy.insert("b", 45)  # already held: new size, counted as a hit
    assert policy.size == 65 and policy.frequency("b") == 1 and len(policy) == 2
    with pytest.raises(ValueError):
        policy.insert("d", 0)
    with pytest.raises(ValueError):
        S3FIFO(0)
    assert policy.problems() == []


def test_pop_victim_skips_what_cannot_be_evicted() -> None:
    policy = S3FIFO(10)
    fill(policy, range(6))
    pinned = {0, 1}
    asked = []

    def can_evict(key) -> bool:
        asked.append(key)
        return key not in pinned

    assert policy.pop_victim(can_evict) == 2
    assert asked == [0, 1, 2] and 0 in policy and 1 in policy
    asked.clear()
    assert policy.pop_victim(can_evict) == 3  # the skipped keys went to the tail
    assert asked == [3]
    assert list(policy.order()) == [4, 5, 0, 1]
    assert policy.pop_victim(lambda key: False) is None
    assert len(policy) == 4 and policy.size == 4
    assert policy.pop_victim(can_evict) == 4
    assert policy.pop_victim(can_evict) == 5
    assert policy.pop_victim(can_evict) is None  # only pinned keys left
    assert sorted(policy.order()) == [0, 1]
    assert policy.pop_victim() == 0 and policy.pop_victim() == 1
    assert policy.pop_victim() is None and len(policy) == 0 and policy.size == 0
    assert policy.problems() == []


def test_pop_victim_falls_back_to_main_when_small_is_all_pinned() -> None:
    policy = S3FIFO(10)
    fill(policy, range(11))  # 0 into the ghost
    fill(policy, [0])  # 0 in main; small holds 1..10
    assert policy.pop_victim(lambda key: key == 0) == 0
    assert policy.problems() == []


def test_order_is_the_sequence_of_victims_under_random_traffic() -> None:
    rng = random.Random(7)
    policy = S3FIFO(20)
    for step in range(2000):
        key = rng.randrange(40)
        action = rng.random()
        if key in policy and action < 0.5:
            policy.touch(key)
        elif key in policy and action < 0.55:
            policy.remove(key)
        elif key not in policy:
            policy.insert(key, rng.randrange(1, 3))
        while policy.over_capacity:
            blocked = step % 7
            assert policy.pop_victim(lambda k, b=blocked: k % 7 != b) is not None
        assert policy.problems() == [], step
        assert policy.size <= 20
    order = list(policy.order())
    assert sorted(order) == sorted(k for k in range(40) if k in policy)
    assert [policy.pop_victim() for _ in order] == order
    assert len(policy) == 0 and policy.problems() == []


# ---- hit rates against LRU ------------------------------------------------------------
CAPACITY = 100


def test_cyclic_working_set_slightly_over_capacity() -> None:
    """LRU evicts every key just before its next use; S3-FIFO keeps much of the loop."""
    rates = hit_rates(cyclic_trace(working_set=125, length=20_000), CAPACITY)
    assert rates["lru"] == 0.0
    assert rates["s3fifo"] > 0.4  # of at most 0.8 (capacity / working set)


def test_scan_with_a_hot_set() -> None:
    """A hot set that fits, interleaved with one-off keys: the scan passes through small."""
    rates = hit_rates(scan_trace(hot=80, length=20_000, seed=1), CAPACITY)
    assert rates["s3fifo"] > rates["lru"] + 0.15


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.2])
def test_zipf_not_worse_than_lru(alpha: float) -> None:
    rates = hit_rates(zipf_trace(num_keys=1000, length=50_000, alpha=alpha, seed=3), CAPACITY)
    assert rates["s3fifo"] >= rates["lru"] - 0.03
