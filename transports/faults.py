"""Test-only fault injection for senders, from outside the transports.

`FaultInjectingTransport` wraps a real transport (TCP or UCX) and is chosen at
construction only where faults are wanted; production builds a bare transport, which has
no fault attribute and no frame hook. The wrapper delegates the whole `KVTransport`
protocol to the transport inside; a `FaultPlan` armed for a send makes that one transfer go
out wrong. It acts on the frames as the sender emits them through the frame hook
(`frame_filter`, core.py) that the wrapper hands to the inner transport: to its
constructor when the wrapper builds it, else before the transport's first send.

    transport = make_transport("tcp", faults=True)       # a FaultInjectingTransport
    transport = FaultInjectingTransport(make_transport("tcp"))   # the same, wrapping one
    transport.arm(plan.reservation_id, FaultPlan(drop={2}))
    await transport.send(address, plan, buffers)          # frame 2 never sent
    transport.arm_next(FaultPlan(delay={1: 0.5}))         # the next send, any reservation

`arm(reservation_id, plan)` applies to the next `send()` of that reservation only (prefill
arms right before it sends; `plan=None` disarms); `arm_next(plan)` to the next send
whatever its reservation, when none is armed for that one. A send takes its plan when it
starts, so a plan is used at most once even when the send fails early.

The frames of one transfer are numbered in order (DATA for page 0..n-1, then COMMIT;
`index` counts them from 0):

    FaultPlan(corrupt={1: 10})        # flip byte 10 of frame 1's payload (copied first)
    FaultPlan(drop={2})               # frame 2 never sent
    FaultPlan(duplicate={0})          # frame 0 sent twice
    FaultPlan(reorder=((1, 2),))      # frames 1 and 2 swapped
    FaultPlan(delay={1: 2.0})         # sleep 2 s before frame 1 (a stalled sender)
    FaultPlan(stall_payload={1: 2.0})  # frame 1's header, 2 s, then its payload (a write
                                       # the receiver has already accepted and posted)
    FaultPlan(rewrite={0: {"epoch": 7}})  # re-encode frame 0's header with other fields
    FaultPlan(corrupt_header={0})     # flip a header byte (header checksum fails)
    FaultPlan(truncate_after=5000)    # stop after 5000 bytes, close cleanly (FIN)
    FaultPlan(reset_after=5000)       # stop after 5000 bytes, reset (RST)

Used by the conformance suite, the isolation suite and test meshes (services/faults.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .base import (
    ExpectedTransfer,
    KVTransport,
    PagesReady,
    TransferAck,
    TransferPlan,
    TransferResult,
    TransportStats,
)
from .core import Cut, Delay, Frame, FrameFilter, SendItem, TransportCore
from .framing import HEADER_SIZE, decode_header, encode_header


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    drop: frozenset[int] | set[int] = frozenset()
    duplicate: frozenset[int] | set[int] = frozenset()
    reorder: tuple[tuple[int, int], ...] = ()
    corrupt: Mapping[int, int] = dataclasses.field(default_factory=dict)
    corrupt_header: frozenset[int] | set[int] = frozenset()
    rewrite: Mapping[int, Mapping[str, int | bytes]] = dataclasses.field(default_factory=dict)
    delay: Mapping[int, float] = dataclasses.field(default_factory=dict)
    stall_payload: Mapping[int, float] = dataclasses.field(default_factory=dict)
    truncate_after: int | None = None
    reset_after: int | None = None

    def schedule(self, frames: list[Frame]) -> list[SendItem]:
        """What the sender emits instead of `frames`: mutated, reordered, delayed, dropped
        and duplicated frames, ending in a `Cut` when the stream is cut short."""
        frames = [self._mutate(f) for f in frames]
        for a, b in self.reorder:
            frames[a], frames[b] = frames[b], frames[a]
        out: list[SendItem] = []
        for f in frames:
            if f.index in self.delay:
                out.append(Delay(self.delay[f.index]))
            if f.index in self.drop:
                continue
            if f.index in self.stall_payload and len(f.payload):
                # The header alone, a pause, then the payload alone (an empty header).
                out += [Frame(f.index, f.header, b""), Delay(self.stall_payload[f.index]),
                        Frame(f.index, b"", f.payload)]
                continue
            out.append(f)
            if f.index in self.duplicate:
                out.append(f)
        return self._cut(out)

    def _cut(self, items: list[SendItem]) -> list[SendItem]:
        budget = self.reset_after if self.reset_after is not None else self.truncate_after
        if budget is None:
            return items
        for i, item in enumerate(items):
            if not isinstance(item, Frame):
                continue
            whole: list[bytes | memoryview] = []
            for buf in (item.header, item.payload):
                view = memoryview(buf)
                if view.nbytes >= budget:
                    return [*items[:i], Cut(tuple(whole), view[:budget],
                                            reset=self.reset_after is not None)]
                budget -= view.nbytes
                whole.append(buf)
        return items

    def _mutate(self, f: Frame) -> Frame:
        header, payload = f.header, f.payload
        if f.index in self.rewrite:
            fields = decode_header(header)._asdict()
            fields.update(self.rewrite[f.index])
            header = encode_header(**fields, key=f.key)
        if f.index in self.corrupt:
            copy = bytearray(payload)
            copy[self.corrupt[f.index] % len(copy)] ^= 0x01
            payload = bytes(copy)
        if f.index in self.corrupt_header:
            copy = bytearray(header)
            copy[HEADER_SIZE // 2] ^= 0x40
            header = bytes(copy)
        return Frame(f.index, header, payload, f.key)


class FaultInjectingTransport:
    """A `KVTransport` that delegates to the transport inside and sends a transfer wrong
    when a `FaultPlan` was armed for it (see the module docstring). Other attributes
    (`scheme`, `address`, ...) are read from the inner transport.

    `inner` is either a builder, called with the frame hook to pass to the transport's
    constructor (what `make_transport(kind, faults=True)` does), or a TCP/UCX transport
    built without a hook, which then gets this wrapper's hook before it sends anything."""

    def __init__(self, inner: KVTransport | Callable[[FrameFilter], KVTransport]) -> None:
        self._armed: dict[str, FaultPlan] = {}
        self._next: FaultPlan | None = None
        self._sending: dict[str, FaultPlan] = {}  # plans of the sends in flight
        if isinstance(inner, TransportCore):
            if inner._frame_filter is not None:
                raise ValueError("the transport already has a frame hook")
            inner._frame_filter = self._schedule_for
            self.inner: KVTransport = inner
        elif callable(inner):
            self.inner = inner(self._schedule_for)
        else:
            raise TypeError(f"cannot inject faults into {type(inner).__name__}")

    def arm(self, reservation_id: str, plan: FaultPlan | None) -> None:
        """Send the next transfer of `reservation_id` according to `plan` (None: disarm)."""
        if plan is None:
            self._armed.pop(reservation_id, None)
        else:
            self._armed[reservation_id] = plan

    def arm_next(self, plan: FaultPlan | None) -> None:
        """Send the next transfer, whatever its reservation, according to `plan`."""
        self._next = plan

    def _schedule_for(
        self, plan: TransferPlan,
    ) -> Callable[[list[Frame]], Iterable[SendItem]] | None:
        """The frame hook: the plan of this send, if it has one."""
        fault = self._sending.get(plan.reservation_id)
        return fault.schedule if fault is not None else None

    # -- KVTransport -------------------------------------------------------------------
    @property
    def stats(self) -> TransportStats:
        return self.inner.stats

    async def start(self) -> str:
        return await self.inner.start()

    def expect(self, target: ExpectedTransfer) -> asyncio.Future[TransferResult]:
        return self.inner.expect(target)

    async def fence(self, reservation_id: str) -> None:
        await self.inner.fence(reservation_id)

    async def send(self, address: str, plan: TransferPlan, page_buffers: Sequence[memoryview],
                   ready: PagesReady | None = None) -> TransferAck:
        """`ready` is passed on: without a fault plan the send streams as usual; a send with
        a fault plan connects at once, waits for every page to be final, then sends the
        scheduled frames (frame numbers count the whole transfer)."""
        rid = plan.reservation_id
        fault = self._armed.pop(rid, None)
        if fault is None:
            fault, self._next = self._next, None
        if fault is None:
            return await self.inner.send(address, plan, page_buffers, ready)
        self._sending[rid] = fault
        try:
            return await self.inner.send(address, plan, page_buffers, ready)
        finally:
            self._sending.pop(rid, None)

    async def close(self) -> None:
        self._armed.clear()
        self._next = None
        await self.inner.close()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not built yet
            raise AttributeError(name)
        return getattr(self.inner, name)
