"""Prefix cache over the pool: tenant-salted keys (I7), pins, read-only pages, eviction.

Pages are filled with a value derived from (salt, the tokens up to the end of the page), so
a reader can tell whose KV it got: any cross-tenant or stale page shows up as a wrong value.
Every test ends with the cache's and the pool's integrity checks.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdmesh.kvstore import (
    KVPool,
    LeaseAccessError,
    PoolExhaustedError,
    PoolIntegrityError,
    PoolSpec,
)
from pdmesh.kvstore.prefix_cache import PrefixCache
from pdmesh.kvstore.prefix_key import aligned_prefix_hashes

PAGE = 4
ALICE, BOB = "salt-alice", "salt-bob"


def make(num_pages: int = 16, align: int = PAGE) -> tuple[KVPool, PrefixCache]:
    pool = KVPool(PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=PAGE,
                           num_pages=num_pages))
    return pool, PrefixCache(pool, align_tokens=align)


def tag(salt: str, tokens: list[int]) -> float:
    """The value a page holding the KV of `tokens` (up to its end) under `salt` carries."""
    digest = hashlib.blake2b(repr((salt, tokens)).encode(), digest_size=3).digest()
    return float(int.from_bytes(digest, "little"))


def prefill(pool: KVPool, cache: PrefixCache, salt: str, tokens: list[int], rid: str = "r"):
    """What the engine does: allocate through the cache, write the rest, insert."""
    lease = cache.allocate(rid, salt, tokens)
    for index in range(lease.cached_tokens // PAGE, lease.num_pages):
        end = min((index + 1) * PAGE, len(tokens))
        pool.page_tensor(lease, index).fill_(tag(salt, tokens[:end]))
        pool.mark_written(lease, index, end - index * PAGE)
    cache.insert(salt, tokens, lease)
    return lease


def assert_pages_are_mine(pool: KVPool, lease, salt: str, tokens: list[int]) -> None:
    pool.check_readable(lease, len(tokens))
    for index, page_id in enumerate(lease.page_ids[:-(-len(tokens) // PAGE)]):
        end = min((index + 1) * PAGE, len(tokens))
        assert float(pool.tensor[page_id].flatten()[0]) == tag(salt, tokens[:end]), index


def check(cache: PrefixCache) -> None:
    cache.check_integrity()
    pool = cache.pool
    assert pool.num_free_pages + pool.num_leased_pages + pool.num_cached_pages == pool.num_pages


PROMPT = list(range(1, 14))  # 13 tokens: 3 whole pages + 1 token


def test_same_tenant_hits_and_reads_the_cached_pages() -> None:
    """Positive control: the second identical prompt reuses the three whole pages."""
    pool, cache = make()
    first = prefill(pool, cache, ALICE, PROMPT, "a1")
    assert first.cached_tokens == 0 and cache.num_pages == 3
    pool.release(first, "done")
    second = cache.allocate("a2", ALICE, PROMPT + [99])
    assert second.cached_tokens == 12 and second.page_shared[:3] == [True] * 3
    assert second.page_ids[:3] == first.page_ids[:3]
    assert all(pool.page_refs(p) == 1 for p in second.page_ids[:3])
    pool.check_readable(second, 12)  # pinned cached pages read fine, before any write
    pool.release(second, "done")
    assert cache.stats.queries == 2 and cache.stats.hit_tokens == 12
    check(cache)


def test_other_tenant_never_hits() -> None:
    """I7: the same tokens under another salt match nothing and share no page."""
    pool, cache = make()
    alice = prefill(pool, cache, ALICE, PROMPT, "a")
    assert cache.cached_tokens(BOB, PROMPT) == 0
    bob = prefill(pool, cache, BOB, PROMPT, "b")
    assert bob.cached_tokens == 0
    assert set(bob.page_ids).isdisjoint(alice.page_ids)
    assert_pages_are_mine(pool, bob, BOB, PROMPT)
    assert cache.cached_tokens("", PROMPT) == 0  # an empty salt caches nothing
    empty = prefill(pool, cache, "", PROMPT, "e")
    assert not any(empty.page_shared) and cache.num_pages == 6
    for lease in (alice, bob, empty):
        pool.release(lease, "done")
    assert cache.cached_tokens(ALICE, PROMPT) == 12 and cache.cached_tokens(BOB, PROMPT) == 12
    check(cache)


def test_purge_evicts_one_salts_unpinned_pages_and_no_others() -> None:
    """`pdmesh cache purge`: alice's unpinned pages go, bob's stay; a page a live lease
    pins stays until a later purge."""
    pool, cache = make()
    pool.release(prefill(pool, cache, ALICE, PROMPT, "a1"), "done")
    pool.release(prefill(pool, cache, BOB, PROMPT, "b1"), "done")
    pinned = prefill(pool, cache, ALICE, [7, 7, 7, 7, 8, 8, 8, 8, 9], "a2")
    assert cache.purge(ALICE) == 3  # PROMPT's three pages; the pinned two stay
    assert cache.cached_tokens(ALICE, PROMPT) == 0
    assert cache.cached_tokens(BOB, PROMPT) == 12
    assert cache.cached_tokens(ALICE, [7, 7, 7, 7, 8, 8, 8, 8, 9]) == 8
    check(cache)
    pool.release(pinned, "done")
    assert cache.purge(ALICE) == 2 and cache.purge(ALICE) == 0 and cache.purge("") == 0
    assert cache.cached_tokens(BOB, PROMPT) == 12
    check(cache)


def test_at_least_the_last_token_is_computed_and_hits_are_aligned() -> None:
    pool, cache = make(align=2 * PAGE)
    lease = prefill(pool, cache, ALICE, list(range(16)))
    assert cache.num_pages == 4  # 16 tokens = 2 aligned blocks of 8
    pool.release(lease, "done")
    assert cache.cached_tokens(ALICE, list(range(16))) == 8  # not 16: the last is computed
    assert cache.cached_tokens(ALICE, list(range(17))) == 16
    assert cache.cached_tokens(ALICE, list(range(12)) + [0]) == 8  # 3 pages -> 1 block
    check(cache)


def test_cached_pages_are_read_only_and_only_for_their_pinner() -> None:
    pool, cache = make()
    owner = prefill(pool, cache, ALICE, PROMPT, "a1")
    cached_page = owner.page_ids[0]
    with pytest.raises(LeaseAccessError, match="read-only"):
        pool.page_tensor(owner, 0)  # even the lease that wrote it can no longer write it
    with pytest.raises(LeaseAccessError, match="read-only"):
        pool.mark_written(owner, 0, PAGE)
    reader = cache.allocate("a2", ALICE, PROMPT)
    with pytest.raises(LeaseAccessError, match="read-only"):
        pool.check_writable(reader, 0, 1)
    # Another lease naming the cached page without having pinned it is refused.
    other = pool.allocate("b", 8)
    forged = dataclasses.replace(other, page_ids=(cached_page, other.page_ids[1]))
    with pytest.raises(LeaseAccessError, match="not pinned"):
        pool.check_readable(forged, 1)
    with pytest.raises(LeaseAccessError):
        pool.page_view(forged, 0)
    assert bytes(pool.page_view(reader, 0)) == bytes(pool.page_view(owner, 0))
    with pytest.raises(TypeError):
        pool.page_view(reader, 0)[0] = 1  # read-only view
    for lease in (owner, reader, other):
        pool.release(lease, "done")
    with pytest.raises(LeaseAccessError, match="released"):
        pool.check_readable(reader, 1)  # a released reader's pins are gone
    check(cache)


def test_eviction_under_pressure_never_frees_a_pinned_page() -> None:
    pool, cache = make(num_pages=8)
    a = prefill(pool, cache, ALICE, PROMPT, "a")  # 4 pages, 3 cached
    pool.release(a, "done")
    b = prefill(pool, cache, BOB, PROMPT, "b")  # 4 more: 6 cached (3 pinned by b), 1 owned
    assert pool.num_free_pages == 1 and pool.num_evictable_pages == 3
    reader = cache.allocate("a2", ALICE, PROMPT)  # pins alice's 3, takes the last free one
    assert reader.cached_tokens == 12
    pool.release(b, "done")  # bob's 3 cached pages unpinned, 1 freed
    # Needs 4 fresh pages: 1 free + bob's 3 evictable; alice's 3 are pinned by `reader`.
    big = pool.allocate("big", 16)
    assert cache.stats.evicted_pages == 3 and cache.cached_tokens(BOB, PROMPT) == 0
    assert set(big.page_ids).isdisjoint(reader.page_ids)
    assert_pages_are_mine(pool, reader, ALICE, PROMPT[:12])
    with pytest.raises(PoolExhaustedError):  # nothing evictable: pinned pages stay
        cache.allocate("c", BOB, PROMPT)
    assert [pool.page_refs(p) for p in reader.page_ids[:3]] == [1, 1, 1]
    with pytest.raises(ValueError, match="pinned"):
        pool.evict(reader.page_ids[0])
    pool.release(big, "done")
    pool.release(reader, "done")
    assert cache.clear() == 3 and pool.num_free_pages == pool.num_pages
    check(cache)


def test_eviction_spares_reused_pages_and_takes_leaves_first() -> None:
    pool, cache = make(num_pages=12)
    for rid, salt in (("a", ALICE), ("b", BOB)):
        pool.release(prefill(pool, cache, salt, PROMPT, rid), "done")
    pool.release(cache.allocate("a-again", ALICE, PROMPT), "done")  # alice more recent
    pool.allocate("x", 6 * PAGE + 1)  # needs 7 of 6 free: evicts bob's leaf page only
    assert cache.cached_tokens(BOB, PROMPT + [0]) == 8
    assert cache.cached_tokens(ALICE, PROMPT + [0]) == 12
    check(cache)


def run_cycle(cache: PrefixCache, prompts: list[list[int]], rounds: int) -> float:
    """Prefill the prompts round-robin (one at a time, each released before the next),
    checking integrity after every step; the fraction of prompt tokens served cached."""
    pool, served, total = cache.pool, 0, 0
    for step in range(rounds * len(prompts)):
        tokens = prompts[step % len(prompts)]
        lease = prefill(pool, cache, ALICE, tokens, f"r{step}")
        assert_pages_are_mine(pool, lease, ALICE, tokens)
        served += lease.cached_tokens
        total += len(tokens) - 1  # the last token is always computed
        pool.release(lease, "done")
        check(cache)
    return served / total


def test_cyclic_prompts_slightly_over_the_pool_keep_hitting() -> None:
    """5 prompts of 8 pages round-robin over a pool that caches 4 of them: LRU evicts each
    prompt just before it returns (0 of 200 prefills hit); S3-FIFO keeps most of them in
    its main queue (~55% of the tokens, of at most 80%)."""
    pages = 8
    pool, cache = make(num_pages=4 * pages + 1)
    prompts = [[1000 * p + i for i in range(pages * PAGE + 1)] for p in range(5)]
    assert run_cycle(cache, prompts, rounds=40) > 0.4
    assert cache.stats.hit_queries > cache.stats.queries // 2
    cached = cache.num_pages
    assert cache.clear() == cached  # nothing pinned: one clear empties it
    assert cache.num_pages == 0 and pool.num_free_pages == pool.num_pages
    check(cache)


def test_a_burst_of_one_off_prompts_does_not_flush_a_reused_prefix() -> None:
    """A system prompt reused a few times survives a scan of distinct prompts that fills
    the pool several times over (LRU would evict it first)."""
    pool, cache = make(num_pages=40)
    system = list(range(500, 500 + 4 * PAGE))
    for i in range(3):
        pool.release(prefill(pool, cache, ALICE, system + [i]), "done")
    for i in range(60):
        pool.release(prefill(pool, cache, ALICE, [10_000 + 100 * i + t for t in range(
            3 * PAGE + 1)], f"scan{i}"), "done")
        check(cache)
    assert cache.cached_tokens(ALICE, system + [0]) == 4 * PAGE
    cache.clear()
    assert pool.num_free_pages == pool.num_pages
    check(cache)


def test_summary_lists_the_most_valuable_prefixes_shortest_first() -> None:
    pool, cache = make(num_pages=32, align=2 * PAGE)
    hot, cold = list(range(17)), list(range(100, 117))  # 2 aligned blocks each
    for tokens in (hot, cold):
        pool.release(prefill(pool, cache, ALICE, tokens), "done")
    pool.release(cache.allocate("again", ALICE, hot), "done")  # hot's pages are reused
    hot_hashes = list(aligned_prefix_hashes(ALICE, hot, PAGE, 2 * PAGE, 16))
    cold_hashes = list(aligned_prefix_hashes(ALICE, cold, PAGE, 2 * PAGE, 16))
    assert cache.summary(10) == hot_hashes + cold_hashes
    assert cache.summary(1) == hot_hashes[:1] and cache.summary(0) == []
    check(cache)


def test_integrity_detects_bad_pin_counts() -> None:
    pool, cache = make()
    lease = prefill(pool, cache, ALICE, PROMPT)
    pool._page_refs[lease.page_ids[0]] -= 1
    with pytest.raises(PoolIntegrityError, match="pin counts"):
        pool.check_integrity()
    pool._page_refs[lease.page_ids[0]] += 1
    pool.release(lease, "done")
    check(cache)


def test_integrity_detects_a_page_the_policy_lost_or_gained() -> None:
    pool, cache = make()
    pool.release(prefill(pool, cache, ALICE, PROMPT), "done")
    chain_hash = next(iter(cache._nodes))
    cache._policy.remove(chain_hash)
    with pytest.raises(PoolIntegrityError, match="policy holds 2 pages"):
        cache.check_integrity()
    cache._policy.insert(chain_hash)
    cache._policy.insert("stray")
    with pytest.raises(PoolIntegrityError, match="policy holds 4 pages"):
        cache.check_integrity()
    cache._policy.remove("stray")
    check(cache)


def test_summary_hashes_match_what_admission_computes() -> None:
    pool, cache = make(align=2 * PAGE)
    pool.release(prefill(pool, cache, ALICE, list(range(17))), "done")
    summary = cache.summary(10)
    assert len(summary) == 2
    wanted = list(aligned_prefix_hashes(ALICE, list(range(17)), PAGE, 2 * PAGE, 16))
    assert set(summary) == set(wanted)
    assert not set(aligned_prefix_hashes(BOB, list(range(17)), PAGE, 2 * PAGE, 16)) & set(
        summary)
    check(cache)


# ---- a mixed random run ---------------------------------------------------------------------
SALTS = (ALICE, BOB, "salt-carol")
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random allocate/prefill/insert/release/evict traffic over three tenants sharing token
    prefixes; after every step the pool and the tree are consistent and every live lease
    reads exactly its own tenant's values."""

    def __init__(self) -> None:
        super().__init__()
        self.pool, self.cache = make(num_pages=24)
        self.live: list[tuple[object, str, list[int]]] = []
        self.count = 0

    @rule(salt=st.sampled_from(SALTS), prefix=st.sampled_from(PREFIXES),
          suffix=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def run_prompt(self, salt: str, prefix: list[int], suffix: list[int]) -> None:
        tokens = prefix + suffix
        self.count += 1
        expected = self.cache.cached_tokens(salt, tokens)
        try:
            lease = prefill(self.pool, self.cache, salt, tokens, f"r{self.count}")
        except PoolExhaustedError:
            return
        assert lease.cached_tokens == expected
        self.live.append((lease, salt, tokens))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def release(self, pick: int) -> None:
        lease, _, _ = self.live.pop(pick % len(self.live))
        self.pool.release(lease, "done")

    @rule(pages=st.integers(1, 8))
    def pressure(self, pages: int) -> None:
        try:
            lease = self.pool.allocate(f"p{self.count}", pages * PAGE)
        except PoolExhaustedError:
            return
        self.pool.release(lease, "done")

    @invariant()
    def consistent(self) -> None:
        check(self.cache)
        for lease, salt, tokens in self.live:
            assert_pages_are_mine(self.pool, lease, salt, tokens)

    def teardown(self) -> None:
        for lease, _, _ in self.live:
            self.pool.release(lease, "done")
        self.cache.clear()
        check(self.cache)
        assert self.pool.num_free_pages == self.pool.num_pages


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                           deadline=None)
