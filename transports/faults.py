"""Test-only fault injection for senders. Off by default (`faults=None`).

A transport's sender builds the frames of one transfer in order (DATA for page 0..n-1,
then COMMIT; `index` counts them from 0) and, when given a `FaultPlan`, sends what
`FaultPlan.apply()` returns instead. Used by the conformance suite and the isolation suite.

    FaultPlan(corrupt={1: 10})        # flip byte 10 of frame 1's payload (copied first)
    FaultPlan(drop={2})               # frame 2 never sent
    FaultPlan(duplicate={0})          # frame 0 sent twice
    FaultPlan(reorder=((1, 2),))      # frames 1 and 2 swapped
    FaultPlan(delay={1: 2.0})         # sleep 2 s before frame 1 (a stalled sender)
    FaultPlan(rewrite={0: {"epoch": 7}})  # re-encode frame 0's header with other fields
    FaultPlan(corrupt_header={0})     # flip a header byte (header checksum fails)
    FaultPlan(truncate_after=5000)    # stop after 5000 bytes, close cleanly (FIN)
    FaultPlan(reset_after=5000)       # stop after 5000 bytes, reset (RST)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .framing import HEADER_SIZE, decode_header, encode_header


@dataclasses.dataclass(slots=True)
class Frame:
    index: int
    header: bytes
    payload: memoryview | bytes


@dataclasses.dataclass(slots=True)
class Delay:
    seconds: float


@dataclasses.dataclass(frozen=True)
class FaultPlan:
    drop: frozenset[int] | set[int] = frozenset()
    duplicate: frozenset[int] | set[int] = frozenset()
    reorder: tuple[tuple[int, int], ...] = ()
    corrupt: Mapping[int, int] = dataclasses.field(default_factory=dict)
    corrupt_header: frozenset[int] | set[int] = frozenset()
    rewrite: Mapping[int, Mapping[str, int | bytes]] = dataclasses.field(default_factory=dict)
    delay: Mapping[int, float] = dataclasses.field(default_factory=dict)
    truncate_after: int | None = None
    reset_after: int | None = None

    @property
    def cut_after(self) -> int | None:
        return self.reset_after if self.reset_after is not None else self.truncate_after

    def apply(self, frames: list[Frame]) -> list[Frame | Delay]:
        frames = [self._mutate(f) for f in frames]
        for a, b in self.reorder:
            frames[a], frames[b] = frames[b], frames[a]
        out: list[Frame | Delay] = []
        for f in frames:
            if f.index in self.delay:
                out.append(Delay(self.delay[f.index]))
            if f.index in self.drop:
                continue
            out.append(f)
            if f.index in self.duplicate:
                out.append(f)
        return out

    def _mutate(self, f: Frame) -> Frame:
        header, payload = f.header, f.payload
        if f.index in self.rewrite:
            fields = decode_header(header)._asdict()
            fields.update(self.rewrite[f.index])
            header = encode_header(**fields)
        if f.index in self.corrupt:
            copy = bytearray(payload)
            copy[self.corrupt[f.index] % len(copy)] ^= 0x01
            payload = bytes(copy)
        if f.index in self.corrupt_header:
            copy = bytearray(header)
            copy[HEADER_SIZE // 2] ^= 0x40
            header = bytes(copy)
        return Frame(f.index, header, payload)
