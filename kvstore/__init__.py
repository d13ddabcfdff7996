"""Paged KV pool with leases, epochs, scrub policies, an integrity check and a prefix cache.

Names are loaded lazily (PEP 562) so that `kvstore.prefix_key`, which admission uses for
cache-aware routing, can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KVStoreError": "kvstore.errors",
    "LeaseAccessError": "kvstore.errors",
    "PoolExhaustedError": "kvstore.errors",
    "PoolIntegrityError": "kvstore.errors",
    "Lease": "kvstore.lease",
    "KVPool": "kvstore.pool",
    "PoolStats": "kvstore.pool",
    "PrefixCache": "kvstore.prefix_cache",
    "PrefixCacheStats": "kvstore.prefix_cache",
    "POISON_VALUE": "kvstore.scrub",
    "ScrubPolicy": "kvstore.scrub",
    "PoolSpec": "kvstore.spec",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvstore.errors import (
        KVStoreError,
        LeaseAccessError,
        PoolExhaustedError,
        PoolIntegrityError,
    )
    from kvstore.lease import Lease
    from kvstore.pool import KVPool, PoolStats
    from kvstore.prefix_cache import PrefixCache, PrefixCacheStats
    from kvstore.scrub import POISON_VALUE, ScrubPolicy
    from kvstore.spec import PoolSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
