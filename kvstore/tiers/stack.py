"""TierStack: host memory, disk and a shared store under the pool, with their metrics.

`put` keeps a block in host memory at once and hands it to a writer thread of the stack's
own, which seals it and writes it to disk and to the store; that queue is bounded in bytes
and drops (and counts) what does not fit, so a slow store never holds a prefill back.
`lookup` returns a prompt's consecutive blocks from `start_block`, each tried in host
memory, then disk, then the store, and stops at the first block none has: a block is only
usable after the ones before it. A sealed entry is opened against what the request itself
says (its salt's keys, the chain digest of its own ids, the model, the salt's purge time);
a refused one counts as that tier's miss, is deleted there, and the next tier is tried. A
block found below host memory is promoted into it.

`lookup`, `purge`, `flush` and `close` block (disk, network): call them from a worker
thread. `put` and `host_has` only touch memory.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdmesh.kvstore.tiers.entry import (
    REASONS,
    EntryHeader,
    EntryRefused,
    Expected,
    Geometry,
    KeyRing,
    block_digest,
    chain_digests,
    open_entry,
    root_digest,
    seal,
)
from pdmesh.kvstore.tiers.host import HostTier
from pdmesh.kvstore.tiers.writer import BackgroundWriter

log = logging.getLogger("pdmesh.kvstore.tiers")


class SealedTier(Protocol):
    """Disk and the shared store: bytes by (tenant tag, store name); never raise."""

    name: str
    errors: collections.Counter[str]

    def put(self, tenant_tag: str, name: str, entry: bytes) -> bool: ...
    def get(self, tenant_tag: str, name: str) -> bytes | None: ...
    def delete(self, tenant_tag: str, name: str) -> None: ...
    def purge(self, tenant_tag: str) -> int: ...
    @property
    def entries(self) -> int | None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class LoadedBlock:
    index: int  # block i covers tokens [i * block_tokens, (i + 1) * block_tokens)
    tier: str  # "host", "disk" or "remote"
    payload: bytes


@dataclass(frozen=True)
class _Write:
    cache_salt: str
    digest: bytes
    header: EntryHeader
    payload: bytes


class TierStack:
    """Tiers 1-3 of one worker: `host` (plaintext, in process), then `lower` sealed tiers
    (disk, then the store), any of them absent."""

    def __init__(self, keys: KeyRing, model: str, geometry: Geometry, *,
                 host: HostTier | None = None, disk: SealedTier | None = None,
                 remote: SealedTier | None = None, registry: CollectorRegistry | None = None,
                 queue_bytes: int = 256 << 20, clock: Callable[[], float] = time.time) -> None:
        self.keys = keys
        self.model = model
        self.geometry = geometry
        self.host = host
        self.lower: list[SealedTier] = [t for t in (disk, remote) if t is not None]
        self.tiers: list[str] = ([host.name] if host else []) + [t.name for t in self.lower]
        self._clock = clock
        self._purged_before: dict[str, float] = {}  # by salt, unix seconds
        self._lock = threading.Lock()
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.load_seconds = Histogram("pdmesh:kv_tier_load_seconds", "Seconds per lookup",
                                      registry=None)
        self._registry = registry
        if registry is not None:
            registry.register(self.load_seconds)
            registry.register(self)
        self._writer: BackgroundWriter[_Write] | None = None
        if self.lower:
            self._writer = BackgroundWriter(self._write, queue_bytes, self._write_failed)

    # --- put ---------------------------------------------------------------------------

    def put(self, cache_salt: str, parent_digest: bytes | None, digest: bytes,
            block_index: int, token_ids: Sequence[int], payload: bytes | memoryview) -> None:
        """Offer block `block_index` (parent None: the salt's first block). Host memory
        keeps it now; disk and the store get it from the writer thread, or not at all if
        its queue is full."""
        parent = root_digest(cache_salt) if parent_digest is None else parent_digest
        if len(token_ids) != self.geometry.block_tokens:
            raise ValueError(f"block of {len(token_ids)} tokens, not "
                             f"{self.geometry.block_tokens}")
        if block_digest(parent, token_ids) != digest:
            raise ValueError(f"block {block_index}: digest is not the chain digest of its "
                             "parent and tokens")
        payload = bytes(payload)
        if self.host is not None and self.host.put(cache_salt, digest, parent, token_ids,
                                                   payload):
            self._count("stored_bytes", self.host.name, n=len(payload))
        if self._writer is None:
            return
        header = EntryHeader(model=self.model, geometry=self.geometry,
                             block_index=block_index, parent_digest=parent,
                             token_ids=list(token_ids), created_at=self._clock(),
                             payload_len=len(payload))
        if not self._writer.submit(_Write(cache_salt, digest, header, payload), len(payload)):
            for tier in self.lower:
                self._count("errors", tier.name, "queue")

    def host_has(self, cache_salt: str, digest: bytes) -> bool:
        return self.host is not None and self.host.has(cache_salt, digest)

    # --- lookup ------------------------------------------------------------------------

    def lookup(self, cache_salt: str, token_ids: Sequence[int], start_block: int,
               end_block: int) -> list[LoadedBlock]:
        """Blocks start_block, start_block + 1, ... (before end_block and the prompt's
        last whole block) up to the first that no tier has."""
        started = time.perf_counter()
        size = self.geometry.block_tokens
        end_block = min(end_block, len(token_ids) // size)
        digests = chain_digests(cache_salt, token_ids[:end_block * size], size)
        found: list[LoadedBlock] = []
        for index in range(start_block, end_block):
            parent = digests[index - 1] if index else root_digest(cache_salt)
            block = self._find(cache_salt, index, parent, digests[index],
                               token_ids[index * size:(index + 1) * size])
            if block is None:
                break
            found.append(block)
        self.load_seconds.observe(time.perf_counter() - started)
        return found

    def _find(self, cache_salt: str, index: int, parent: bytes, digest: bytes,
              token_ids: Sequence[int]) -> LoadedBlock | None:
        if self.host is not None:
            payload = self.host.get(cache_salt, digest, parent, token_ids)
            if payload is not None:
                self._hit(self.host.name, len(payload))
                return LoadedBlock(index, self.host.name, payload)
            self._count("misses", self.host.name)
        if not self.lower:
            return None
        keys = self.keys.for_salt(cache_salt)
        tag, name = keys.tenant_tag, keys.name(digest)
        expected = Expected(self.model, self.geometry, index, parent, token_ids,
                            self.purged_before(cache_salt))
        for tier in self.lower:
            entry = tier.get(tag, name)
            if entry is None:
                self._count("misses", tier.name)
                continue
            try:
                payload = open_entry(keys, name, entry, expected)
            except EntryRefused as refused:
                self._count("refused", tier.name, refused.reason)
                self._count("misses", tier.name)
                log.info("%s tier: block %d %s", tier.name, index, refused)
                tier.delete(tag, name)  # useless to every reader: another put replaces it
                continue
            self._hit(tier.name, len(payload))
            if self.host is not None and self.host.put(cache_salt, digest, parent,
                                                       token_ids, payload):
                self._count("stored_bytes", self.host.name, n=len(payload))
            return LoadedBlock(index, tier.name, payload)
        return None

    # --- purge -------------------------------------------------------------------------

    def purged_before(self, cache_salt: str) -> float:
        with self._lock:
            return self._purged_before.get(cache_salt, 0.0)

    def purge(self, cache_salt: str) -> dict[str, int]:
        """Remove the salt's blocks from every tier; entries removed, by tier. Entries of
        the salt created before now are refused ("stale") from here on, wherever they
        are: one a queued write or another worker stores later included."""
        with self._lock:
            self._purged_before[cache_salt] = self._clock()
        removed = {}
        if self.host is not None:
            removed[self.host.name] = self.host.purge(cache_salt)
        tag = self.keys.for_salt(cache_salt).tenant_tag
        for tier in self.lower:
            removed[tier.name] = tier.purge(tag)
        return removed

    # --- writer ------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every block put so far has been written or dropped; False on
        timeout."""
        return self._writer is None or self._writer.flush(timeout_s)

    def _write_failed(self) -> None:
        for tier in self.lower:
            self._count("errors", tier.name, "seal")

    def _write(self, job: _Write) -> None:
        if job.header.created_at < self.purged_before(job.cache_salt):
            return  # purged while it waited
        keys = self.keys.for_salt(job.cache_salt)
        name = keys.name(job.digest)
        entry = seal(keys, name, job.header, job.payload)
        for tier in self.lower:
            if tier.put(keys.tenant_tag, name, entry):
                self._count("stored_bytes", tier.name, n=len(entry))

    def close(self) -> None:
        """Stop the writer (blocks still queued are dropped) and close the tiers."""
        if self._writer is not None:
            self._writer.close()
        for tier in ([self.host] if self.host else []) + self.lower:
            tier.close()
        if self._registry is not None:
            self._registry.unregister(self)
            self._registry.unregister(self.load_seconds)
            self._registry = None

    # --- stats -------------------------------------------------------------------------

    def _count(self, *key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _hit(self, tier: str, num_bytes: int) -> None:
        with self._lock:
            self.counts["hits", tier] += 1
            self.counts["loaded_bytes", tier] += num_bytes

    def errors(self) -> dict[tuple[str, str], int]:
        """Store errors by (tier, operation): the tiers' own and the writer queue's."""
        with self._lock:
            out = {(k[1], k[2]): n for k, n in self.counts.items() if k[0] == "errors"}
        for tier in self.lower:
            for op, n in dict(tier.errors).items():
                out[tier.name, op] = out.get((tier.name, op), 0) + n
        return out

    def entries(self) -> dict[str, int]:
        tiers = ([self.host] if self.host else []) + self.lower
        return {t.name: n for t in tiers if (n := t.entries) is not None}

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """(what, labels, value) of each counter and gauge of the stack."""
        with self._lock:
            counts = dict(self.counts)
        for what in ("hits", "misses", "loaded_bytes", "stored_bytes"):
            for tier in self.tiers:
                yield what, {"tier": tier}, counts.get((what, tier), 0)
        for tier in (t.name for t in self.lower):
            for reason in REASONS:
                yield "refused", {"tier": tier, "reason": reason}, counts.get(
                    ("refused", tier, reason), 0)
        for (tier, op), n in sorted(self.errors().items()):
            yield "errors", {"tier": tier, "op": op}, n
        for tier, n in self.entries().items():
            yield "entries", {"tier": tier}, n

    def counters(self) -> dict[str, float]:
        """Flat `kv_tier_<what>_<tier>[_<reason>]` counters (a worker's StatsReply);
        errors summed over operations."""
        out: dict[str, float] = {f"kv_tier_errors_{tier}": 0 for tier in self.tiers}
        for what, labels, value in self.samples():
            if what == "errors":
                out[f"kv_tier_errors_{labels['tier']}"] += value
            else:
                out["_".join(("kv_tier", what, *labels.values()))] = value
        return out

    def collect(self) -> Iterator[Metric]:
        """The samples as Prometheus metrics (the stack is its registry's collector)."""
        families: dict[str, Metric] = {
            what: (GaugeMetricFamily if what == "entries" else CounterMetricFamily)(
                f"pdmesh:kv_tier_{what}", doc, labels=labels)
            for what, (doc, labels) in _METRICS.items()}
        for what, labels, value in self.samples():
            families[what].add_metric(list(labels.values()), value)
        yield from families.values()


_METRICS = {
    "hits": ("Blocks found, by tier", ["tier"]),
    "misses": ("Blocks a tier was asked for and had not, or refused", ["tier"]),
    "loaded_bytes": ("Payload bytes loaded, by tier", ["tier"]),
    "stored_bytes": ("Bytes stored (sealed entries below host memory), by tier", ["tier"]),
    "refused": ("Entries refused, by tier and reason", ["tier", "reason"]),
    "errors": ("Store errors (dropped puts, failed reads), by tier and operation",
               ["tier", "op"]),
    "entries": ("Blocks held, by tier (not known for the shared store)", ["tier"]),
}
