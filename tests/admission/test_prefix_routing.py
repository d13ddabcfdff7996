"""Cache-aware routing: heartbeat summaries -> registry -> decide() picks the prefill worker
with the longest cached prefix of the request *for its tenant's salt*, balanced by queue."""

from __future__ import annotations

import time

from pdmesh.kvstore import KVPool, PoolSpec
from pdmesh.kvstore.prefix_cache import PrefixCache
from pdmesh.services.admission.policy import Admitted, WorkerView, decide, prefill_cost
from pdmesh.services.admission.registry import CapacityRegistry
from pdmesh.services.protocol import messages as m

PAGE, ALIGN = 4, 8
ALICE, BOB = "salt-alice", "salt-bob"
PROMPT = list(range(1, 30))  # 29 tokens: 3 aligned blocks of 8 cached at most


def warm_cache(salt: str, tokens: list[int]) -> PrefixCache:
    pool = KVPool(PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=PAGE,
                           num_pages=32))
    cache = PrefixCache(pool, align_tokens=ALIGN)
    lease = cache.allocate("warm", salt, tokens)
    for index in range(lease.num_pages):
        pool.mark_written(lease, index, min(PAGE, len(tokens) - index * PAGE))
    cache.insert(salt, tokens, lease)
    pool.release(lease, "done")
    return cache


def beat(worker_id: str, role: m.Role = m.Role.PREFILL, cache: PrefixCache | None = None,
         queue_depth: int = 0) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, role=role, model="tiny",
                       pool_capacity_tokens=4096, available_tokens=4096, page_tokens=PAGE,
                       configured_context=4096, served_context=4096, queue_depth=queue_depth,
                       prefix_hashes=cache.summary(512) if cache else [],
                       prefix_align_tokens=ALIGN if cache else 0)


def registry_with(*beats: m.Heartbeat) -> CapacityRegistry:
    registry = CapacityRegistry(ttl_s=60)
    now = time.monotonic()
    for b in beats:
        registry.observe(b, now)
    return registry


def test_registry_reports_the_cached_prefix_for_the_tenants_salt_only() -> None:
    registry = registry_with(beat("p-cold"), beat("p-warm", cache=warm_cache(ALICE, PROMPT)))
    views = {v.worker_id: v for v in registry.views(m.Role.PREFILL, cache_salt=ALICE,
                                                    prompt_ids=PROMPT)}
    assert views["p-warm"].cached_prefix_tokens == 24 and views["p-cold"].cached_prefix_tokens == 0
    # Same tokens, another tenant: nothing (its chain starts from another salt).
    bob = registry.views(m.Role.PREFILL, cache_salt=BOB, prompt_ids=PROMPT)
    assert all(v.cached_prefix_tokens == 0 for v in bob)
    # A prompt sharing only the first block matches only that block.
    partial = registry.views(m.Role.PREFILL, cache_salt=ALICE,
                             prompt_ids=PROMPT[:10] + [0] * 20)
    assert {v.worker_id: v.cached_prefix_tokens for v in partial}["p-warm"] == 8
    assert all(v.cached_prefix_tokens == 0 for v in registry.views(m.Role.PREFILL))


def test_decide_routes_to_the_longest_cached_prefix() -> None:
    registry = registry_with(beat("p-a"), beat("p-b", cache=warm_cache(ALICE, PROMPT)),
                             beat("d", role=m.Role.DECODE))
    prefills = registry.views(m.Role.PREFILL, cache_salt=ALICE, prompt_ids=PROMPT)
    decodes = registry.views(m.Role.DECODE)
    bob_views = registry.views(m.Role.PREFILL, cache_salt=BOB, prompt_ids=PROMPT)
    bob_picks = set()
    for n in range(20):
        got = decide(len(PROMPT), 8, prefills, decodes, spread=f"r{n}")
        assert isinstance(got, Admitted) and got.prefill.worker_id == "p-b"
        bob = decide(len(PROMPT), 8, bob_views, decodes, spread=f"r{n}")
        assert isinstance(bob, Admitted)
        bob_picks.add(bob.prefill.worker_id)
    # Bob has nothing cached anywhere: no affinity, equal workers share his requests.
    assert bob_picks == {"p-a", "p-b"}


def test_cache_affinity_is_balanced_against_queue_depth() -> None:
    def view(name: str, queue: int, cached: int) -> WorkerView:
        return WorkerView(worker_id=name, capacity_tokens=4096, available_tokens=4096,
                          page_tokens=16, served_context=4096, queue_depth=queue,
                          cached_prefix_tokens=cached)

    decode = [view("d", 0, 0)]

    def pick(*prefills: WorkerView) -> str:
        got = decide(1000, 8, list(prefills), decode)
        assert isinstance(got, Admitted)
        return got.prefill.worker_id

    # Equal queues: the cache wins.
    assert pick(view("cold", 0, 0), view("warm", 0, 992)) == "warm"
    assert pick(view("cold", 1, 0), view("warm", 1, 512)) == "warm"
    # A queued prompt ahead costs about one prompt: an idle cold worker is (just) sooner.
    assert pick(view("idle", 0, 0), view("warm", 1, 992)) == "idle"
    assert pick(view("idle", 0, 0), view("warm", 2, 992)) == "idle"
    # Without cache hits the order is queue depth, as before.
    assert pick(view("a", 2, 0), view("b", 1, 0)) == "b"
    assert prefill_cost(10, view("x", 0, 10_000)) == 1  # the last token is always computed


def test_admission_charges_queue_depth_between_heartbeats() -> None:
    """A burst must not pile onto the warm worker on a stale view."""
    registry = registry_with(beat("p-a"), beat("p-b", cache=warm_cache(ALICE, PROMPT)))
    for _ in range(2):
        registry.charge(m.Role.PREFILL, "p-b", len(PROMPT))
    views = {v.worker_id: v for v in registry.views(m.Role.PREFILL, cache_salt=ALICE,
                                                    prompt_ids=PROMPT)}
    assert views["p-b"].queue_depth == 2 and views["p-a"].queue_depth == 0
