"""UCX sends runs of pages that lie back to back in memory as one message (the first DATA
header announces the run in `aux`); the receiver checks every header of the run before it
posts one receive, straight into the pages when they are adjacent, else into a buffer that
it copies into them while the slot is live."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from pdmesh.transports import FaultPlan, TransferError, TransferPlan
from pdmesh.transports.core import build_frames
from pdmesh.transports.framing import reservation_bytes
from tests.support.transport_cases import assert_untouched_or_poisoned, make_case

pytestmark = pytest.mark.ucx


@pytest.fixture
def ucx():
    pytest.importorskip("ucxx")
    from pdmesh.transports import ucx

    return ucx


def _frames(plan: TransferPlan, views):
    return list(build_frames(plan, reservation_bytes(plan.reservation_id), views))


def test_runs_group_adjacent_pages_with_consecutive_destinations(ucx):
    src, _dst, _target, plan = make_case(num_tokens=100)  # 7 pages, one array
    frames = _frames(plan, src.views()[:7])
    assert [len(r) for r in ucx._runs(frames)] == [7, 1]  # the pages, then the commit
    gaps = dataclasses.replace(plan, dest_page_ids=(100, 101, 102, 200, 201, 202, 203, 0, 0))
    assert [len(r) for r in ucx._runs(_frames(gaps, src.views()[:7]))] == [3, 4, 1]
    apart = [memoryview(np.zeros(src.page_bytes, np.uint8)) for _ in range(7)]
    assert [len(r) for r in ucx._runs(_frames(plan, apart))] == [1] * 8


@pytest.mark.parametrize("kind", ["ucx"])
async def test_run_into_destination_pages_that_are_not_adjacent(faulty_pair, ucx, kind):
    receiver, sender, address = faulty_pair
    src, dst, target, plan = make_case(num_tokens=100)
    apart = [np.full(dst.page_bytes, 7, np.uint8) for _ in range(len(target.page_ids))]
    target = dataclasses.replace(target, page_buffers=[memoryview(p) for p in apart])
    fut = receiver.expect(target)
    await sender.send(address, plan, src.views())
    result = await asyncio.wait_for(fut, 5)
    assert result.pages_written == target.page_ids[:7]
    for i in range(7):
        assert (apart[i] == src.array[i]).all()
    assert (apart[7] == 7).all() and (apart[8] == 7).all()  # beyond the prompt: untouched


@pytest.mark.parametrize("kind", ["ucx"])
async def test_a_run_that_is_not_followed_by_its_headers_fails_only_that_transfer(
        faulty_pair, ucx, kind):
    """Frame 0 claims a run of 3 (sent through the frame hook, one message per frame): the
    receiver finds no more headers in that header's message (what it reads for headers 1
    and 2 fails their checks) and fails the transfer; nothing of it lands, and the next
    transfer goes through."""
    receiver, sender, address = faulty_pair
    src, dst, target, plan = make_case(num_tokens=100)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    sender.arm(plan.reservation_id, FaultPlan(rewrite={0: {"aux": 3}}))
    with pytest.raises(TransferError):
        await sender.send(address, plan, src.views())
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 5)
    assert_untouched_or_poisoned(dst, snapshot, got.value, target.page_ids)
    src2, dst2, target2, plan2 = make_case(num_tokens=100, seed=9)
    fut2 = receiver.expect(target2)
    await sender.send(address, plan2, src2.views())
    await asyncio.wait_for(fut2, 5)
    assert (dst2.array[:7] == src2.array[:7]).all()
