"""Every error the KV store raises, each with the fields a caller needs to act on it."""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of all kvstore errors."""


class PoolExhaustedError(KVStoreError):
    """An allocation asked for more pages than are free. Nothing was allocated."""

    def __init__(self, requested_pages: int, free_pages: int) -> None:
        self.requested_pages = requested_pages
        self.free_pages = free_pages
        super().__init__(f"pool exhausted: requested {requested_pages} pages, {free_pages} free")


class LeaseAccessError(KVStoreError):
    """A read or write through a lease that may not touch that page (invariant I2).

    `page_id` is None when the failure is about the lease as a whole (dead lease, out of range).
    """

    def __init__(self, lease_id: str, page_id: int | None, reason: str) -> None:
        self.lease_id = lease_id
        self.page_id = page_id
        self.reason = reason
        super().__init__(f"lease {lease_id} page {page_id}: {reason}")


class PoolIntegrityError(KVStoreError):
    """The pool's bookkeeping is inconsistent: a page leaked, or is in two places."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("pool integrity violated: " + "; ".join(problems))
