"""A lease: one request's hold on a list of pages, for one allocation epoch."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class Lease:
    """Pages held by one request. Created only by `KVPool.allocate`.

    `epoch` is unique pool-wide (a new value for every allocation), and every page records
    the epoch of the lease that holds it, so a stale or forged lease can never pass the
    read/write checks even if it names the right pages. `page_written[i]` is how many tokens
    of page i this lease has written (from the start of the page); the pool keeps its own
    authoritative copy and checks that one.

    `page_shared[i]` is True when page i is a prefix-cache page this lease has pinned (read
    only, never written through this lease). `cached_tokens` is how many leading tokens came
    from the cache at allocation (the prefill computes only the rest).
    """

    lease_id: str
    request_id: str
    epoch: int
    page_ids: tuple[int, ...]
    num_tokens: int
    page_tokens: int
    pool_id: str
    page_written: list[int] = field(init=False)
    cached_tokens: int = 0
    release_cause: str | None = field(init=False, default=None)
    page_shared: list[bool] = field(init=False)
    _live: bool = field(init=False, default=True, repr=False)
    # Cached index forms of page_ids, derived here so that a copy with other page_ids
    # (dataclasses.replace) cannot carry stale indices.
    page_array: np.ndarray = field(init=False, repr=False)
    page_index: torch.Tensor = field(init=False, repr=False)
    # (epoch, that epoch repeated for every page as int64 bytes): the pool's fast epoch
    # check; rebuilt whenever `epoch` is not the one it was built for.
    _epoch_bytes: tuple[int, bytes] | None = field(init=False, default=None, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        self.page_ids = tuple(int(p) for p in self.page_ids)
        self.page_written = [0] * len(self.page_ids)
        self.page_shared = [False] * len(self.page_ids)
        self.page_array = np.asarray(self.page_ids, dtype=np.int64)
        self.page_index = torch.tensor(self.page_ids, dtype=torch.long)

    @property
    def is_live(self) -> bool:
        return self._live

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)

    @property
    def capacity_tokens(self) -> int:
        """Tokens the leased pages can hold (>= num_tokens, rounded up to whole pages)."""
        return len(self.page_ids) * self.page_tokens

    @property
    def written_tokens(self) -> int:
        """Total tokens written, summed over pages."""
        return sum(self.page_written)

    def locate(self, position: int) -> tuple[int, int]:
        """(page_index, offset) of token `position` within this lease."""
        return divmod(position, self.page_tokens)
