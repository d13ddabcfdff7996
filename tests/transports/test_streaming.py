"""Streamed send: the sender sends each prefill chunk's pages as they become
final (`PagesReady`), the commit last; every receiver check stays as it is.

- pages released in steps, with pauses longer than the progress timeout, arrive and commit
  verified, on a link the receiver keeps (no tear-down between chunks);
- a page is checksummed and sent only once final: pages hold other bytes until just
  before `advance`, and the commit still verifies against the final bytes;
- a producer that fails mid-way (or before any page): the send raises ABORTED and tells
  the receiver (an authenticated NACK), whose expectation fails ABORTED and fences at
  once; no byte lands in a page that was not final;
- the link is opened at once (an unreachable receiver is found before any page is final);
- the plan's deadline bounds the whole send, the receiver's deadline its slot; a fence
  between chunks stops the sender at once.
Tests that need a peer in another process (a frozen streamed sender) are in
test_peer_loss.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from pdmesh.transports import (
    POISON_BYTE,
    FaultPlan,
    PagesReady,
    Reason,
    TransferError,
    TransportStats,
)
from pdmesh.transports.base import ProducerFailed
from pdmesh.transports.core import FrameSource
from pdmesh.transports.errors import AuthError
from pdmesh.transports.framing import (
    PAUSE,
    FrameHeader,
    Kind,
    decode_header,
    encode_header,
    reservation_bytes,
)
from pdmesh.transports.receiver import ReceiveTable
from tests.support.transport_cases import PROGRESS_S, assert_untouched_or_poisoned, make_case

DRAFT = 0x3C  # what a page holds before it is final (a chunk still being computed)


async def _until(predicate, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


# -- PagesReady --------------------------------------------------------------------------
async def test_pages_ready_is_monotonic_clamped_and_fails_only_what_is_not_final():
    ready = PagesReady(5)
    ready.advance(3)
    ready.advance(2)  # monotonic
    assert ready.ready == 3
    ready.advance(99)  # clamped
    assert ready.ready == 5
    await asyncio.wait_for(ready.wait(9), 1)  # n is clamped too
    ready.fail(RuntimeError("late"))  # every page final already: nothing to fail
    assert not ready.failed
    with pytest.raises(ValueError):
        PagesReady(0)

    ready = PagesReady(4, ready=1)
    waiter = asyncio.ensure_future(ready.wait(3))
    await asyncio.sleep(0.01)
    ready.advance(2)
    await asyncio.sleep(0.01)
    assert not waiter.done()
    await ready.wait(2)  # what is final stays final
    ready.fail(RuntimeError("engine died"))
    with pytest.raises(ProducerFailed) as err:
        await asyncio.wait_for(waiter, 1)
    assert isinstance(err.value.cause, RuntimeError)
    ready.advance(4)  # ignored after a failure
    assert ready.ready == 2


def test_frames_are_built_and_flagged_per_segment():
    src, _dst, _target, plan = make_case(num_tokens=100)  # 7 pages
    source = FrameSource(plan, reservation_bytes(plan.reservation_id), src.views()[:7])
    first = [decode_header(f.header) for f in source.data(0, 3, pause=True)]
    assert [h.flags for h in first] == [0, 0, PAUSE]  # only a segment's last frame
    rest = [decode_header(f.header) for f in source.data(3, 7)]
    assert [h.flags for h in rest] == [0] * 4
    commit = decode_header(source.commit().header)
    assert commit.page_index == 7 and commit.flags == 0
    with pytest.raises(RuntimeError):  # no frame out of order, no commit before every page
        next(FrameSource(plan, b"\0" * 16, src.views()[:7]).data(1, 2))
    with pytest.raises(RuntimeError):
        FrameSource(plan, b"\0" * 16, src.views()[:7]).commit()


# -- live transports ---------------------------------------------------------------------
async def test_pages_released_in_steps_arrive_and_commit_verified(pair):
    """Three chunks, pauses of 3x the progress timeout between them; each page holds draft
    bytes until right before it is declared final."""
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=100, deadline_s=30)  # 7 pages
    final = src.snapshot()
    snapshot = dst.snapshot()
    src.array[:7] = DRAFT
    fut = receiver.expect(target)
    ready = PagesReady(7)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    for upto in (2, 5, 7):
        done = ready.ready
        src.array[done:upto] = final[done:upto]  # the chunk is computed ...
        ready.advance(upto)  # ... then declared final
        if upto < 7:
            await _until(lambda n=upto: receiver.stats.frames_received == n)
            await asyncio.sleep(3 * PROGRESS_S)  # the next chunk computes
            assert not fut.done() and not send.done()
            assert receiver.stats.frames_received == upto  # nothing of the unready pages
            assert (dst.array[upto:] == snapshot[upto:]).all()
            src.array[upto:7] = DRAFT + upto  # still being written
    ack = await asyncio.wait_for(send, 10)
    result = await asyncio.wait_for(fut, 5)
    assert (dst.array[:7] == final[:7]).all()
    assert (dst.array[7:] == snapshot[7:]).all()
    assert result.pages_written == target.page_ids[:7] and ack.num_tokens == 100
    assert not receiver.stats.frames_rejected and receiver.stats.transfers_failed == 0
    # The same link carried the whole transfer and goes back to the idle pool.
    assert sum(len(v) for v in sender._idle.values()) == 1


async def test_everything_ready_at_once_and_reused_link(pair):
    """`ready` already complete is the plain send; a second streamed send reuses the link."""
    receiver, sender, address = pair
    for seed in (1, 2):
        src, dst, target, plan = make_case(num_tokens=40, seed=seed)
        fut = receiver.expect(target)
        ready = PagesReady(target.num_pages, ready=target.num_pages if seed == 1 else 1)
        send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
        ready.advance(target.num_pages)
        await asyncio.wait_for(send, 10)
        await asyncio.wait_for(fut, 5)
        assert (dst.array[: target.num_pages] == src.array[: target.num_pages]).all()
    assert sum(len(v) for v in sender._idle.values()) == 1


async def test_producer_failure_aborts_the_send_and_no_unready_page_is_touched(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=100, deadline_s=30)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    ready = PagesReady(7)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    ready.advance(3)
    await _until(lambda: receiver.stats.frames_received == 3)
    await asyncio.sleep(2 * PROGRESS_S)
    src.array[3:] = DRAFT  # half-computed pages that must never leave
    ready.fail(RuntimeError("prefill engine failed"))
    with pytest.raises(TransferError) as sent:
        await asyncio.wait_for(send, 5)
    assert sent.value.reason is Reason.ABORTED
    assert isinstance(sent.value.__cause__, RuntimeError)
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 2)  # the sender said so: the receiver knows at once
    assert got.value.reason is Reason.ABORTED
    await asyncio.wait_for(receiver.fence(target.reservation_id), 2)
    assert sorted(got.value.pages_poisoned) == list(target.page_ids[:3])
    assert (dst.array[:3] == POISON_BYTE).all()
    assert (dst.array[3:] == snapshot[3:]).all()  # no byte in a page that was not final
    assert_untouched_or_poisoned(dst, snapshot, got.value, target.page_ids)


async def test_producer_failure_before_any_page_reaches_the_receiver(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case(deadline_s=30)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    ready = PagesReady(plan.num_pages)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    await asyncio.sleep(2 * PROGRESS_S)
    ready.fail(ValueError("prompt refused"))
    with pytest.raises(TransferError) as sent:
        await asyncio.wait_for(send, 2)
    assert sent.value.reason is Reason.ABORTED
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 2)
    assert got.value.reason is Reason.ABORTED and not got.value.pages_poisoned
    assert (dst.array == snapshot).all()


async def test_abort_frame_fails_only_the_live_slot_it_authenticates_for():
    """Table level: a sender's NACK fails the slot it names only with the live epoch and
    from the slot's own connection; one whose MAC does not verify is an AuthError (the
    link is dropped, the slot untouched)."""
    table = ReceiveTable(TransportStats(), None)
    _src, _dst, target, plan = make_case()
    fut = table.expect(target)
    rb = reservation_bytes(plan.reservation_id)

    def nack(epoch: int, key: bytes) -> FrameHeader:
        return decode_header(encode_header(Kind.NACK, rb, epoch, aux=int(Reason.ABORTED),
                                           key=key))

    with pytest.raises(AuthError):
        table.authenticate(nack(plan.epoch, b"forged key"))
    table.check_abort(nack(plan.epoch + 1, plan.key), conn_id=1)  # another epoch
    table._slots[rb].conn_id = 2  # the transfer's frames come on another connection
    table.check_abort(nack(plan.epoch, plan.key), conn_id=1)
    assert not fut.done()
    h = nack(plan.epoch, plan.key)
    table.authenticate(h)
    table.check_abort(h, conn_id=2)
    with pytest.raises(TransferError) as got:
        await fut
    assert got.value.reason is Reason.ABORTED


async def test_link_is_opened_before_any_page_is_final(pair):
    _, sender, _ = pair
    src, _, _, plan = make_case()
    ready = PagesReady(plan.num_pages)  # nothing final, ever
    started = time.monotonic()
    with pytest.raises(TransferError) as sent:
        await sender.send(f"{sender.scheme}://127.0.0.1:1", plan, src.views(), ready)
    assert sent.value.reason is Reason.PEER_LOST
    assert time.monotonic() - started < 5


async def test_ready_must_count_the_plans_pages(pair):
    _, sender, address = pair
    src, _, _, plan = make_case()  # 7 pages
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plan, src.views(), PagesReady(9))
    assert sent.value.reason is Reason.INVALID_PLAN


async def test_plan_deadline_bounds_a_streamed_send(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case(deadline_s=30)
    snapshot = dst.snapshot()
    plan = dataclasses.replace(plan, deadline_s=1.5)
    fut = receiver.expect(target)
    ready = PagesReady(plan.num_pages, ready=2)
    started = time.monotonic()
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plan, src.views(), ready)
    assert sent.value.reason is Reason.DEADLINE
    assert 1.4 < time.monotonic() - started < 4
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 5)
    assert got.value.reason is Reason.PEER_LOST  # the link closed by the sender's deadline
    assert_untouched_or_poisoned(dst, snapshot, got.value, target.page_ids)
    assert (dst.array[2:] == snapshot[2:]).all()


async def test_receiver_deadline_ends_a_paused_transfer_and_tells_the_sender(pair):
    """The receiving slot's own deadline bounds a pause: the slot fails DEADLINE (not
    PEER_LOST earlier) and the sender, still waiting for pages, gets the NACK at once."""
    receiver, sender, address = pair
    src, dst, target, plan = make_case(deadline_s=30)
    snapshot = dst.snapshot()
    target = dataclasses.replace(target, deadline_s=4 * PROGRESS_S)
    fut = receiver.expect(target)
    ready = PagesReady(plan.num_pages, ready=2)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 10)
    assert got.value.reason is Reason.DEADLINE
    with pytest.raises(TransferError) as sent:
        await asyncio.wait_for(send, 2)
    assert sent.value.reason is Reason.DEADLINE
    assert (dst.array[2:] == snapshot[2:]).all()
    assert sorted(got.value.pages_poisoned) == list(target.page_ids[:2])


async def test_fence_between_chunks_stops_the_sender_and_nothing_lands_after(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case(deadline_s=30)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    ready = PagesReady(plan.num_pages, ready=2)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    await _until(lambda: receiver.stats.frames_received == 2)
    await asyncio.sleep(2 * PROGRESS_S)
    await asyncio.wait_for(receiver.fence(target.reservation_id), 2)
    after_fence = dst.snapshot()
    assert (after_fence[:2] == POISON_BYTE).all() and (after_fence[2:] == snapshot[2:]).all()
    with pytest.raises(TransferError) as sent:
        await asyncio.wait_for(send, 2)  # the NACK reaches a sender waiting for pages
    assert sent.value.reason is Reason.FENCED
    ready.advance(plan.num_pages)
    await asyncio.sleep(0.2)
    assert (dst.array == after_fence).all()
    with pytest.raises(TransferError):
        await fut


async def test_a_fault_plan_waits_for_every_page_then_sends_as_scheduled(faulty_pair):
    receiver, sender, address = faulty_pair
    src, dst, target, plan = make_case(deadline_s=30)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    sender.arm(plan.reservation_id, FaultPlan(corrupt={4: 99}))
    ready = PagesReady(plan.num_pages, ready=1)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    await asyncio.sleep(2 * PROGRESS_S)
    assert receiver.stats.frames_received == 0  # nothing until every page is final
    ready.advance(plan.num_pages)
    with pytest.raises(TransferError) as sent:
        await asyncio.wait_for(send, 5)
    assert sent.value.reason is Reason.BAD_CHECKSUM
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(fut, 5)
    assert_untouched_or_poisoned(dst, snapshot, got.value, target.page_ids)


async def test_many_small_steps_with_concurrent_transfers(pair):
    """Pages made final one at a time, interleaved with plain sends on other links."""
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=200, page_tokens=16, seed=3)  # 13 pages
    fut = receiver.expect(target)
    ready = PagesReady(target.num_pages)
    send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready))
    others = [make_case(num_tokens=50, seed=10 + i) for i in range(3)]
    other_futs = [receiver.expect(t) for _, _, t, _ in others]
    for i in range(target.num_pages):
        ready.advance(i + 1)
        if i < len(others):
            o_src, _, _, o_plan = others[i]
            await sender.send(address, o_plan, o_src.views())
        await asyncio.sleep(0.01)
    await asyncio.wait_for(send, 10)
    await asyncio.wait_for(fut, 5)
    n = target.num_pages
    assert np.array_equal(dst.array[:n], src.array[:n])
    for (o_src, o_dst, o_target, _), o_fut in zip(others, other_futs, strict=True):
        await asyncio.wait_for(o_fut, 5)
        assert (o_dst.array[: o_target.num_pages] == o_src.array[: o_target.num_pages]).all()
