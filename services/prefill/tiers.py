"""Prefill's KV tiers: load a prompt's blocks that the pool no longer holds, offer the blocks
it computed.

Under the pool (tier 0) sit host memory (tier 1), a local directory (tier 2) and a shared
Redis store (tier 3), composed by `kvstore.tiers.TierStack` (docs/KVTIERS.md). The unit is
a block of `block_tokens` tokens (the prefix cache's alignment: whole pages and whole
prefill chunks), so a block loaded back holds the bits a prefill of the same prompt would
compute (I4).

Load (`load`): after the pool's own match, the blocks right after it are looked up in the
tiers, consecutive from the first, on this module's thread (disk and network never block
the event loop or the engine). The stack returns a block only after its check (the entry's
AEAD tag under the tenant's key, its tenant salt, its exact token ids, its model): only
then are its bytes copied into the lease's own fresh pages and the pages marked written,
which is what makes them readable (I2) by the remaining chunks and by the send. A block no
tier has, or one refused, is computed.

Offer (`offer`): when the prompt is done, every whole block of it that host memory lacks is
copied out of the lease's pages (read-checked on the event loop, copied on this module's
thread while the lease still pins them) and put: host memory at once, disk and the store
in the background. The job's lease is released only once the copy is over.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

from pdmesh.kvstore import KVPool, Lease
from pdmesh.kvstore.prefix_key import aligned_prefix_hashes
from pdmesh.kvstore.tiers import (
    DiskTier,
    Geometry,
    HostTier,
    KeyRing,
    RemoteTier,
    TierStack,
    chain_digests,
)

log = logging.getLogger("pdmesh.prefill.tiers")


def make_tiers(cfg: Any, pool: KVPool, block_tokens: int, model: str, registry: Any,
               trace: Any = None) -> PrefillTiers | None:
    """The tiers a prefill config asks for (None: none, the pool alone)."""
    spec = pool.spec
    host_bytes = cfg.kv_host_tokens * spec.bytes_per_token
    if not host_bytes and not cfg.kv_disk_dir and not cfg.kv_remote_url:
        return None
    geometry = Geometry(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                        head_dim=spec.head_dim, page_tokens=spec.page_tokens,
                        dtype=str(spec.dtype).removeprefix("torch."), block_tokens=block_tokens)
    stack = TierStack(
        KeyRing(bytes.fromhex(cfg.kv_tier_key)), model, geometry,
        host=HostTier(host_bytes) if host_bytes else None,
        disk=DiskTier(cfg.kv_disk_dir, int(cfg.kv_disk_gib * 2**30)) if cfg.kv_disk_dir
        else None,
        remote=RemoteTier(cfg.kv_remote_url, cfg.kv_remote_ttl_s, cfg.kv_remote_timeout_s)
        if cfg.kv_remote_url else None,
        registry=registry)
    log.info("KV tiers under the pool: %s (blocks of %d tokens)", ", ".join(stack.tiers),
             block_tokens)
    return PrefillTiers(stack, pool, block_tokens,
                        routing_blocks=cfg.kv_host_tokens // block_tokens, trace=trace)


class PrefillTiers:
    """The tiers of one prefill worker's pool. Call from the event loop; the stack's
    blocking work runs on one owned thread, shut down by `close`."""

    def __init__(self, stack: TierStack, pool: KVPool, block_tokens: int,
                 routing_blocks: int = 0, trace: Any = None) -> None:
        if block_tokens % pool.spec.page_tokens:
            raise ValueError(f"block_tokens {block_tokens} is not a multiple of the page "
                             f"size {pool.spec.page_tokens}")
        self.stack = stack
        self.pool = pool
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // pool.spec.page_tokens
        # Routing keys (kvstore.prefix_key) of the prefixes host memory was last handed,
        # most recent last, as many as it holds blocks: heartbeats advertise them so that
        # admission routes a prompt here when its prefix is in this worker's host memory.
        # A key of a block host memory has since dropped costs a misroute, never a hit.
        self._routing: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._routing_blocks = routing_blocks
        self.trace = trace  # the protocol trace (services/runtime/ptrace.py; None: off)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tiers")

    def _remember(self, cache_salt: str, prompt_ids: Sequence[int], blocks: int) -> None:
        """Note the routing keys of the prompt's first `blocks` blocks, the shorter prefixes
        as the more recent (a summary cut short keeps whole chains from the root)."""
        if not self._routing_blocks or not blocks:
            return
        keys = list(aligned_prefix_hashes(cache_salt, prompt_ids, self.pool.spec.page_tokens,
                                          self.block_tokens, blocks * self.block_tokens))
        for key in reversed(keys):
            self._routing.pop(key, None)
            self._routing[key] = None
        while len(self._routing) > self._routing_blocks:
            self._routing.popitem(last=False)

    def summary(self, limit: int) -> list[int]:
        """Routing keys of host memory's prefixes, most recent first."""
        out = []
        for key in reversed(self._routing):
            if len(out) >= limit:
                break
            out.append(key)
        return out

    def _blocks(self, prompt_len: int) -> int:
        """Whole blocks of a prompt that may come from a cache: the last token is always
        computed (its logits give the first generated token)."""
        return max(prompt_len - 1, 0) // self.block_tokens

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def load(self, lease: Lease, cache_salt: str, prompt_ids: Sequence[int],
                   cached_tokens: int) -> int:
        """Fill the lease's pages after its `cached_tokens` (a block boundary) with the
        consecutive blocks the tiers hold and that pass their check; returns the tokens
        loaded (0: none). The pages of a loaded block are marked written here, after the
        check, and not before."""
        if not cache_salt or cached_tokens % self.block_tokens:
            return 0
        first, end = cached_tokens // self.block_tokens, self._blocks(len(prompt_ids))
        if first >= end:
            return 0
        found = await self._run(self.stack.lookup, cache_salt, list(prompt_ids), first, end)
        size = self.pool.spec.page_tokens
        targets, payloads = [], []
        for offset, block in enumerate(found):
            if block.index != first + offset:  # the stack returns a consecutive run
                break
            pages = range(block.index * self.pages_per_block,
                          (block.index + 1) * self.pages_per_block)
            targets.append([self.pool.page_buffer(lease, p) for p in pages])
            payloads.append(block.payload)
        if not targets:
            return 0
        await self._run(_copy_in, targets, payloads)
        if self.trace is not None:  # each block copied after its check (tracecheck TIER)
            for offset in range(len(targets)):
                index = first + offset
                self.trace.emit("tier_load", req=lease.request_id, lease=lease.lease_id,
                                block=index, tier=found[offset].tier, verified=True, pages=[
                                    int(lease.page_ids[p]) for p in range(
                                        index * self.pages_per_block,
                                        (index + 1) * self.pages_per_block)])
        for index in range(first * self.pages_per_block,
                           (first + len(targets)) * self.pages_per_block):
            self.pool.mark_written(lease, index, size)  # readable from here on (I2)
        self._remember(cache_salt, prompt_ids, first + len(targets))
        return len(targets) * self.block_tokens

    def offer(self, lease: Lease, cache_salt: str,
              prompt_ids: Sequence[int]) -> asyncio.Future[int] | None:
        """Put the prompt's whole blocks written by `lease` that host memory lacks (None:
        nothing to put). The returned future ends when the pages have been copied out; the
        lease must stay live until then."""
        if not cache_salt:
            return None
        blocks = min(len(prompt_ids), self.pool.written_prefix(lease)) // self.block_tokens
        self._remember(cache_salt, prompt_ids, blocks)
        digests = chain_digests(cache_salt, prompt_ids[:blocks * self.block_tokens],
                                self.block_tokens)
        wanted = [i for i in range(blocks) if not self.stack.host_has(cache_salt, digests[i])]
        if not wanted:
            return None
        sources = [[self.pool.page_view(lease, p)
                    for p in range(i * self.pages_per_block, (i + 1) * self.pages_per_block)]
                   for i in wanted]
        parents = [digests[i - 1] if i else None for i in wanted]
        put = [(cache_salt, parents[k], digests[i], i,
                list(prompt_ids[i * self.block_tokens:(i + 1) * self.block_tokens]))
               for k, i in enumerate(wanted)]
        return asyncio.ensure_future(self._run(_copy_out_and_put, self.stack, put, sources))

    def counters(self) -> dict[str, float]:
        return self.stack.counters()

    async def purge(self, cache_salt: str) -> dict[str, int]:
        """Delete the salt's blocks in every tier; entries removed, by tier."""
        return await self._run(self.stack.purge, cache_salt)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.stack.close()


def _copy_in(targets: list[list[memoryview]], payloads: list[bytes]) -> None:
    for pages, payload in zip(targets, payloads, strict=True):
        offset = 0
        for page in pages:
            page[:] = payload[offset:offset + len(page)]
            offset += len(page)
        if offset != len(payload):
            raise ValueError(f"a block of {len(payload)} bytes for {offset} bytes of pages")


def _copy_out_and_put(stack: TierStack, put: list[tuple[Any, ...]],
                      sources: list[list[memoryview]]) -> int:
    for (salt, parent, digest, index, token_ids), pages in zip(put, sources, strict=True):
        stack.put(salt, parent, digest, index, token_ids, b"".join(pages))
    return len(put)
