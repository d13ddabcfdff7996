"""The late-write threat (I3): a frame held in flight for a lease that was aborted must never
land in the next lease of the same pages. Real pool (LIFO reuse), real transports on
loopback, both kinds: hold the write, abort (fence + release), re-lease the same pages,
release the write."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid

import pytest
import torch

from pdmesh.kvstore import KVPool, PoolSpec
from pdmesh.transports import (
    ExpectedTransfer,
    FaultPlan,
    TransferError,
    TransferPlan,
    make_transport,
)
from pdmesh.transports._nixl_build import nixl_module

os.environ.setdefault("UCX_TLS", "tcp")
HAVE_UCX = importlib.util.find_spec("ucxx") is not None
KINDS = ["tcp", pytest.param("ucx", marks=[pytest.mark.ucx, pytest.mark.skipif(
    not HAVE_UCX, reason="ucxx is not importable")]),
         pytest.param("nixl", marks=[pytest.mark.nixl, pytest.mark.skipif(
             nixl_module() is None, reason="no NIXL build is importable")])]
SPEC = PoolSpec(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=16, num_pages=8)
PROMPT = 64  # 4 pages


def _pattern(pool: KVPool, lease, value: float) -> None:
    for i in range(lease.num_pages):
        pool.page_tensor(lease, i).fill_(value)


async def _scenario(kind: str, fence: bool) -> tuple[bool, KVPool, object, torch.Tensor]:
    """Returns (late write refused, pool, lease B, B's pages after the late frames)."""
    src = KVPool(SPEC)
    dst = KVPool(SPEC)
    a_src = src.allocate("A", PROMPT)
    _pattern(src, a_src, 1.0)  # tenant A's KV: all ones
    receiver = make_transport(kind, progress_timeout_s=2.0)
    sender = make_transport(kind, progress_timeout_s=2.0, faults=True)
    address = await receiver.start()
    await sender.start()
    try:
        a = dst.allocate("A", PROMPT)
        rid = str(uuid.UUID(a.lease_id))
        target = ExpectedTransfer(rid, a.epoch, a.page_ids,
                                  [dst.page_buffer(a, i) for i in range(a.num_pages)],
                                  SPEC.bytes_per_page, SPEC.page_tokens, PROMPT, deadline_s=10)
        fut = receiver.expect(target)
        plan = TransferPlan(rid, a.epoch, a.page_ids, PROMPT, SPEC.page_tokens,
                            SPEC.bytes_per_page, first_token=1, deadline_s=10)
        # Hold the write: frame 0 lands, frames 1.. wait 0.6 s in the sender.
        sender.arm(rid, FaultPlan(delay={1: 0.6}))
        send = asyncio.ensure_future(sender.send(
            address, plan, [src.page_buffer(a_src, i) for i in range(a_src.num_pages)]))
        await asyncio.sleep(0.2)
        # Abort A: decode fences the reservation (the guard), then frees the pages.
        if fence:
            await receiver.fence(rid)
        dst.release(a, "aborted")
        # Re-lease: LIFO hands the very same pages to B, who writes its own KV (twos).
        b = dst.allocate("B", PROMPT)
        assert b.page_ids == a.page_ids
        _pattern(dst, b, 2.0)
        # Release the write and let every late frame arrive.
        refused = False
        try:
            await asyncio.wait_for(send, 5)
        except TransferError:
            refused = True
        await asyncio.sleep(0.2)
        # The receiver's verdict on A: failed (FENCED) when fenced, "committed" otherwise.
        committed = fut.done() and not fut.cancelled() and fut.exception() is None
        after = torch.stack([dst.page_tensor(b, i).clone() for i in range(b.num_pages)])
        return refused and not committed, dst, b, after
    finally:
        await sender.close()
        await receiver.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_late_frames_never_land_in_the_next_lease(kind: str) -> None:
    refused, pool, b, pages = await _scenario(kind, fence=True)
    assert refused, "the sender must learn its late frames were refused"
    assert torch.all(pages == 2.0), "A's late frames landed in B's pages"
    pool.release(b, "done")
    pool.check_integrity()
    assert pool.num_leased_pages == 0


@pytest.mark.parametrize("kind", ["tcp"])
async def test_without_the_fence_the_late_write_does_land(kind: str) -> None:
    """Negative control: the threat is real. Skip the fence and A's frames overwrite B's
    pages, which is what the test above would catch if the guard were removed."""
    _refused, pool, b, pages = await _scenario(kind, fence=False)
    assert torch.any(pages == 1.0), "expected the unfenced late write to land"
    pool.release(b, "done")
