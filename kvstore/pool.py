"""The paged KV pool: one preallocated tensor, a LIFO free list, leases with epochs.

Layout `[num_pages, num_layers, 2 (K/V), page_size, num_kv_heads, head_dim]`, contiguous:
one page (all layers, K and V) is one contiguous byte range, the unit a transport moves.

Isolation (invariant I2) rests on per-page tags checked on every access: each page records
the epoch of the lease holding it (0 when free) and the number of tokens written into it in
that epoch. Epochs are unique per allocation, so "right page, wrong epoch" (a stale lease
after reuse) and "someone else's page" (a foreign or forged lease) are the same cheap
comparison. Freed pages are reused LIFO, the order in which leftovers are most dangerous.

Prefix cache (later): shared read-only pages will need a refcount next to `_page_epoch`;
the check then accepts "owned by this epoch, or shared and readable by this lease".
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import LeaseAccessError, PoolExhaustedError, PoolIntegrityError
from kvstore.lease import Lease
from kvstore.scrub import ScrubPolicy, scrub_pages
from kvstore.spec import PoolSpec

FREE_EPOCH = 0


@dataclass
class PoolStats:
    allocations: int = 0
    releases: int = 0
    exhausted: int = 0
    access_denied: int = 0
    pages_scrubbed: int = 0
    scrub_seconds: float = 0.0


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
        self._page_epoch = np.zeros(n, dtype=np.int64)
        self._page_written = np.zeros(n, dtype=np.int64)
        self._page_generation = np.zeros(n, dtype=np.int64)
        self._page_owner: list[str | None] = [None] * n
        self._leases: dict[str, Lease] = {}
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
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_leased_pages(self) -> int:
        return self.spec.num_pages - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        """Real capacity in tokens: what heartbeats report, not the configuration."""
        return self.spec.capacity_tokens

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.spec.page_size

    def live_leases(self) -> list[Lease]:
        return list(self._leases.values())

    def page_generation(self, page_id: int) -> int:
        """How many times `page_id` has been released."""
        return int(self._page_generation[page_id])

    # ---- allocate / release ---------------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> Lease:
        """Lease pages for `num_tokens` tokens; all or nothing (PoolExhaustedError)."""
        if num_tokens <= 0:
            raise ValueError(f"num_tokens must be positive, got {num_tokens}")
        num_pages = self.spec.pages_for(num_tokens)
        if num_pages > len(self._free):
            self.stats.exhausted += 1
            raise PoolExhaustedError(requested_pages=num_pages, free_pages=len(self._free))
        page_ids = tuple(self._free.pop() for _ in range(num_pages))
        epoch = self._next_epoch
        self._next_epoch += 1
        lease = Lease(
            lease_id=uuid.uuid4().hex,
            request_id=request_id,
            epoch=epoch,
            page_ids=page_ids,
            num_tokens=num_tokens,
            page_size=self.spec.page_size,
            pool_id=self.pool_id,
        )
        if self.device.type != "cpu":
            lease.page_index = lease.page_index.to(self.device)
        for page_id in page_ids:
            self._page_epoch[page_id] = epoch
            self._page_written[page_id] = 0
            self._page_owner[page_id] = lease.lease_id
        self._leases[lease.lease_id] = lease
        self._prefix_written[lease.lease_id] = 0
        self.stats.allocations += 1
        return lease

    def release(self, lease: Lease, cause: str) -> None:
        """Return the lease's pages to the pool. Idempotent: releasing twice is a no-op."""
        if self._leases.get(lease.lease_id) is not lease:
            return  # already released, or not a lease this pool handed out
        del self._leases[lease.lease_id]
        del self._prefix_written[lease.lease_id]
        lease._live = False
        lease.release_cause = cause
        for page_id in lease.page_ids:
            assert self._page_epoch[page_id] == lease.epoch, (page_id, lease.lease_id)
            self._page_epoch[page_id] = FREE_EPOCH
            self._page_written[page_id] = 0
            self._page_owner[page_id] = None
            self._page_generation[page_id] += 1
        # Reversed, so the next allocation of this size gets exactly these pages in order.
        self._free.extend(reversed(lease.page_ids))
        if self.scrub is not ScrubPolicy.NONE:
            started = time.perf_counter()
            scrub_pages(self.tensor, lease.page_index, self.scrub)
            self.stats.scrub_seconds += time.perf_counter() - started
            self.stats.pages_scrubbed += lease.num_pages
        self.stats.releases += 1

    # ---- checked access (I2) ----------------------------------------------------------
    def _deny(self, lease: Lease, page_id: int | None, reason: str) -> LeaseAccessError:
        self.stats.access_denied += 1
        return LeaseAccessError(lease.lease_id, page_id, reason)

    def _check_lease(self, lease: Lease) -> None:
        if lease.pool_id != self.pool_id:
            raise self._deny(lease, None, "lease belongs to another pool")
        if not lease._live:
            raise self._deny(lease, None, f"lease is released ({lease.release_cause})")

    def _check_pages(self, lease: Lease, num_pages: int) -> None:
        """Every one of the lease's first `num_pages` pages carries the lease's epoch."""
        pages = lease.page_array[:num_pages]
        if pages.size and not (self._page_epoch[pages] == lease.epoch).all():
            for page_id in pages.tolist():
                page_epoch = int(self._page_epoch[page_id])
                if page_epoch == lease.epoch:
                    continue
                if page_epoch == FREE_EPOCH:
                    reason = f"page is free (stale epoch {lease.epoch})"
                elif page_epoch > lease.epoch:
                    reason = f"stale epoch {lease.epoch}: page now held at epoch {page_epoch}"
                else:
                    reason = f"page held by another lease (epoch {page_epoch})"
                raise self._deny(lease, page_id, reason)

    def check_readable(self, lease: Lease, num_tokens: int) -> None:
        """Raise LeaseAccessError unless `lease` may read its first `num_tokens` tokens:
        the lease is live, every page holding them carries its epoch, and this lease has
        written all of them in this epoch. Called before every attention read; O(1) Python
        plus one vectorized compare, so it stays far below 1% of a decode step."""
        self._check_lease(lease)
        self._check_pages(lease, -(-num_tokens // lease.page_size))
        written = self._prefix_written.get(lease.lease_id, 0)
        if num_tokens > written:
            page_index = min(written // lease.page_size, lease.num_pages - 1)
            raise self._deny(
                lease,
                lease.page_ids[page_index],
                f"read of {num_tokens} tokens but only {written} written in this epoch",
            )

    def check_writable(self, lease: Lease, start: int, num_tokens: int) -> None:
        """Raise LeaseAccessError unless `lease` may write tokens [start, start+num_tokens)."""
        self._check_lease(lease)
        end = start + num_tokens
        if start < 0 or num_tokens < 0 or end > lease.capacity_tokens:
            raise self._deny(
                lease, None, f"write [{start}, {end}) outside capacity {lease.capacity_tokens}"
            )
        first, last = start // lease.page_size, -(-end // lease.page_size)
        pages = lease.page_array[first:last]
        if pages.size and not (self._page_epoch[pages] == lease.epoch).all():
            self._check_pages(lease, last)

    def mark_written(self, lease: Lease, page_index: int, num_tokens: int) -> None:
        """Record that page `page_index` of `lease` now holds `num_tokens` valid tokens
        (counted from the start of the page; counts never go down)."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        if not 0 <= num_tokens <= lease.page_size:
            raise self._deny(lease, lease.page_ids[page_index], f"bad count {num_tokens}")
        self.check_writable(lease, page_index * lease.page_size, num_tokens)
        page_id = lease.page_ids[page_index]
        count = max(int(self._page_written[page_id]), num_tokens)
        self._page_written[page_id] = count
        lease.page_written[page_index] = count
        # Advance the contiguous written prefix (coverage must have no holes).
        prefix = self._prefix_written[lease.lease_id]
        index, size = prefix // lease.page_size, lease.page_size
        while index < lease.num_pages:
            filled = int(self._page_written[lease.page_ids[index]])
            prefix = index * size + filled
            if filled < size:
                break
            index += 1
        self._prefix_written[lease.lease_id] = prefix

    def mark_written_range(self, lease: Lease, start: int, num_tokens: int) -> None:
        """mark_written for every page touched by tokens [start, start+num_tokens)."""
        end, size = start + num_tokens, lease.page_size
        for page_index in range(start // size, -(-end // size)):
            self.mark_written(lease, page_index, min(size, end - page_index * size))

    def written_prefix(self, lease: Lease) -> int:
        """Tokens written contiguously from position 0 in this epoch (0 if not live)."""
        return self._prefix_written.get(lease.lease_id, 0) if lease._live else 0

    def page_buffer(self, lease: Lease, page_index: int) -> memoryview:
        """Writable raw bytes of one page of a live lease (for transports; CPU pools)."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self.check_writable(lease, page_index * lease.page_size, lease.page_size)
        if self._byte_pages is None:
            raise NotImplementedError("page_buffer needs a CPU pool; use page_tensor")
        return memoryview(self._byte_pages[lease.page_ids[page_index]])

    def page_tensor(self, lease: Lease, page_index: int) -> torch.Tensor:
        """Writable tensor view [num_layers, 2, page_size, kv_heads, head_dim] of one page."""
        if not 0 <= page_index < lease.num_pages:
            raise self._deny(lease, None, f"page index {page_index} out of range")
        self.check_writable(lease, page_index * lease.page_size, lease.page_size)
        return self.tensor[lease.page_ids[page_index]]

    # ---- integrity --------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise PoolIntegrityError unless free + leased == total, no page in two places."""
        problems: list[str] = []
        free = self._free
        free_set = set(free)
        if len(free_set) != len(free):
            problems.append("a page is on the free list twice")
        leased: dict[int, str] = {}
        for lease in self._leases.values():
            if not lease._live:
                problems.append(f"dead lease {lease.lease_id} still registered")
            for page_id in lease.page_ids:
                if page_id in leased:
                    problems.append(f"page {page_id} held by two leases")
                leased[page_id] = lease.lease_id
                if page_id in free_set:
                    problems.append(f"page {page_id} both free and leased")
                if self._page_epoch[page_id] != lease.epoch:
                    problems.append(f"page {page_id} epoch tag does not match its lease")
        if len(free_set) + len(leased) != self.spec.num_pages:
            problems.append(
                f"free {len(free_set)} + leased {len(leased)} != total {self.spec.num_pages}"
            )
        for page_id in free_set:
            if self._page_epoch[page_id] != FREE_EPOCH or self._page_owner[page_id] is not None:
                problems.append(f"free page {page_id} still tagged")
        if problems:
            raise PoolIntegrityError(problems)
