"""The paged KV pool: one preallocated tensor, a LIFO free list, leases with epochs.

Layout `[num_pages, num_layers, 2 (K/V), page_tokens, num_kv_heads, head_dim]`, contiguous:
one page (all layers, K and V) is one contiguous byte range, the unit a transport moves.

Isolation (invariant I2) rests on per-page tags checked on every access: each page records
the epoch of the lease holding it (0 when free) and the number of tokens written into it in
that epoch. Epochs are unique per allocation, so "right page, wrong epoch" (a stale lease
after reuse) and "someone else's page" (a foreign or forged lease) are the same cheap
comparison. Freed pages are reused LIFO, the order in which leftovers are most dangerous.

Prefix cache: a page is in exactly one of three states. FREE (tag 0), LEASED (tag = the
holding lease's epoch; only that lease reads or writes it) or CACHED (tag CACHED_EPOCH, a
whole written page owned by the prefix cache, immutable). A lease *pins* the cached pages it
reads (`_page_refs` counts the pins) and the pool keeps, per lease, which page ids it pinned
(`_shared`); the read check accepts "tagged with this lease's epoch, or cached and pinned by
this lease at this index", nothing else, and the write check accepts only the first. Only an
unpinned cached page can be evicted back to FREE; allocation asks the cache (`reclaimer`) to
evict when free pages run short. free + leased + cached == total, checked by
`check_integrity`.

Observer: `observer`, when set (the owning service's protocol trace, off by default), is
called with `(event, fields)` after each lease, free, quarantine, cache, evict, written and
read; every event names the pool (`pool`). A decode step's batched calls report only each
lease's first step (a read of its prompt), never the tokens they append.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdmesh.kvstore.errors import LeaseAccessError, PoolExhaustedError, PoolIntegrityError
from pdmesh.kvstore.lease import Lease
from pdmesh.kvstore.scrub import ScrubPolicy, scrub_pages
from pdmesh.kvstore.spec import PoolSpec, pages_for

FREE_EPOCH = 0
CACHED_EPOCH = -1  # tag of a prefix-cache page (epochs of leases are >= 1)
QUARANTINED_EPOCH = -2  # tag of a page a late write may still reach: never leased again
NOT_SHARED = -1


@dataclass
class PoolStats:
    allocations: int = 0
    releases: int = 0
    exhausted: int = 0
    access_denied: int = 0
    pages_scrubbed: int = 0
    scrub_seconds: float = 0.0
    pages_cached: int = 0
    pages_evicted: int = 0


class KVPool:
    def __init__(
        self, spec: PoolSpec, scrub: ScrubPolicy | str = ScrubPolicy.NONE, device: str = "cpu"
    ) -> None:
        self.spec = spec
        self.scrub = ScrubPolicy.parse(scrub)
        self.device = torch.device(device)
        self.pool_id = uuid.uuid4().hex
        self.tensor = torch.zeros(spec.tensor_shape, dtype=spec.dtype, device=self.device)
        n = spec.num_pages
        # Free list as a stack: pop() takes the most recently freed page.
        self._free: list[int] = list(range(n - 1, -1, -1))
        self._quarantined: set[int] = set()
        self._page_epoch = np.zeros(n, dtype=np.int64)
        self._page_written = np.zeros(n, dtype=np.int64)
        self._page_generation = np.zeros(n, dtype=np.int64)
        self._page_owner: list[str | None] = [None] * n
        self._page_refs = np.zeros(n, dtype=np.int64)  # pins of a cached page by live leases
        self._cached = np.zeros(n, dtype=bool)
        self._leases: dict[str, Lease] = {}
        # Per lease: at index i the cached page id it pinned there, else NOT_SHARED. The
        # pool's own copy: a lease object naming other page ids gains nothing.
        self._shared: dict[str, np.ndarray] = {}
        self._sharing: set[str] = set()  # live leases holding a shared (cached) page
        # Called with a number of pages when an allocation finds too few free; returns how
        # many it freed (the prefix cache evicts unpinned leaves, S3-FIFO). Never frees pins.
        self.reclaimer: Callable[[int], int] | None = None
        # The protocol trace's callback (module docstring); None: nothing is reported.
        self.observer: Callable[[str, dict], None] | None = None
        self._reads_reported: set[str] = set()  # leases whose first decode step was reported
        self._prefix_written: dict[str, int] = {}
        self._next_epoch = 1
        self.stats = PoolStats()
        self._byte_pages: np.ndarray | None = None
        if self.device.type == "cpu":
            flat = self.tensor.view(-1).view(torch.uint8)
            self._byte_pages = flat.numpy().reshape(n, spec.bytes_per_page)

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.spec.num_pages

    @property
    def page_tokens(self) -> int:
        return self.spec.page_tokens

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_leased_pages(self) -> int:
        """Pages held by leases as their own (cached pages are counted apart)."""
        return (self.spec.num_pages - len(self._free) - self.num_cached_pages
                - len(self._quarantined))

    @property
    def num_cached_pages(self) -> int:
        return int(self._cached.sum())

    @property
    def num_quarantined_pages(self) -> int:
        return len(self._quarantined)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no live lease pins: the cache gives them back on demand."""
        return int((self._cached & (self._page_refs == 0)).sum())

    @property
    def available_tokens(self) -> int:
        """Tokens an allocation can get now: free pages plus evictable cached pages."""
        return (len(self._free) + self.num_evictable_pages) * self.spec.page_tokens

    @property
    def capacity_tokens(self) -> int:
        """Real capacity in tokens: what heartbeats report, not the configuration."""
        return self.spec.capacity_tokens

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.spec.page_tokens

    def live_leases(self) -> list[Lease]:
        return list(self._leases.values())

    def page_generation(self, page_id: int) -> int:
        """How many times `page_id` has been released."""
        return int(self._page_generation[page_id])

    def is_cached(self, page_id: int) -> bool:
        return bool(self._cached[page_id])

    def page_refs(self, page_id: int) -> int:
        """How many live leases pin this cached page."""
        return int(self._page_refs[page_id])

    # ---- allocate / release ---------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int,
                 shared_prefix: Sequence[int] = ()) -> Lease:
        """Lease pages for `num_tokens` tokens; all or nothing (PoolExhaustedError).

        `shared_prefix`: cached pages (whole, written) that become the lease's first pages,
        pinned and read-only; only the remaining pages are taken from the free list
        (evicting unpinned cached pages through `reclaimer` when too few are free)."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        shared = [int(p) for p in shared_prefix]
        num_pages = self.spec.pages_for(num_tokens)
        if len(shared) * self.spec.page_tokens > num_tokens:
            raise ValueError(f"{len(shared)} shared pages exceed {num_tokens} tokens")
        if len(set(shared)) != len(shared) or not all(
                0 <= p < self.spec.num_pages and self._cached[p] for p in shared):
            raise ValueError(f"shared prefix {shared} is not a list of distinct cached pages")
        # Pin first, so that a reclaim for this very allocation cannot evict them.
        for page_id in shared:
            self._page_refs[page_id] += 1
        own = num_pages - len(shared)
        if own > len(self._free) and self.reclaimer is not None:
            self.reclaimer(own - len(self._free))
        if own > len(self._free):
            for page_id in shared:
                self._page_refs[page_id] -= 1
            self.stats.exhausted += 1
            raise PoolExhaustedError(requested_pages=own, free_pages=len(self._free))
        page_ids = tuple(shared) + tuple(self._free.pop() for _ in range(own))
        epoch = self._next_epoch
        self._next_epoch += 1
        lease = Lease(
            lease_id=str(uuid.uuid4()),  # also the reservation id on the wire (UUID)
            request_id=request_id,
            epoch=epoch,
            page_ids=page_ids,
            num_tokens=num_tokens,
            page_tokens=self.spec.page_tokens,
            pool_id=self.pool_id,
            cached_tokens=len(shared) * self.spec.page_tokens,
        )
        if self.device.type != "cpu":
            lease.page_index = lease.page_index.to(self.device)
        marks = np.full(num_pages, NOT_SHARED, dtype=np.int64)
        for index, page_id in enumerate(shared):
            marks[index] = page_id
            lease.page_shared[index] = True
            lease.page_written[index] = self.spec.page_tokens
        for page_id in page_ids[len(shared):]:
            self._page_epoch[page_id] = epoch
            self._page_written[page_id] = 0
            self._page_owner[page_id] = lease.lease_id
        self._leases[lease.lease_id] = lease
        self._shared[lease.lease_id] = marks
        if shared:
            self._sharing.add(lease.lease_id)
        self._prefix_written[lease.lease_id] = lease.cached_tokens
        self.stats.allocations += 1
        if self.observer is not None:
            self.observer("lease", {"pool": self.pool_id, "lease": lease.lease_id,
                                    "req": request_id, "epoch": epoch,
                                    "pages": list(page_ids), "shared": shared,
                                    "tokens": num_tokens,
                                    "page_tokens": self.spec.page_tokens})
        return lease

    def release(self, lease: Lease, cause: str) -> None:
        """Return the lease's own pages to the pool and unpin its cached ones. Idempotent:
        releasing twice is a no-op."""
        if self._leases.get(lease.lease_id) is not lease:
            return  # already released, or not a lease this pool handed out
        del self._leases[lease.lease_id]
        del self._prefix_written[lease.lease_id]
        marks = self._shared.pop(lease.lease_id)
        self._sharing.discard(lease.lease_id)
        lease._live = False
        lease.release_cause = cause
        owned = []
        for page_id, mark in zip(lease.page_ids, marks.tolist(), strict=True):
            if mark == page_id:
                assert self._cached[page_id] and self._page_refs[page_id] > 0, page_id
                self._page_refs[page_id] -= 1  # stays cached; the cache may evict it now
                continue
            assert self._page_epoch[page_id] == lease.epoch, (page_id, lease.lease_id)
            owned.append(page_id)
        self._free_pages(owned)
        self.stats.releases += 1
        if self.observer is not None:
            self._reads_reported.discard(lease.lease_id)
            self.observer("free", {"pool": self.pool_id, "lease": lease.lease_id,
                                   "epoch": lease.epoch, "pages": owned, "cause": cause})

    def quarantine(self, lease: Lease, cause: str) -> None:
        """End the lease like `release`, except that its own pages never go back to the
        free list: a write into them may still land (the transport could not establish that
        an in-flight receive or a peer's one-sided write has ended). They stay out of
        service, counted, for the life of the pool. Idempotent."""
        if self._leases.get(lease.lease_id) is not lease:
            return
        del self._leases[lease.lease_id]
        del self._prefix_written[lease.lease_id]
        marks = self._shared.pop(lease.lease_id)
        self._sharing.discard(lease.lease_id)
        lease._live = False
        lease.release_cause = f"quarantined: {cause}"
        owned = []
        for page_id, mark in zip(lease.page_ids, marks.tolist(), strict=True):
            if mark == page_id:
                self._page_refs[page_id] -= 1  # a cached page is only read: it stays cached
                continue
            owned.append(page_id)
            self._page_epoch[page_id] = QUARANTINED_EPOCH
            self._page_owner[page_id] = None
            self._page_written[page_id] = 0
            self._page_generation[page_id] += 1
            self._quarantined.add(page_id)
        self.stats.releases += 1
        if self.observer is not None:
            self._reads_reported.discard(lease.lease_id)
            self.observer("quarantine", {"pool": self.pool_id, "lease": lease.lease_id,
                                         "epoch": lease.epoch, "pages": owned, "cause": cause})

    def _free_pages(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            self._page_epoch[page_id] = FREE_EPOCH
            self._page_written[page_id] = 0
            self._page_owner[page_id] = None
            self._page_generation[page_id] += 1
        # Reversed, so the next allocation of this size gets exactly these pages in order.
        self._free.extend(reversed(page_ids))
        if self.scrub is not ScrubPolicy.NONE and page_ids:
            started = time.perf_counter()
            index = torch.tensor(page_ids, dtype=torch.long, device=self.device)
            scrub_pages(self.tensor, index, self.scrub)
            self.stats.scrub_seconds += time.perf_counter() - started
            self.stats.pages_scrubbed += len(page_ids)

    # ---- prefix cache pages -------------------------------------------------------------
    def share(self, lease: Lease, page_index: int) -> int:
        """Hand page `page_index` of `lease` (its own, fully written) to the prefix cache:
        it becomes CACHED, immutable, and stays pinned by this lease until its release.
        Returns the page id. Only the prefix cache calls this."""
        self._check_lease(lease)
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        page_id = lease.page_ids[page_index]
        if self._page_epoch[page_id] != lease.epoch:
            raise self._deny(lease, page_id, "only a page this lease owns can be cached")
        if self._page_written[page_id] != self.spec.page_tokens:
            raise self._deny(lease, page_id, "only a fully written page can be cached")
        self._page_epoch[page_id] = CACHED_EPOCH
        self._page_owner[page_id] = None
        self._cached[page_id] = True
        self._page_refs[page_id] = 1
        self._shared[lease.lease_id][page_index] = page_id
        self._sharing.add(lease.lease_id)
        lease.page_shared[page_index] = True
        self.stats.pages_cached += 1
        if self.observer is not None:
            self.observer("cache", {"pool": self.pool_id, "lease": lease.lease_id,
                                    "epoch": lease.epoch, "page": page_id})
        return page_id

    def evict(self, page_id: int) -> None:
        """Free an unpinned cached page (the prefix cache's eviction). A pinned page can
        never be evicted: that would let its reader see the next holder's KV."""
        if not self._cached[page_id]:
            raise ValueError(f"page {page_id} is not a cached page")
        if self._page_refs[page_id] != 0:
            raise ValueError(f"page {page_id} is pinned by {self._page_refs[page_id]} leases")
        self._cached[page_id] = False
        self._free_pages([page_id])
        self.stats.pages_evicted += 1
        if self.observer is not None:
            self.observer("evict", {"pool": self.pool_id, "page": int(page_id)})

    # ---- checked access (I2) ----------------------------------------------------------
    def _deny(self, lease: Lease, page_id: int | None, reason: str) -> LeaseAccessError:
        self.stats.access_denied += 1
        return LeaseAccessError(lease.lease_id, page_id, reason)

    def _check_lease(self, lease: Lease) -> None:
        if lease.pool_id != self.pool_id:
            raise self._deny(lease, None, "lease belongs to another pool")
        if not lease._live:
            raise self._deny(lease, None, f"lease is released ({lease.release_cause})")

    def _check_pages(self, lease: Lease, first: int, last: int, shared_ok: bool) -> None:
        """Every page in the lease's [first, last) carries the lease's epoch, or (only when
        `shared_ok`, i.e. for reads) is a cached page this lease pinned at that index."""
        pages = lease.page_array[first:last]
        if not pages.size:
            return
        epochs = self._page_epoch[pages]
        if self._all_of_epoch(lease, epochs):
            return
        ok = epochs == lease.epoch  # guard: lease-read-check
        if ok.all():
            return
        marks = self._shared.get(lease.lease_id)
        if shared_ok and marks is not None and len(marks) == len(lease.page_array):
            ok |= (epochs == CACHED_EPOCH) & (marks[first:last] == pages)
            if ok.all():
                return
        for page_id, page_ok in zip(pages.tolist(), ok.tolist(), strict=True):
            if page_ok:
                continue
            page_epoch = int(self._page_epoch[page_id])
            if page_epoch == FREE_EPOCH:
                reason = f"page is free (stale epoch {lease.epoch})"
            elif page_epoch == CACHED_EPOCH:
                reason = ("cached page not pinned by this lease" if shared_ok
                          else "cached page is read-only")
            elif page_epoch > lease.epoch:
                reason = f"stale epoch {lease.epoch}: page now held at epoch {page_epoch}"
            else:
                reason = f"page held by another lease (epoch {page_epoch})"
            raise self._deny(lease, page_id, reason)

    @staticmethod
    def _all_of_epoch(lease: Lease, epochs: np.ndarray) -> bool:
        """Whether every entry of `epochs` is the lease's epoch, as one byte comparison
        with the epoch repeated (~0.3 us for a 512-token lease's pages, against ~1.7 us
        for numpy's compare-and-all: it runs for every request of every decode step)."""
        if epochs.dtype != np.int64:
            return bool((epochs == lease.epoch).all())
        return (epochs.tobytes()  # guard: lease-read-check-fast
                == KVPool._epoch_pattern(lease, len(epochs))[:epochs.nbytes])

    @staticmethod
    def _epoch_pattern(lease: Lease, count: int = 0) -> bytes:
        """The lease's epoch repeated for each of its pages (at least `count`), as int64
        bytes: what the pool's epochs of its own pages must read. Cached on the lease and
        rebuilt whenever the lease's epoch is not the one it was built for."""
        cached = lease._epoch_bytes
        if cached is None or cached[0] != lease.epoch or len(cached[1]) < 8 * count:
            count = max(lease.num_pages, count)
            cached = (lease.epoch, np.full(count, lease.epoch, dtype=np.int64).tobytes())
            lease._epoch_bytes = cached
        return cached[1]

    def check_readable(self, lease: Lease, num_tokens: int) -> None:
        """Raise LeaseAccessError unless `lease` may read its first `num_tokens` tokens:
        the lease is live, every page holding them carries its epoch, and this lease has
        written all of them in this epoch. Called before every attention read; O(1) Python
        plus one vectorized compare, so it stays far below 1% of a decode step."""
        # Fast path (every request of every decode step): a live lease of this pool whose
        # pages all carry its epoch, compared as bytes against its epoch repeated, with
        # all the tokens written. Anything else takes the checks below, which name the
        # reason.
        cached = lease._epoch_bytes
        if lease.pool_id == self.pool_id and lease._live and cached is not None \
                and cached[0] == lease.epoch:
            count = -(-num_tokens // lease.page_tokens)
            epochs = self._page_epoch[lease.page_array[:count]]
            if (epochs.tobytes() == cached[1][:8 * count]  # guard: lease-read-check-inline
                    and num_tokens <= self._prefix_written.get(
                        lease.lease_id, 0)):  # guard: lease-read-check-inline-written
                if self.observer is not None:
                    self._observe_read(lease, num_tokens)
                return
        self._check_lease(lease)
        self._check_pages(lease, 0, pages_for(num_tokens, lease.page_tokens), shared_ok=True)
        written = self._prefix_written.get(lease.lease_id, 0)
        if num_tokens > written:
            page_index = min(written // lease.page_tokens, lease.num_pages - 1)
            raise self._deny(
                lease,
                lease.page_ids[page_index],
                f"read of {num_tokens} tokens but only {written} written in this epoch",
            )
        if self.observer is not None:
            self._observe_read(lease, num_tokens)

    def _observe_read(self, lease: Lease, num_tokens: int) -> None:
        assert self.observer is not None
        self.observer("read", {"pool": self.pool_id, "lease": lease.lease_id,
                               "epoch": lease.epoch, "tokens": num_tokens})

    def check_writable(self, lease: Lease, start: int, num_tokens: int) -> None:
        """Raise LeaseAccessError unless `lease` may write tokens [start, start+num_tokens)."""
        self._check_lease(lease)
        end = start + num_tokens
        if start < 0 or num_tokens < 0 or end > lease.capacity_tokens:
            raise self._deny(
                lease, None, f"write [{start}, {end}) outside capacity {lease.capacity_tokens}"
            )
        first, last = start // lease.page_tokens, pages_for(end, lease.page_tokens)
        if last - first == 1:  # a decode step's one token: a scalar compare (~0.3 us, not ~2)
            if self._page_epoch[lease.page_array[first]] != lease.epoch:  # guard: lease-write-check
                self._check_pages(lease, first, last, shared_ok=False)
            return
        pages = lease.page_array[first:last]
        if pages.size and not (self._page_epoch[pages] == lease.epoch).all():
            self._check_pages(lease, first, last, shared_ok=False)

    def check_decode_batch(self, leases: Sequence[Lease], positions: Sequence[int]) -> None:
        """A decode step's checks for all its requests at once: each lease may append one
        token at `position`, which must be its written length, and read the `position`
        tokens before it (check_writable + check_readable + the append rule, per lease).
        Raises the LeaseAccessError the first failing lease's own checks raise.

        Fast path: every lease is live, of this pool, appends at its written length inside
        its capacity, and its pages [0, position // page_tokens] carry its epoch. The
        epochs of all those pages, all leases together, are gathered in one index and
        compared as bytes with each lease's epoch repeated (one numpy call for the batch
        instead of two per lease). Anything else (a lease holding shared prefix pages, or
        any failure) takes the per-lease checks, which name the reason."""
        pool_id, written, size = self.pool_id, self._prefix_written, self.spec.page_tokens
        sharing = self._sharing
        indices, expected, slow = [], [], []
        for lease, position in zip(leases, positions, strict=True):
            if (lease.pool_id == pool_id and lease._live and lease.page_tokens == size
                    and written.get(lease.lease_id, -1) == position  # guard: decode-batch-written
                    and 0 <= position < len(lease.page_ids) * size  # guard: decode-batch-capacity
                    and lease.lease_id not in sharing):
                count = position // size + 1
                cached = lease._epoch_bytes  # _epoch_pattern's cache, read inline (hot)
                pattern = (cached[1] if cached is not None and cached[0] == lease.epoch
                           else self._epoch_pattern(lease))
                indices.append(lease.page_array[:count])
                expected.append(pattern[:8 * count])
            else:
                slow.append((lease, position))
        if len(indices) == 1:
            batch_failed = (  # guard: decode-batch-epochs
                self._page_epoch[indices[0]].tobytes() != expected[0])
        else:
            batch_failed = bool(indices) and (  # guard: decode-batch-epochs.concat
                self._page_epoch[np.concatenate(indices)].tobytes() != b"".join(expected))
        if batch_failed:
            slow = list(zip(leases, positions, strict=True))  # find and name the culprit
        for lease, position in slow:
            self.check_writable(lease, position, 1)
            if position != self.written_prefix(lease):
                raise self._deny(lease, None, f"append at position {position} but the lease "
                                 f"has {self.written_prefix(lease)} tokens written")
            self.check_readable(lease, position)
        if batch_failed:
            # Every lease's own checks passed where the batched compare failed: the pool
            # changed underneath. Refuse rather than guess.
            raise self._deny(leases[0], None, "decode batch epoch check failed")
        if self.observer is not None:  # a lease's first decode step reads its prompt
            for lease, position in zip(leases, positions, strict=True):
                if lease.lease_id not in self._reads_reported:
                    self._reads_reported.add(lease.lease_id)
                    self._observe_read(lease, position)

    def mark_decode_batch(self, leases: Sequence[Lease], positions: Sequence[int]) -> None:
        """After a decode step: each lease wrote one token at `position`. The same as
        `mark_written(lease, position // page_tokens, position % page_tokens + 1)` per
        lease, with its checks (live lease of this pool, the page carries its epoch); the
        common case (appending at the written length, inside the page) is done inline."""
        pool_id, size, epochs = self.pool_id, self.spec.page_tokens, self._page_epoch
        written, page_written = self._prefix_written, self._page_written
        for lease, position in zip(leases, positions, strict=True):
            page_index, offset = divmod(position, size)
            if (lease.pool_id == pool_id and lease._live and lease.page_tokens == size
                    and written.get(lease.lease_id) == position
                    and 0 <= page_index < len(lease.page_ids) and offset + 1 < size):
                page_id = lease.page_ids[page_index]
                if (epochs[page_id] == lease.epoch  # guard: decode-mark-epoch
                        and page_written[page_id] == offset):
                    page_written[page_id] = offset + 1
                    lease.page_written[page_index] = offset + 1
                    written[lease.lease_id] = position + 1
                    continue
            self._mark_written(lease, page_index, offset + 1)

    def mark_written(self, lease: Lease, page_index: int, num_tokens: int) -> None:
        """Record that page `page_index` of `lease` now holds `num_tokens` valid tokens
        (counted from the start of the page; counts never go down)."""
        page_id, count = self._mark_written(lease, page_index, num_tokens)
        if self.observer is not None:
            self.observer("written", {"pool": self.pool_id, "lease": lease.lease_id,
                                      "epoch": lease.epoch, "page": page_id, "tokens": count})

    def _mark_written(self, lease: Lease, page_index: int, num_tokens: int) -> tuple[int, int]:
        """mark_written without the observer (a decode step's tokens are not reported);
        the page id and its written count."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        if not 0 <= num_tokens <= lease.page_tokens:
            raise self._deny(lease, lease.page_ids[page_index], f"bad count {num_tokens}")
        self.check_writable(lease, page_index * lease.page_tokens, num_tokens)
        page_id = lease.page_ids[page_index]
        count = max(int(self._page_written[page_id]), num_tokens)
        self._page_written[page_id] = count
        lease.page_written[page_index] = count
        # Advance the contiguous written prefix (coverage must have no holes).
        prefix = self._prefix_written[lease.lease_id]
        index, size = prefix // lease.page_tokens, lease.page_tokens
        while index < lease.num_pages:
            filled = int(self._page_written[lease.page_ids[index]])
            prefix = index * size + filled
            if filled < size:
                break
            index += 1
        self._prefix_written[lease.lease_id] = prefix
        return page_id, count

    def mark_written_range(self, lease: Lease, start: int, num_tokens: int) -> None:
        """mark_written for every page touched by tokens [start, start+num_tokens)."""
        end, size = start + num_tokens, lease.page_tokens
        for page_index in range(start // size, pages_for(end, size)):
            self.mark_written(lease, page_index, min(size, end - page_index * size))

    def written_prefix(self, lease: Lease) -> int:
        """Tokens written contiguously from position 0 in this epoch (0 if not live)."""
        return self._prefix_written.get(lease.lease_id, 0) if lease._live else 0

    def page_buffer(self, lease: Lease, page_index: int) -> memoryview:
        """Writable raw bytes of one page of a live lease (for transports; CPU pools)."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self.check_writable(lease, page_index * lease.page_tokens, lease.page_tokens)
        if self._byte_pages is None:
            raise NotImplementedError("page_buffer needs a CPU pool; use page_tensor")
        return memoryview(self._byte_pages[lease.page_ids[page_index]])

    def page_view(self, lease: Lease, page_index: int) -> memoryview:
        """Read-only raw bytes of one page the lease may read: its own page holding at
        least one written token, or a cached page it pinned (what a sender transmits)."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self.check_readable(lease, min(page_index * lease.page_tokens + 1, lease.num_tokens))
        if self._byte_pages is None:
            raise NotImplementedError("page_view needs a CPU pool; use page_tensor")
        return memoryview(self._byte_pages[lease.page_ids[page_index]]).toreadonly()

    def streaming_view(self, lease: Lease, page_index: int) -> memoryview:
        """Read-only raw bytes of one page of a live lease whose tokens may not be written
        yet: a streamed send holds these from the start and reads a page only once the
        caller's `check_readable` passed for it (prefill does so before `PagesReady`
        releases the page to the transport)."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self._check_lease(lease)
        self._check_pages(lease, page_index, page_index + 1, shared_ok=True)
        if self._byte_pages is None:
            raise NotImplementedError("streaming_view needs a CPU pool; use page_tensor")
        return memoryview(self._byte_pages[lease.page_ids[page_index]]).toreadonly()

    def page_tensor(self, lease: Lease, page_index: int) -> torch.Tensor:
        """Writable tensor view [num_layers, 2, page_tokens, kv_heads, head_dim] of one page."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self.check_writable(lease, page_index * lease.page_tokens, lease.page_tokens)
        return self.tensor[lease.page_ids[page_index]]

    # ---- integrity --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless free + leased + cached == total, no page is in two
        places, every tag matches its state and every pin count matches the live leases."""
        problems: list[str] = []
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            problems.append("a page is on the free list twice")
        cached = set(np.flatnonzero(self._cached).tolist())
        pins = np.zeros(self.spec.num_pages, dtype=np.int64)
        leased: dict[int, str] = {}
        for lease in self._leases.values():
            if not lease._live:
                problems.append(f"dead lease {lease.lease_id} still registered")
            marks = self._shared.get(lease.lease_id)
            if marks is None or len(marks) != lease.num_pages:
                problems.append(f"lease {lease.lease_id} has no shared-page record")
                continue
            for page_id, mark in zip(lease.page_ids, marks.tolist(), strict=True):
                if mark == page_id:
                    pins[page_id] += 1
                    if page_id not in cached:
                        problems.append(f"page {page_id} pinned but not cached")
                    continue
                if mark != NOT_SHARED:
                    problems.append(f"lease {lease.lease_id} pinned page {mark} at {page_id}")
                if page_id in leased:
                    problems.append(f"page {page_id} held by two leases")
                leased[page_id] = lease.lease_id
                if page_id in free_set:
                    problems.append(f"page {page_id} both free and leased")
                if page_id in cached:
                    problems.append(f"page {page_id} both cached and leased")
                if self._page_epoch[page_id] != lease.epoch:
                    problems.append(f"page {page_id} epoch tag does not match its lease")
        if not (pins == self._page_refs).all():
            problems.append("pin counts do not match the live leases")
        if cached & free_set:
            problems.append(f"pages {sorted(cached & free_set)} both free and cached")
        quarantined = self._quarantined
        if quarantined & (free_set | cached | set(leased)):
            problems.append("a quarantined page is also free, cached or leased")
        total = len(free_set) + len(leased) + len(cached) + len(quarantined)
        if total != self.spec.num_pages:
            problems.append(f"free {len(free_set)} + leased {len(leased)} + cached "
                            f"{len(cached)} + quarantined {len(quarantined)} != total "
                            f"{self.spec.num_pages}")
        for page_id in quarantined:
            if self._page_epoch[page_id] != QUARANTINED_EPOCH:
                problems.append(f"quarantined page {page_id} mistagged")
        for page_id in free_set:
            if self._page_epoch[page_id] != FREE_EPOCH or self._page_owner[page_id] is not None:
                problems.append(f"free page {page_id} still tagged")
        for page_id in cached:
            if (self._page_epoch[page_id] != CACHED_EPOCH
                    or self._page_written[page_id] != self.spec.page_tokens):
                problems.append(f"cached page {page_id} mistagged or not fully written")
        if problems:
            raise PoolIntegrityError(problems)
