"""The conformance suite: every KVTransport implementation must pass all of it.

In every failure case the destination pages are untouched (equal to a snapshot) or, where
bytes of the failed transfer had landed, poisoned (all 0xFF, listed in pages_poisoned);
never do they hold the sender's bytes, and the error reaches both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import numpy as np
import pytest

from pdmesh.transports import POISON_BYTE, FaultPlan, Reason, TransferError
from pdmesh.transports.framing import HEADER_SIZE
from tests.support.transport_cases import assert_untouched_or_poisoned, make_case


async def run_failing(pair, faults=None, plan_changes=None, target_changes=None,
                      num_tokens=100):
    """Sends with a fault (a `faulty_pair` is needed for `faults`); returns (receiver error or
    None, sender error, dst, snapshot)."""
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=num_tokens)
    if target_changes:
        target = dataclasses.replace(target, **target_changes)
    if plan_changes:
        plan = dataclasses.replace(plan, **plan_changes)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    if faults is not None:
        sender.arm(plan.reservation_id, faults)
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plan, src.views())
    received = None
    if plan.reservation_id == target.reservation_id:
        try:
            with pytest.raises(TransferError) as got:
                await asyncio.wait_for(fut, 3)
        except TimeoutError:  # say why: the sender may have failed before any verdict
            pytest.fail(f"the receiver did not fail the transfer within 3 s; the sender "
                        f"failed with {sent.value.reason.name}: {sent.value}")
        received = got.value
        assert_untouched_or_poisoned(dst, snapshot, received, target.page_ids)
    else:
        assert not fut.done()
        assert (dst.array == snapshot).all()
        await receiver.fence(target.reservation_id)
    return received, sent.value, dst, snapshot


async def test_exact_bytes_delivered(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=100, page_tokens=16)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    ack = await sender.send(address, plan, src.views())
    result = await fut
    n = target.num_pages
    assert n == 7
    assert (dst.array[:n] == src.array[:n]).all()
    assert (dst.array[n:] == snapshot[n:]).all()  # reserved but not part of the prompt
    assert result.pages_written == target.page_ids[:n]
    assert (result.num_tokens, result.first_token, result.epoch) == (100, 7, plan.epoch)
    assert ack.num_tokens == 100 and ack.bytes == n * plan.page_bytes == result.bytes
    assert receiver.stats.transfers_committed == 1 and sender.stats.transfers_sent == 1


async def test_connection_reuse_and_concurrency(pair):
    receiver, sender, address = pair
    cases = [make_case(num_tokens=40, seed=10 * i) for i in range(4)]
    futs = [receiver.expect(target) for _, _, target, _ in cases]
    for src, _, _, plan in cases[:2]:  # sequential: the second reuses the pooled connection
        await sender.send(address, plan, src.views())
    await asyncio.gather(*(sender.send(address, plan, src.views())
                           for src, _, _, plan in cases[2:]))
    for (src, dst, target, _), fut in zip(cases, futs, strict=True):
        await fut
        assert (dst.array[: target.num_pages] == src.array[: target.num_pages]).all()


async def test_flipped_payload_byte(faulty_pair):
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(corrupt={1: 12345}))
    assert got.reason is sent.reason is Reason.BAD_CHECKSUM
    assert got.pages_poisoned  # page 1's bytes had landed: they are poisoned, not kept


async def test_truncated_stream(faulty_pair):
    page = 64 << 10
    got, sent, _, _ = await run_failing(
        faulty_pair, FaultPlan(truncate_after=2 * (HEADER_SIZE + page) + HEADER_SIZE + page // 2))
    assert got.reason is Reason.PEER_LOST and sent.reason is Reason.PEER_LOST
    assert len(got.pages_poisoned) == 3


async def test_reset_mid_transfer(faulty_pair):
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(reset_after=HEADER_SIZE + 1000))
    assert got.reason is Reason.PEER_LOST and sent.reason is Reason.PEER_LOST


async def test_stale_epoch(pair):
    got, sent, dst, snapshot = await run_failing(pair, plan_changes={"epoch": 2})
    assert got.reason is sent.reason is Reason.STALE_EPOCH
    assert (dst.array == snapshot).all() and not got.pages_poisoned


async def test_foreign_reservation_fails_only_the_sender(pair):
    _, sent, _, _ = await run_failing(pair, plan_changes={"reservation_id": uuid.uuid4().hex})
    assert sent.reason is Reason.UNKNOWN_RESERVATION


async def test_frame_aimed_at_a_page_outside_the_lease(faulty_pair):
    got, sent, dst, snapshot = await run_failing(
        faulty_pair, FaultPlan(rewrite={0: {"dest_page_id": 5}}))
    assert got.reason is sent.reason is Reason.OUT_OF_RANGE
    assert (dst.array == snapshot).all()


async def test_duplicated_frame(faulty_pair):
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(duplicate={0}))
    assert got.reason is sent.reason is Reason.DUPLICATE


async def test_reordered_frames(faulty_pair):
    got, sent, dst, snapshot = await run_failing(faulty_pair, FaultPlan(reorder=((0, 1),)))
    assert got.reason is sent.reason is Reason.MISORDERED
    assert (dst.array == snapshot).all()


async def test_dropped_frame(faulty_pair):
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(drop={3}))
    assert got.reason is sent.reason is Reason.MISORDERED


async def test_corrupt_header(faulty_pair):
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(corrupt_header={2}))
    assert got.reason is sent.reason is Reason.BAD_HEADER


async def test_short_prompt_into_long_reservation_is_refused(pair):
    """The incident: a 1-token stub sent for a reservation sized for the whole prompt."""
    got, sent, dst, snapshot = await run_failing(pair, plan_changes={"num_tokens": 1})
    assert got.reason is sent.reason is Reason.LENGTH_MISMATCH
    assert (dst.array == snapshot).all()


async def test_commit_without_every_page(faulty_pair):
    """All page frames correct, but the commit claims fewer pages (coverage check)."""
    got, sent, _, _ = await run_failing(faulty_pair, FaultPlan(rewrite={7: {"page_index": 6}}))
    assert got.reason is sent.reason is Reason.INCOMPLETE


async def test_fence_then_late_frames_never_land(faulty_pair):
    receiver, sender, address = faulty_pair
    src, dst, target, plan = make_case()
    fut = receiver.expect(target)
    sender.arm(plan.reservation_id, FaultPlan(delay={2: 0.3}))  # frames 0, 1 land; the rest late
    send = asyncio.ensure_future(sender.send(address, plan, src.views()))
    for _ in range(200):
        if receiver.stats.frames_received >= 2:
            break
        await asyncio.sleep(0.01)
    await receiver.fence(target.reservation_id)
    after_fence = dst.snapshot()
    with pytest.raises(TransferError) as got:
        await fut
    assert got.value.reason is Reason.FENCED
    assert (after_fence[:2] == POISON_BYTE).all()  # what had landed is poisoned at once
    with pytest.raises(TransferError) as sent:
        await send
    assert sent.value.reason is Reason.FENCED
    await asyncio.sleep(0.1)
    assert (dst.array == after_fence).all()  # late frames were drained to scratch


async def test_fence_before_any_frame(pair):
    receiver, sender, address = pair
    src, dst, target, plan = make_case()
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    await receiver.fence(target.reservation_id)
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plan, src.views())
    assert sent.value.reason is Reason.FENCED
    with pytest.raises(TransferError):
        await fut
    assert (dst.array == snapshot).all()


async def test_rejection_does_not_disturb_other_reservations(pair):
    receiver, sender, address = pair
    good = [make_case(seed=i) for i in (20, 30)]
    futs = [receiver.expect(t) for _, _, t, _ in good]
    _, _, stale_target, _ = make_case()
    src, _, _, stale_plan = make_case()
    receiver.expect(stale_target)
    with pytest.raises(TransferError):
        await sender.send(address, stale_plan.__class__(**{
            **{f: getattr(stale_plan, f) for f in stale_plan.__dataclass_fields__},
            "reservation_id": stale_target.reservation_id, "epoch": 0}), src.views())
    for src_pages, _, _, plan in good:
        await sender.send(address, plan, src_pages.views())
    for (src_pages, dst, target, _), fut in zip(good, futs, strict=True):
        await fut
        assert (dst.array[: target.num_pages] == src_pages.array[: target.num_pages]).all()


async def test_receiver_deadline(pair):
    receiver, _, _ = pair
    _, dst, target, _ = make_case(deadline_s=0.2)
    snapshot = dst.snapshot()
    with pytest.raises(TransferError) as got:
        await asyncio.wait_for(receiver.expect(target), 2)
    assert got.value.reason is Reason.DEADLINE
    assert (dst.array == snapshot).all()


async def test_sender_to_nobody(pair):
    _, sender, address = pair
    src, _, _, plan = make_case()
    host_port = address.split("://")[1]
    with pytest.raises(TransferError) as sent:
        await sender.send(f"{sender.scheme}://127.0.0.1:1", plan, src.views())
    assert sent.value.reason is Reason.PEER_LOST
    assert host_port


async def test_invalid_plan(pair):
    _, sender, address = pair
    src, _, _, plan = make_case()
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plan, src.views()[:2])
    assert sent.value.reason is Reason.INVALID_PLAN


async def test_close_fails_pending_and_is_idempotent(pair):
    receiver, _, _ = pair
    _, _, target, _ = make_case()
    fut = receiver.expect(target)
    await receiver.close()
    await receiver.close()
    with pytest.raises(TransferError) as got:
        await fut
    assert got.value.reason is Reason.CLOSED


def test_torch_pages_are_accepted():
    torch = pytest.importorskip("torch")
    pool = torch.zeros((4, 2, 8, 4), dtype=torch.bfloat16)
    view = memoryview(pool[1].view(torch.uint8).numpy())
    assert np.frombuffer(view, np.uint8).size == 2 * 8 * 4 * 2
