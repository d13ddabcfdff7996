"""Paged KV pool with leases, epochs, scrub policies, an integrity check and a prefix cache.

Names are loaded lazily (PEP 562) so that `kvstore.prefix_key`, which admission uses for
cache-aware routing, can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KVStoreError": "pdmesh.kvstore.errors",
    "LeaseAccessError": "pdmesh.kvstore.errors",
    "PoolExhaustedError": "pdmesh.kvstore.errors",
    "PoolIntegrityError": "pdmesh.kvstore.errors",
    "Lease": "pdmesh.kvstore.lease",
    "KVPool": "pdmesh.kvstore.pool",
    "PoolStats": "pdmesh.kvstore.pool",
    "PrefixCache": "pdmesh.kvstore.prefix_cache",
    "PrefixCacheStats": "pdmesh.kvstore.prefix_cache",
    "POISON_VALUE": "pdmesh.kvstore.scrub",
    "ScrubPolicy": "pdmesh.kvstore.scrub",
    "PoolSpec": "pdmesh.kvstore.spec",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the names __getattr__ loads, for type checkers
    from pdmesh.kvstore.errors import (
        KVStoreError,
        LeaseAccessError,
        PoolExhaustedError,
        PoolIntegrityError,
    )
    from pdmesh.kvstore.lease import Lease
    from pdmesh.kvstore.pool import KVPool, PoolStats
    from pdmesh.kvstore.prefix_cache import PrefixCache, PrefixCacheStats
    from pdmesh.kvstore.scrub import POISON_VALUE, ScrubPolicy
    from pdmesh.kvstore.spec import PoolSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
