"""DEFERRED DATA frames (the ucx sender's fault-free frames): a page's checksum is not in
its header but covered by the COMMIT's digest, so the sender can post a run before it
checksums it. No transfer may commit unless every page, as it landed, matches what the
sender checksummed: a page changed after its header was checked fails the whole transfer
(BAD_CHECKSUM at the commit) and poisons what it touched."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from pdmesh.transports import (
    ExpectedTransfer,
    Reason,
    TransferError,
    TransferPlan,
    make_transport,
)
from pdmesh.transports.base import POISON_BYTE, TransportStats
from pdmesh.transports.core import FrameSource
from pdmesh.transports.framing import (
    DEFERRED,
    HEADER_SIZE,
    PAUSE,
    Kind,
    checksum,
    commit_digest,
    decode_header,
    reservation_bytes,
    transfer_key,
)
from pdmesh.transports.receiver import ReceiveTable
from tests.support.transport_cases import HAVE_UCX, PROGRESS_S, make_case


def test_deferred_frames_carry_no_checksum_and_the_commit_covers_every_page():
    src, _dst, _target, plan = make_case(num_tokens=100)  # 7 pages
    views = src.views()[:7]
    rbytes = reservation_bytes(plan.reservation_id)
    deferred = FrameSource(plan, rbytes, views, defer=True)
    frames = list(deferred.data(0, 3, pause=True)) + list(deferred.data(3, 7))
    headers = [decode_header(f.header) for f in frames]
    assert [h.flags for h in headers] == [DEFERRED] * 2 + [DEFERRED | PAUSE] + [DEFERRED] * 4
    assert all(h.payload_checksum == 0 for h in headers)
    assert all(f.source is deferred for f in frames)
    frames[2].source.settle(2)  # what a transport does once it handed page 2 over
    assert deferred.sums[2] == checksum(views[2]) and deferred.sums[3] is None
    # The commit checksums whatever was not settled: the same COMMIT as without deferral.
    plain = FrameSource(plan, rbytes, views)
    list(plain.data(0, 7))
    assert deferred.commit().header == plain.commit().header
    assert decode_header(plain.commit().header).payload_checksum == commit_digest(
        [checksum(v) for v in views])
    assert all(f.source is None for f in FrameSource(plan, rbytes, views).data(0, 7))


def _land(table, slot, frames, conn_id: int, corrupt_page: int | None) -> None:
    """What a transport does with checked DATA frames: the payload lands (page
    `corrupt_page` with one byte changed on the way), then data_done."""
    for f in frames:
        h = decode_header(f.header)
        checked, nack = table.check_data(h, conn_id)
        assert nack is None and checked is slot
        dest = slot.dest(h)
        dest[:] = f.payload
        if h.page_index == corrupt_page:
            dest[100] ^= 0x5A
        assert table.data_done(slot, h) is None  # a DEFERRED page: nothing to compare yet


@pytest.mark.parametrize("corrupt", [False, True], ids=["as-sent", "changed-on-the-way"])
async def test_a_deferred_page_that_differs_from_the_senders_fails_the_commit(corrupt):
    table = ReceiveTable(TransportStats(), None)
    src, dst, target, plan = make_case(num_tokens=100, page_bytes=4096)
    snapshot = dst.snapshot()
    fut = table.expect(target)
    source = FrameSource(plan, reservation_bytes(plan.reservation_id), src.views()[:7],
                         defer=True)
    frames = list(source.data(0, 7))
    slot = table._slots[reservation_bytes(plan.reservation_id)]
    # Page 4 lands other than the sender checksummed it (corrupted on the way, or changed
    # after its header was checked).
    _land(table, slot, frames, conn_id=1, corrupt_page=4 if corrupt else None)
    reply = decode_header(table.check_commit(decode_header(source.commit().header), 1)
                          [:HEADER_SIZE])
    if not corrupt:
        assert reply.kind is Kind.ACK
        result = await asyncio.wait_for(fut, 1)
        assert result.num_tokens == 100 and (dst.array[:7] == src.array[:7]).all()
        return
    assert reply.kind is Kind.NACK and reply.aux == int(Reason.BAD_CHECKSUM)
    with pytest.raises(TransferError) as failed:
        await asyncio.wait_for(fut, 1)
    assert failed.value.reason is Reason.BAD_CHECKSUM
    assert (dst.array[:7] == POISON_BYTE).all()  # nothing of it is ever read
    assert (dst.array[7:] == snapshot[7:]).all()


@pytest.mark.parametrize("kind,deferred", [("tcp", False), pytest.param(
    "ucx", True, marks=[pytest.mark.ucx,
                        pytest.mark.skipif(not HAVE_UCX, reason="ucxx is not importable")])])
async def test_ucx_sends_deferred_frames_and_checks_large_runs_off_the_loop(kind, deferred):
    """ucx's fault-free frames are DEFERRED (tcp's are not); a run of 1 MiB pages lands,
    is checksummed (in ucx's worker thread: runs of 4 MiB and more) and commits."""
    receiver = make_transport(kind, progress_timeout_s=PROGRESS_S)
    sender = make_transport(kind, progress_timeout_s=PROGRESS_S)
    address = await receiver.start()
    flags: list[int] = []
    data_done = receiver._table.data_done

    def spy(slot, h, actual=None):
        flags.append(h.flags)
        return data_done(slot, h, actual)

    receiver._table.data_done = spy
    page = 1 << 20
    src = np.random.default_rng(5).integers(0, 256, (8, page), dtype=np.uint8)
    dst = np.zeros_like(src)
    rid = uuid.uuid4().hex
    key = transfer_key("deferred", rid, 1)
    ids = tuple(range(8))
    try:
        fut = receiver.expect(ExpectedTransfer(rid, 1, ids, [memoryview(p) for p in dst],
                                               page, 16, 128, 30.0, key=key))
        await sender.send(address, TransferPlan(rid, 1, ids, 128, 16, page, 0, 30.0, key=key),
                          [memoryview(p) for p in src])
        await asyncio.wait_for(fut, 10)
        assert (dst == src).all()
        assert len(flags) == 8
        assert all(bool(f & DEFERRED) is deferred for f in flags), flags
    finally:
        await sender.close()
        await receiver.close()
