"""S3-FIFO, the eviction policy of the KV caches: scan- and loop-resistant, O(1) per access.

S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23) keeps
three FIFO queues instead of one recency list:

- small (~10% of the capacity): where new keys enter. Most keys of a serving cache are seen
  once (one-off prompts, a long scan); they leave from here without displacing anything
  that was reused.
- main (~90%): keys reused while in small, or seen again soon after leaving it. Its head is
  evicted only when its frequency is 0; a key whose frequency is > 0 goes back to the tail
  with its frequency decremented (frequency counts hits, capped at 3).
- ghost: the keys (no data) recently evicted from small, as many as main holds in size. A
  key inserted again while remembered there enters main directly.

Plain LRU gets ~0 hits when a working set cycles through a cache slightly too small for it
(every key is evicted just before it is needed again) and lets one scan flush the whole
cache; S3-FIFO keeps most of a cyclic set and lets a scan pass through small.

The policy only orders keys; its owner holds the data. `insert` never evicts: the owner
calls `pop_victim` while `over_capacity` (or before inserting) and frees what it returns.
`pop_victim` skips keys the owner cannot free now (pinned, or parents of live entries).
Pure Python, stdlib only. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Hashable, Iterator, Sequence

MAX_FREQ = 3
SMALL_FRACTION = 0.1


class S3FIFO:
    """S3-FIFO over keys with sizes (any unit: pages, bytes); `capacity` in that unit."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity {capacity}: must be > 0")
        self.capacity = capacity
        self.small_capacity = max(1, int(capacity * SMALL_FRACTION))
        self.ghost_capacity = max(1, capacity - self.small_capacity)  # sized like main
        self._small: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._main: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._ghost: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_size = 0
        self._main_size = 0
        self._ghost_size = 0

    # ---- what is held -------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    @property
    def size(self) -> int:
        """Sum of the sizes of the keys held."""
        return self._small_size + self._main_size

    @property
    def over_capacity(self) -> bool:
        return self.size > self.capacity

    # ---- accesses -----------------------------------------------------------------------
    def insert(self, key: Hashable, size: int = 1) -> None:
        """Hold `key` (never evicts: see `pop_victim`). A key remembered by the ghost queue
        enters main, any other new key small. A key already held takes the new size and
        counts as a hit."""
        if size <= 0:
            raise ValueError(f"size {size}: must be > 0")
        if key in self._freq:
            queue = self._small if key in self._small else self._main
            delta = size - queue[key]
            queue[key] = size
            if queue is self._small:
                self._small_size += delta
            else:
                self._main_size += delta
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_size -= self._ghost.pop(key)
            self._main[key] = size
            self._main_size += size
        else:
            self._small[key] = size
            self._small_size += size

    def touch(self, key: Hashable) -> None:
        """A hit on `key` (held: KeyError otherwise). Nothing moves; the frequency does."""
        self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        """Drop `key` (held: KeyError otherwise) without remembering it in the ghost."""
        del self._freq[key]
        if key in self._small:
            self._small_size -= self._small.pop(key)
        else:
            self._main_size -= self._main.pop(key)

    # ---- eviction -----------------------------------------------------------------------
    def pop_victim(self, can_evict: Callable[[Hashable], bool] | None = None
                   ) -> Hashable | None:
        """Remove and return the next key the policy evicts, or None when no key held is
        evictable. Keys for which `can_evict` says False stay held and go to the tail of
        their queue, as if just used, so the next call does not retry them first."""
        skipped_small: list[tuple[Hashable, int]] = []
        skipped_main: list[tuple[Hashable, int]] = []
        try:
            while self._small or self._main:
                if self._small and (self._small_size >= self.small_capacity
                                    or not self._main):
                    key, size = next(iter(self._small.items()))
                    if self._freq[key] > 0:  # reused while in small: promote
                        del self._small[key]
                        self._small_size -= size
                        self._main[key] = size
                        self._main_size += size
                        continue
                    if can_evict is not None and not can_evict(key):
                        del self._small[key]
                        self._small_size -= size
                        skipped_small.append((key, size))
                        continue
                    del self._small[key]
                    self._small_size -= size
                    del self._freq[key]
                    self._remember(key, size)
                    return key
                key, size = next(iter(self._main.items()))
                if self._freq[key] > 0:  # reinsertion
                    self._freq[key] -= 1
                    self._main.move_to_end(key)
                    continue
                if can_evict is not None and not can_evict(key):
                    del self._main[key]
                    self._main_size -= size
                    skipped_main.append((key, size))
                    continue
                del self._main[key]
                self._main_size -= size
                del self._freq[key]
                return key
            return None
        finally:
            # Taken out while this call ran (so each is asked once); back at their tails.
            for key, size in skipped_small:
                self._small[key] = size
                self._small_size += size
            for key, size in skipped_main:
                self._main[key] = size
                self._main_size += size

    def _remember(self, key: Hashable, size: int) -> None:
        self._ghost[key] = size
        self._ghost_size += size
        while self._ghost_size > self.ghost_capacity and len(self._ghost) > 1:
            self._ghost_size -= self._ghost.popitem(last=False)[1]

    # ---- inspection ---------------------------------------------------------------------
    def order(self) -> Iterator[Hashable]:
        """Every key held, from next-to-evict to last: the keys successive `pop_victim()`
        calls would return if nothing else happened (computed on a copy; O(n))."""
        copy = S3FIFO(self.capacity)
        copy._small = self._small.copy()
        copy._main = self._main.copy()
        copy._freq = dict(self._freq)
        copy._small_size, copy._main_size = self._small_size, self._main_size
        copy.ghost_capacity = 1  # the copy's ghost is never read
        while (key := copy.pop_victim()) is not None:
            yield key

    def frequency(self, key: Hashable) -> int:
        """The hits counted for a held key (0..MAX_FREQ)."""
        return self._freq[key]

    def problems(self) -> list[str]:
        """Broken internal invariants (empty when consistent): for the owners' checks."""
        out = []
        if set(self._small) & set(self._main):
            out.append("a key is in both small and main")
        if set(self._small) | set(self._main) != set(self._freq):
            out.append("queues and frequencies name different keys")
        if set(self._ghost) & set(self._freq):
            out.append("a held key is also in the ghost")
        if (self._small_size != sum(self._small.values())
                or self._main_size != sum(self._main.values())
                or self._ghost_size != sum(self._ghost.values())):
            out.append("queue sizes do not add up")
        if not all(0 <= f <= MAX_FREQ for f in self._freq.values()):
            out.append("a frequency is out of range")
        return out


