"""The fault-injecting wrapper: faults come from outside the transports, armed per send."""

from __future__ import annotations

import pytest

from pdmesh.transports import (
    FaultInjectingTransport,
    FaultPlan,
    KVTransport,
    Reason,
    TransferError,
    make_transport,
)
from pdmesh.transports.core import Cut, Delay, Frame
from pdmesh.transports.framing import HEADER_SIZE
from tests.support.transport_cases import make_case

PROGRESS_S = 0.5


async def test_bare_transports_carry_no_faults(kind):
    bare = make_transport(kind)
    wrapped = make_transport(kind, faults=True)
    try:
        assert not hasattr(bare, "faults") and not hasattr(bare, "arm")
        assert isinstance(wrapped, FaultInjectingTransport)
        assert isinstance(wrapped, KVTransport)
        assert not hasattr(wrapped.inner, "faults") and type(wrapped.inner) is type(bare)
        assert await wrapped.start() == wrapped.address == wrapped.inner.address
        assert wrapped.scheme == bare.scheme and wrapped.stats is wrapped.inner.stats
    finally:
        await wrapped.close()
        await bare.close()


async def test_wrapping_a_transport_built_elsewhere(kind):
    receiver = make_transport(kind, progress_timeout_s=PROGRESS_S)
    sender = FaultInjectingTransport(make_transport(kind, progress_timeout_s=PROGRESS_S))
    try:
        address = await receiver.start()
        await sender.start()
        with pytest.raises(ValueError, match="already has a frame hook"):
            FaultInjectingTransport(sender.inner)
        with pytest.raises(TypeError):
            FaultInjectingTransport(object())  # type: ignore[arg-type]
        src, _, target, plan = make_case()
        fut = receiver.expect(target)
        sender.arm(plan.reservation_id, FaultPlan(corrupt={2: 7}))
        with pytest.raises(TransferError) as sent:
            await sender.send(address, plan, src.views())
        assert sent.value.reason is Reason.BAD_CHECKSUM
        with pytest.raises(TransferError) as got:
            await fut
        assert got.value.reason is Reason.BAD_CHECKSUM
    finally:
        await sender.close()
        await receiver.close()


async def test_armed_plan_hits_the_next_send_of_its_reservation_only(faulty_pair):
    receiver, sender, address = faulty_pair
    cases = [make_case(num_tokens=40, seed=10 * i) for i in range(4)]
    futs = [receiver.expect(target) for _, _, target, _ in cases]
    plans = [plan for _, _, _, plan in cases]
    sender.arm(plans[1].reservation_id, FaultPlan(corrupt={0: 3}))
    sender.arm(plans[3].reservation_id, FaultPlan(drop={0}))
    sender.arm(plans[3].reservation_id, None)  # disarmed again
    await sender.send(address, plans[0], cases[0][0].views())  # another reservation: clean
    with pytest.raises(TransferError) as sent:
        await sender.send(address, plans[1], cases[1][0].views())
    assert sent.value.reason is Reason.BAD_CHECKSUM
    for src, _, _, plan in (cases[2], cases[3]):  # the plan was used once, then gone
        await sender.send(address, plan, src.views())
    for i in (0, 2, 3):
        src, dst, target, _ = cases[i]
        await futs[i]
        assert (dst.array[: target.num_pages] == src.array[: target.num_pages]).all()
    with pytest.raises(TransferError):
        await futs[1]


async def test_arm_next_hits_one_send_whatever_its_reservation(faulty_pair):
    receiver, sender, address = faulty_pair
    cases = [make_case(num_tokens=40, seed=10 * i) for i in range(2)]
    futs = [receiver.expect(target) for _, _, target, _ in cases]
    sender.arm_next(FaultPlan(duplicate={0}))
    with pytest.raises(TransferError) as sent:
        await sender.send(address, cases[0][3], cases[0][0].views())
    assert sent.value.reason is Reason.DUPLICATE
    await sender.send(address, cases[1][3], cases[1][0].views())
    await futs[1]
    with pytest.raises(TransferError):
        await futs[0]


def _frames(n: int, page: int) -> list[Frame]:
    frames = [Frame(i, bytes([i]) * HEADER_SIZE, memoryview(bytes(page))) for i in range(n)]
    return [*frames, Frame(n, bytes([n]) * HEADER_SIZE, b"")]


def test_schedule_orders_delays_and_cuts():
    frames = _frames(3, 100)
    items = FaultPlan(delay={1: 0.5}, drop={2}, duplicate={0}).schedule(frames)
    assert [type(i).__name__ for i in items] == ["Frame", "Frame", "Delay", "Frame", "Frame"]
    assert [i.index for i in items if isinstance(i, Frame)] == [0, 0, 1, 3]
    assert isinstance(items[2], Delay) and items[2].seconds == 0.5
    cut = FaultPlan(truncate_after=HEADER_SIZE + 100 + HEADER_SIZE + 30).schedule(frames)
    assert [i.index for i in cut[:-1]] == [0]
    assert isinstance(cut[-1], Cut) and not cut[-1].reset
    assert len(cut[-1].whole) == 1 and cut[-1].partial.nbytes == 30
    reset = FaultPlan(reset_after=10).schedule(frames)
    assert len(reset) == 1 and reset[0].reset and reset[0].whole == ()
    assert bytes(reset[0].partial) == bytes(10)
    assert FaultPlan(truncate_after=10**9).schedule(frames) == frames
