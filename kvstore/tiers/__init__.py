"""The KV tiers under the pool: host memory (1), a local directory (2), a shared Redis
store (3), composed by `TierStack`; blocks of `block_tokens` tokens bound to their tenant,
token ids and model by chain digests and sealed entries (`entry`). No torch: payloads are
bytes.
"""

from __future__ import annotations

from pdmesh.kvstore.tiers.disk import DiskTier
from pdmesh.kvstore.tiers.entry import (
    REASONS,
    EntryHeader,
    EntryRefused,
    Expected,
    Geometry,
    KeyRing,
    TenantKeys,
    block_digest,
    chain_digests,
    open_entry,
    root_digest,
    seal,
)
from pdmesh.kvstore.tiers.host import HostTier
from pdmesh.kvstore.tiers.remote import RemoteTier
from pdmesh.kvstore.tiers.stack import LoadedBlock, SealedTier, TierStack

__all__ = [
    "REASONS",
    "DiskTier",
    "EntryHeader",
    "EntryRefused",
    "Expected",
    "Geometry",
    "HostTier",
    "KeyRing",
    "LoadedBlock",
    "RemoteTier",
    "SealedTier",
    "TenantKeys",
    "TierStack",
    "block_digest",
    "chain_digests",
    "open_entry",
    "root_digest",
    "seal",
]
