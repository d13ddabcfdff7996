"""Paged KV pool with leases, epochs, scrub policies and an integrity check."""

from kvstore.errors import KVStoreError, LeaseAccessError, PoolExhaustedError, PoolIntegrityError
from kvstore.lease import Lease
from kvstore.pool import KVPool, PoolStats
from kvstore.scrub import POISON_VALUE, ScrubPolicy
from kvstore.spec import PoolSpec

__all__ = [
    "POISON_VALUE",
    "KVPool",
    "KVStoreError",
    "Lease",
    "LeaseAccessError",
    "PoolExhaustedError",
    "PoolIntegrityError",
    "PoolSpec",
    "PoolStats",
    "ScrubPolicy",
]
