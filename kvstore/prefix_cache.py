"""Tenant-salted prefix cache of whole KV pages: one radix tree per cache salt, S3-FIFO eviction.

Key: (cache salt, token ids page by page). Every node is one whole page of `page_tokens`
tokens, found under its parent by those token ids, and every salt has its own root, so a
prefix cached for one tenant can never match another tenant's request, whatever the tokens
(invariant I7). An empty salt caches nothing. Matching compares token ids, never hashes; the
chain hashes (`kvstore.prefix_key`) are only the summary that workers advertise for routing.

Pages. A node's page is CACHED in the pool: whole, written, immutable. Reference counts are
the pool's pins: a lease pins the cached pages it reads, from allocation to release, and the
pool refuses to evict a pinned page. Pins always form root paths (a lease pins the path it
matched plus the pages it added right below it), so an unpinned node has no pinned child.

Alignment. Hits and insertions are multiples of `align_tokens`, which the engine sets to
lcm(page size, PREFILL_CHUNK): the KV bits a prefill computes depend on the chunk shape
(BLAS picks kernels by shape), so reuse starts the remainder on a chunk boundary and reuses
only pages computed in a full chunk, exactly as the single-process reference computes them
(invariant I4: outputs with and without the cache are identical).

Eviction: S3-FIFO (`kvstore.evict`), one unit-size key per page, keyed by its chain hash
(stable across evictions, unlike page ids, so the ghost queue recognises a prefix seen
again). Serving traffic is what defeats LRU: a set of prompts cycling through a pool slightly
too small for them makes LRU evict each prompt just before it comes back (hit rate ~0), and
one burst of one-off prompts flushes every reused prefix. S3-FIFO lets new pages pass
through a small queue, keeps pages reused (or seen again soon after eviction) in the main
queue, and keeps much of such a cycle. A hit counts once for every page of the matched path.
Only an unpinned leaf is ever evicted (`can_evict`): the policy skips pinned pages and the
parents of cached pages, so chains still go leaf first and pins still form root paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdmesh.kvstore.errors import PoolIntegrityError
from pdmesh.kvstore.evict import S3FIFO
from pdmesh.kvstore.lease import Lease
from pdmesh.kvstore.pool import KVPool
from pdmesh.kvstore.prefix_key import page_hash, root_hash


@dataclass(eq=False)
class _Node:
    page_id: int  # -1 for a salt's root
    parent: _Node | None
    chain_hash: int  # key of the salt plus every token up to the end of this page
    depth: int  # pages from the root, this one included
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    key: tuple[int, ...] = ()  # this page's token ids
    salt: str = ""  # set on roots only


@dataclass
class PrefixCacheStats:
    queries: int = 0  # allocations that looked the prompt up
    hit_queries: int = 0  # ... and reused at least one page
    hit_tokens: int = 0  # prompt tokens served from the cache
    inserted_pages: int = 0
    evicted_pages: int = 0


class PrefixCache:
    """The prefix cache of one pool. Not thread-safe: call it from the pool's owner."""

    def __init__(self, pool: KVPool, align_tokens: int = 0,
                 on_evict: Callable[[int], None] | None = None) -> None:
        page = pool.page_tokens
        align = align_tokens or page
        if align % page:
            raise ValueError(f"align_tokens {align} is not a multiple of the page size {page}")
        if pool.reclaimer is not None:
            raise ValueError("this pool already has a prefix cache")
        self.pool = pool
        self.page_tokens = page
        self.align_tokens = align
        self.on_evict = on_evict
        self.stats = PrefixCacheStats()
        self._roots: dict[str, _Node] = {}
        self._nodes: dict[int, _Node] = {}  # chain hash -> node: the policy's keys
        self._policy = S3FIFO(pool.num_pages)
        pool.reclaimer = self._reclaim

    @property
    def num_pages(self) -> int:
        return len(self._nodes)

    # ---- lookup -------------------------------------------------------------------------
    def _match(self, cache_salt: str, token_ids: Sequence[int]) -> list[_Node]:
        """The usable cached path: whole aligned pages, always leaving the last token (its
        logits give the first generated token) to be computed."""
        root = self._roots.get(cache_salt) if cache_salt else None  # guard: prefix-salt
        if root is None:
            return []
        size, align = self.page_tokens, self.align_tokens
        limit = max(len(token_ids) - 1, 0) // align * align
        path, node = [], root
        for start in range(0, limit, size):
            child = node.children.get(tuple(token_ids[start:start + size]))
            if child is None:
                break
            path.append(child)
            node = child
        return path[:len(path) * size // align * align // size]

    def cached_tokens(self, cache_salt: str, token_ids: Sequence[int]) -> int:
        """How many leading tokens an allocation for this prompt would reuse (no effects)."""
        return len(self._match(cache_salt, token_ids)) * self.page_tokens

    def allocate(self, request_id: str, cache_salt: str, token_ids: Sequence[int],
                 num_tokens: int = 0) -> Lease:
        """Lease pages for the prompt (or `num_tokens`): the longest usable cached prefix of
        this salt, pinned, then fresh pages. `lease.cached_tokens` says how many tokens the
        caller need not compute. Raises PoolExhaustedError and leaves nothing pinned."""
        path = self._match(cache_salt, token_ids)
        lease = self.pool.allocate(request_id, num_tokens or len(token_ids),
                                   [node.page_id for node in path])
        self.stats.queries += 1
        if path:
            self.stats.hit_queries += 1
            self.stats.hit_tokens += lease.cached_tokens
            for node in path:
                self._policy.touch(node.chain_hash)
        return lease

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, cache_salt: str, token_ids: Sequence[int], lease: Lease) -> int:
        """Cache the whole aligned pages of the prompt `token_ids` that `lease` has written,
        under `cache_salt`; returns how many pages were newly cached. The lease keeps them
        pinned until it is released; after that they are evictable."""
        if not cache_salt:
            return 0
        size, align = self.page_tokens, self.align_tokens
        limit = min(len(token_ids), self.pool.written_prefix(lease)) // align * align
        if limit == 0:
            return 0
        node = self._roots.get(cache_salt)
        if node is None:
            node = self._roots[cache_salt] = _Node(-1, None, root_hash(cache_salt), 0,
                                                       salt=cache_salt)
        added: list[int] = []
        for index in range(limit // size):
            key = tuple(token_ids[index * size:(index + 1) * size])
            child = node.children.get(key)
            if child is None:
                chain_hash = page_hash(node.chain_hash, key)
                if chain_hash in self._nodes:
                    break  # a 63-bit hash collision: leave it uncached, keep keys unique
                page_id = self.pool.share(lease, index)
                child = _Node(page_id, node, chain_hash, node.depth + 1, key=key)
                node.children[key] = child
                self._nodes[chain_hash] = child
                added.append(chain_hash)
            elif child.page_id != lease.page_ids[index]:
                break  # cached meanwhile by another request: keep this lease's pins a path
            node = child
        # Deepest first: the FIFOs then reach a new chain at its leaf and evict it leaf
        # first without skipping its parents. No touch: `allocate` counted the hits.
        for chain_hash in reversed(added):
            self._policy.insert(chain_hash)
        if node.parent is None and not node.children:
            del self._roots[cache_salt]
        self.stats.inserted_pages += len(added)
        return len(added)

    # ---- eviction -----------------------------------------------------------------------
    def _reclaim(self, num_pages: int) -> int:
        """Evict up to `num_pages` unpinned leaves, in the policy's order."""
        freed = 0
        while freed < num_pages:
            chain_hash = self._policy.pop_victim(self._evictable)
            if chain_hash is None:
                break
            self._evict(self._nodes.pop(chain_hash))
            freed += 1
        if freed and self.on_evict is not None:
            self.on_evict(freed)
        return freed

    def _evictable(self, chain_hash: int) -> bool:
        """Not pinned (no reader holds it) and not the parent of a cached page."""
        node = self._nodes[chain_hash]
        return not node.children and self.pool.page_refs(node.page_id) == 0

    def _evict(self, node: _Node) -> None:
        self.pool.evict(node.page_id)  # refuses a pinned page
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.parent is None and not parent.children:
            del self._roots[parent.salt]
        self.stats.evicted_pages += 1

    def clear(self) -> int:
        """Evict every unpinned page; returns how many."""
        return self._reclaim(len(self._nodes))

    def purge(self, cache_salt: str) -> int:
        """Evict every unpinned page of one salt (`pdmesh cache purge`), leaves first;
        returns how many. Pages a live lease pins stay until a later purge or eviction."""
        root = self._roots.get(cache_salt) if cache_salt else None
        if root is None:
            return 0
        order: list[_Node] = []  # parents before children: evicted in reverse
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        freed = 0
        for node in reversed(order):
            if self._evictable(node.chain_hash):
                self._policy.remove(node.chain_hash)
                self._evict(self._nodes.pop(node.chain_hash))
                freed += 1
        return freed

    # ---- routing summary and integrity --------------------------------------------------
    def summary(self, limit: int) -> list[int]:
        """Chain hashes of up to `limit` cached aligned prefixes, most valuable first: pages
        with more recent hits first, ties in the reverse of the policy's eviction order (the
        page it would keep longest first), each prefix preceded by its shorter aligned
        prefixes (every hit on a prefix is a hit on those). O(cached pages)."""
        out: list[int] = []
        if limit <= 0:
            return out
        pages_per_align = self.align_tokens // self.page_tokens
        listed: set[int] = set()
        ranked = sorted(reversed(list(self._policy.order())), key=self._policy.frequency,
                        reverse=True)  # stable: ties keep the reversed eviction order
        for chain_hash in ranked:
            missing, node = [], self._nodes[chain_hash]
            while node.parent is not None and node.chain_hash not in listed:
                missing.append(node)
                node = node.parent
            for node in reversed(missing):  # root side first
                listed.add(node.chain_hash)
                if node.depth % pages_per_align == 0:
                    out.append(node.chain_hash)
                    if len(out) >= limit:
                        return out
        return out

    def check_integrity(self) -> None:
        """The pool's check, plus: the tree holds exactly the pool's cached pages, links are
        consistent, the policy holds exactly the tree's pages (by chain hash), pins form root
        paths."""
        self.pool.check_integrity()
        problems: list[str] = list(self._policy.problems())
        seen: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                stack.append(child)
                seen.add(child.page_id)
                if child.parent is not node or child.key != key or len(key) != self.page_tokens:
                    problems.append(f"page {child.page_id}: broken tree link")
                if child.chain_hash != page_hash(node.chain_hash, key):
                    problems.append(f"page {child.page_id}: wrong chain hash")
                if self._nodes.get(child.chain_hash) is not child:
                    problems.append(f"page {child.page_id}: not indexed by its chain hash")
                if node.parent is not None and (self.pool.page_refs(node.page_id)
                                                < self.pool.page_refs(child.page_id)):
                    problems.append(f"page {child.page_id} pinned more than its parent")
        cached = {p for p in range(self.pool.num_pages) if self.pool.is_cached(p)}
        indexed = {node.page_id for node in self._nodes.values()}
        if seen != indexed or seen != cached or len(seen) != len(self._nodes):
            problems.append(f"tree pages {len(seen)}, index {len(self._nodes)}, pool cached "
                            f"{len(cached)} differ")
        if (len(self._policy) != len(self._nodes) or self._policy.size != len(self._nodes)
                or not all(chain_hash in self._policy for chain_hash in self._nodes)):
            problems.append(f"policy holds {len(self._policy)} pages, the tree "
                            f"{len(self._nodes)}")
        if problems:
            raise PoolIntegrityError(problems)