# ---- hit-rate comparison (tests, benchmarks) --------------------------------------------
def _lru_hits(trace: Sequence[Hashable], capacity: int) -> int:
    lru: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
    hits = 0
    for key in trace:
        if key in lru:
            hits += 1
            lru.move_to_end(key)
            continue
        lru[key] = None
        if len(lru) > capacity:
            lru.popitem(last=False)
    return hits


def _s3fifo_hits(trace: Sequence[Hashable], capacity: int) -> int:
    policy = S3FIFO(capacity)
    hits = 0
    for key in trace:
        if key in policy:
            hits += 1
            policy.touch(key)
            continue
        policy.insert(key)
        while policy.over_capacity:
            policy.pop_victim()
    return hits


def hit_rates(trace: Sequence[Hashable], capacity: int) -> dict[str, float]:
    """Fraction of accesses that hit, for an LRU and an S3FIFO of `capacity` unit-size
    keys, a miss inserting the key: {"lru": ..., "s3fifo": ...}."""
    n = max(len(trace), 1)
    return {"lru": _lru_hits(trace, capacity) / n, "s3fifo": _s3fifo_hits(trace, capacity) / n}


def cyclic_trace(working_set: int, length: int) -> list[int]:
    """Keys 0..working_set-1 round-robin: LRU's worst case once working_set > capacity."""
    return [i % working_set for i in range(length)]


def scan_trace(hot: int, length: int, seed: int = 0, hot_share: float = 0.5) -> list[int]:
    """A hot set of `hot` keys accessed at random, interleaved with a scan of keys never
    seen again (one-off prompts)."""
    rng = random.Random(seed)
    fresh = hot
    out = []
    for _ in range(length):
        if rng.random() < hot_share:
            out.append(rng.randrange(hot))
        else:
            out.append(fresh)
            fresh += 1
    return out


def zipf_trace(num_keys: int, length: int, alpha: float = 1.0, seed: int = 0) -> list[int]:
    """Keys drawn from a Zipf(alpha) popularity over `num_keys` keys (seeded)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(num_keys)]
    return rng.choices(range(num_keys), weights=weights, k=length)
