"""Receiver-side bookkeeping shared by every transport: live expectations, header checks
against them, commit verification, fencing and poisoning. Transports do only the I/O:

    slot, nack = table.check_data(header, conn_id)   # before any payload byte is read
    # slot is None -> drain payload to scratch; else read into slot.dest(header) while
    # slot.live (checked synchronously right before every write)
    nack = table.data_done(slot, header)               # payload checksum
    reply = table.check_commit(header, conn_id)        # ACK or NACK frame bytes

`trace`, when set (the owning service's protocol trace; off by default), is called with
`(event, fields)` for each expectation registered (expect), DATA frame accepted (accept)
and its write ended (land), commit verified or refused (commit), slot failed (fail),
fence (fence) and frame refused (drop); `lease` is the reservation id. Every accepted
page is reported landed once no write into it can still happen: by `data_done`, or when
the failed slot is finalized (the writes in flight ended); never for a slot whose write's
end is unknown (QUARANTINED).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable

from .base import POISON_BYTE, EventCallback, ExpectedTransfer, TransferResult, TransportStats
from .errors import AuthError, Reason, TransferError
from .framing import (
    DEFERRED,
    MAX_NACK_DETAIL,
    FrameHeader,
    Kind,
    checksum,
    commit_digest,
    encode_header,
    mac_ok,
    reservation_bytes,
    tokens_in_page,
)

_FINISHED_MEMORY = 4096  # remember this many finished/fenced reservation ids


def nack_frame(reservation: bytes, epoch: int, reason: Reason, detail: str) -> bytes:
    payload = detail.encode()[:MAX_NACK_DETAIL]
    return encode_header(Kind.NACK, reservation, epoch, aux=int(reason),
                         payload_len=len(payload), payload_checksum=checksum(payload)) + payload


class Slot:
    """One live expectation. `live` is checked right before every write into its pages."""

    def __init__(self, target: ExpectedTransfer, key: bytes, fut: asyncio.Future) -> None:
        self.target = target
        self.key = key
        self.fut = fut
        self.live = True
        self.next_index = 0
        self.next_seq = 0
        self.page_checksums: dict[int, int] = {}  # page index -> checksum of what landed
        self.touched: set[int] = set()  # page indexes that may hold bytes of this transfer
        self.conn_id: int | None = None
        self.writing = 0  # writes in flight that cannot be stopped (UCX posted recv)
        self.failure: TransferError | None = None  # decided but waiting for writes to end
        self.quarantined = False  # a write whose end could not be established
        self.finalized = asyncio.Event()
        self.unlanded: set[int] = set()  # traced: pages accepted whose landing is not told
        self.started = time.perf_counter()
        self.deadline_handle: asyncio.TimerHandle | None = None
        self.views = [memoryview(b).cast("B") if memoryview(b).format != "B" else memoryview(b)
                      for b in target.page_buffers]

    def dest(self, header: FrameHeader) -> memoryview:
        self.touched.add(header.page_index)
        return self.views[header.page_index]


class ReceiveTable:
    def __init__(self, stats: TransportStats, on_event: EventCallback | None) -> None:
        self.stats = stats
        self._on_event = on_event
        self._slots: dict[bytes, Slot] = {}
        # Failed slots whose unstoppable writes have not ended yet. They stay known here
        # (fence() waits for them) until the writes ended and the pages were poisoned.
        self._draining: dict[bytes, Slot] = {}
        # Slots with a write whose end is unknown: fence() raises QUARANTINED for them.
        self._quarantined: collections.OrderedDict[bytes, Slot] = collections.OrderedDict()
        self._finished: collections.OrderedDict[bytes, Reason] = collections.OrderedDict()
        self._finished_page_bytes: dict[bytes, int] = {}  # same keys as _finished
        self.nack_sink = None  # callable(conn_id, frame_bytes): post a NACK on a connection
        self.trace: Callable[[str, dict], None] | None = None  # module docstring

    # -- registration ------------------------------------------------------------------
    def expect(self, target: ExpectedTransfer) -> asyncio.Future[TransferResult]:
        key = reservation_bytes(target.reservation_id)
        if key in self._slots:
            raise ValueError(f"reservation {target.reservation_id} is already expected")
        if key in self._draining or key in self._quarantined:
            raise ValueError(f"reservation {target.reservation_id} still has a write in flight")
        if target.num_tokens <= 0 or target.page_tokens <= 0 or target.page_bytes <= 0:
            raise ValueError("num_tokens, page_tokens and page_bytes must be positive")
        if len(target.page_buffers) != len(target.page_ids):
            raise ValueError("one page buffer per page id is required")
        if target.num_pages > len(target.page_ids):
            raise ValueError(f"{target.num_pages} pages needed, {len(target.page_ids)} leased")
        loop = asyncio.get_running_loop()
        slot = Slot(target, key, loop.create_future())
        for view in slot.views:
            if view.readonly or view.nbytes != target.page_bytes:
                raise ValueError(f"page buffers must be writable and {target.page_bytes} bytes")
        self._finished.pop(key, None)
        self._finished_page_bytes.pop(key, None)
        self._slots[key] = slot
        slot.deadline_handle = loop.call_later(
            max(0.0, target.deadline_s), self.fail, slot, Reason.DEADLINE,
            f"no verified commit within {target.deadline_s}s")
        if self.trace is not None:
            self.trace("expect", {"lease": target.reservation_id, "epoch": target.epoch,
                                  "pages": target.num_pages})
        return slot.fut

    def page_bytes_for(self, reservation: bytes) -> int:
        """The page size of the named reservation, live or recently ended; for one this
        table does not know, the largest page of any live transfer (0 when none is)."""
        slot = self._slots.get(reservation)
        if slot is not None:
            return slot.target.page_bytes
        known = self._finished_page_bytes.get(reservation)
        if known is not None:
            return known
        return max((s.target.page_bytes for s in self._slots.values()), default=0)

    def bound_to(self, conn_id: int) -> bool:
        return self.bound_slot(conn_id) is not None

    def bound_slot(self, conn_id: int) -> Slot | None:
        """The live slot whose frames come on connection `conn_id`, if any."""
        return next((s for s in self._slots.values() if s.conn_id == conn_id), None)

    # -- frame checks (before any payload byte touches destination memory) --------------
    def authenticate(self, h: FrameHeader) -> None:
        """Raises AuthError when `h` names a live reservation and its MAC does not verify
        under that reservation's key: nothing about the reservation changes (the caller
        drops the frame and closes the connection). Frames naming no live reservation
        cannot be verified; they change nothing either (answered with a NACK)."""
        slot = self._slots.get(h.reservation)
        if slot is not None and not mac_ok(h, slot.target.key):  # guard: frame-mac
            raise AuthError(f"{h.kind.name} frame {h.seq}: MAC does not verify")

    def vouch(self, h: FrameHeader) -> tuple[Reason, str]:
        """Whether `h` proves that its sender holds the key of a live reservation: what a
        link set-up that lends the peer something (nixl's staging region) asks before any
        frame. OK; the reason a known reservation ended, or UNKNOWN_RESERVATION; or
        UNAUTHENTICATED (the MAC does not verify under the reservation's key)."""
        slot = self._slots.get(h.reservation)
        if slot is None:
            return (self._finished.get(h.reservation, Reason.UNKNOWN_RESERVATION),
                    "no live expectation for this reservation")
        if not mac_ok(h, slot.target.key):
            return Reason.UNAUTHENTICATED, "link proof: MAC does not verify"
        return Reason.OK, ""

    def check_data(self, h: FrameHeader, conn_id: int) -> tuple[Slot | None, bytes | None]:
        slot = self._slots.get(h.reservation)
        if slot is None:
            reason = self._finished.get(h.reservation, Reason.UNKNOWN_RESERVATION)
            return None, self._reject(h, reason, "no live expectation for this reservation")
        t = slot.target
        reason, detail = Reason.OK, ""
        if h.epoch != t.epoch:  # guard: epoch
            reason, detail = Reason.STALE_EPOCH, f"epoch {h.epoch} != live {t.epoch}"
        elif slot.conn_id is not None and slot.conn_id != conn_id:
            reason, detail = Reason.DUPLICATE, "frames for this reservation on two connections"
        elif h.seq < slot.next_seq or h.page_index < slot.next_index:
            reason, detail = Reason.DUPLICATE, f"page {h.page_index} seq {h.seq} already seen"
        elif h.seq > slot.next_seq or h.page_index > slot.next_index:
            reason = Reason.MISORDERED
            detail = f"page {h.page_index} seq {h.seq}, expected {slot.next_index}/{slot.next_seq}"
        elif h.page_index >= t.num_pages or h.dest_page_id != t.page_ids[h.page_index]:
            reason, detail = Reason.OUT_OF_RANGE, f"page {h.page_index} -> id {h.dest_page_id}"
        elif h.payload_len != t.page_bytes:
            reason, detail = Reason.LENGTH_MISMATCH, f"payload {h.payload_len} != {t.page_bytes}"
        elif h.token_count != tokens_in_page(  # guard: commit-verification.frame
                h.page_index, t.num_tokens, t.page_tokens):
            reason, detail = Reason.LENGTH_MISMATCH, f"page {h.page_index}: {h.token_count} tokens"
        if reason is not Reason.OK:
            self.fail(slot, reason, detail, notify=False)
            return None, self._reject(h, reason, detail)
        slot.conn_id = conn_id
        slot.next_seq += 1
        slot.next_index += 1
        if self.trace is not None:
            slot.unlanded.add(h.page_index)
            # the frame's own epoch (the check above made it the slot's): a trace checker
            # then sees a frame of another epoch accepted, were that check ever lost
            self.trace("accept", {"lease": t.reservation_id, "epoch": h.epoch,
                                  "index": h.page_index})
        return slot, None

    def data_done(self, slot: Slot, h: FrameHeader, actual: int | None = None) -> bytes | None:
        """The payload of a checked DATA frame landed in its page: verify its checksum.
        `actual`: the landed page's checksum when the caller already computed it (after the
        write into the page ended). A `DEFERRED` frame carries none: the page's checksum is
        recorded and the COMMIT's digest (`check_commit`) verifies it."""
        if self.trace is not None:
            self._landed(slot, h.page_index)
        if not slot.live:
            return None
        self.stats.frames_received += 1
        self.stats.bytes_received += h.payload_len
        if actual is None:
            actual = checksum(slot.views[h.page_index])
        if not h.flags & DEFERRED and actual != h.payload_checksum:
            detail = f"page {h.page_index} checksum {actual:#x} != {h.payload_checksum:#x}"
            self.fail(slot, Reason.BAD_CHECKSUM, detail, notify=False)
            return self._reject(h, Reason.BAD_CHECKSUM, detail)
        slot.page_checksums[h.page_index] = actual
        return None

    def check_commit(self, h: FrameHeader, conn_id: int) -> bytes:
        slot = self._slots.get(h.reservation)
        if slot is None:
            reason = self._finished.get(h.reservation, Reason.UNKNOWN_RESERVATION)
            if self.trace is not None:
                self.trace("commit", {"lease": str(uuid.UUID(bytes=h.reservation)),
                                      "epoch": h.epoch, "ok": False, "reason": reason.name})
            return self._reject(h, reason, "commit for no live expectation")
        t = slot.target
        reason, detail = Reason.OK, ""
        if h.epoch != t.epoch:
            reason, detail = Reason.STALE_EPOCH, f"epoch {h.epoch} != live {t.epoch}"
        elif slot.conn_id != conn_id or h.seq != slot.next_seq:
            reason, detail = Reason.MISORDERED, f"commit seq {h.seq}, expected {slot.next_seq}"
        elif h.token_count != t.num_tokens:  # guard: commit-verification
            reason, detail = Reason.LENGTH_MISMATCH, f"{h.token_count} tokens != {t.num_tokens}"
        elif (h.page_index != t.num_pages  # guard: commit-verification.pages
              or len(slot.page_checksums) != t.num_pages):
            reason = Reason.INCOMPLETE
            detail = f"{len(slot.page_checksums)} of {t.num_pages} pages written"
        elif h.payload_checksum != commit_digest(  # guard: commit-digest
                [slot.page_checksums.get(i, 0) for i in range(t.num_pages)]):
            reason, detail = Reason.BAD_CHECKSUM, "commit digest mismatch"
        if reason is not Reason.OK:
            if self.trace is not None:
                self.trace("commit", {"lease": t.reservation_id, "epoch": t.epoch,
                                      "ok": False, "reason": reason.name})
            self.fail(slot, reason, detail, notify=False)
            return self._reject(h, reason, detail)
        if self.trace is not None:
            self.trace("commit", {"lease": t.reservation_id, "epoch": t.epoch, "ok": True,
                                  "reason": ""})
        self._finish(slot, Reason.OK)
        written = t.page_ids[: t.num_pages]
        result = TransferResult(t.reservation_id, t.epoch, t.num_tokens, h.aux, written,
                                t.num_pages * t.page_bytes, time.perf_counter() - slot.started)
        self.stats.transfers_committed += 1
        if not slot.fut.done():
            slot.fut.set_result(result)
        self._event("committed", t.reservation_id, None)
        return encode_header(Kind.ACK, h.reservation, h.epoch, token_count=t.num_tokens,
                             key=t.key)

    def check_abort(self, h: FrameHeader, conn_id: int) -> None:
        """A NACK from a sender (`authenticate` verified its MAC when it names a live
        reservation): its producer gave up part-way (a streamed send, ABORTED). The live
        slot it names fails at once, unless the epoch differs or the slot's frames come on
        another connection; nothing else changes."""
        slot = self._slots.get(h.reservation)
        if slot is None or h.epoch != slot.target.epoch or slot.conn_id not in (None, conn_id):
            return
        self.fail(slot, Reason.ABORTED, "the sender's producer gave up", notify=False)

    # -- failure paths -----------------------------------------------------------------
    def fail(self, slot: Slot, reason: Reason, detail: str = "", notify: bool = True) -> None:
        """Stop writing into the slot's pages at once; poison what it touched; fail its
        future (deferred until unstoppable in-flight writes end). notify: NACK the peer."""
        if not slot.live:
            return
        slot.live = False
        slot.failure = TransferError(slot.target.reservation_id, reason, detail)
        if self.trace is not None:
            self.trace("fail", {"lease": slot.target.reservation_id,
                                "epoch": slot.target.epoch, "reason": reason.name})
        self._finish(slot, reason)
        if notify and slot.conn_id is not None and self.nack_sink is not None:
            self.nack_sink(slot.conn_id, nack_frame(slot.key, slot.target.epoch, reason, detail))
        if slot.writing == 0:
            self._finalize(slot)

    def write_started(self, slot: Slot) -> None:
        """An unstoppable write (a posted receive) into the slot's pages begins."""
        slot.writing += 1

    def write_ended(self, slot: Slot) -> None:
        """An unstoppable write (posted receive) into the slot's pages completed."""
        if slot.quarantined:
            return  # already finalized as QUARANTINED; its pages are never leased again
        slot.writing -= 1
        if slot.writing == 0 and slot.failure is not None and not slot.finalized.is_set():
            self._finalize(slot)

    def write_unknown(self, slot: Slot, detail: str) -> None:
        """The transport could not establish that a write into the slot's pages ended (the
        receive neither completed nor was cancelled in time, even with its link torn
        down). The slot fails QUARANTINED: its pages must never be leased again, and
        `fence()` raises so that its owner keeps them out of the pool."""
        slot.quarantined = True
        if slot.live:
            self.fail(slot, Reason.QUARANTINED, detail, notify=False)
        slot.failure = TransferError(slot.target.reservation_id, Reason.QUARANTINED, detail)
        slot.writing = 0
        self._finalize(slot)
        self._quarantined[slot.key] = slot
        while len(self._quarantined) > _FINISHED_MEMORY:
            self._quarantined.popitem(last=False)

    def _finalize(self, slot: Slot) -> None:
        err = slot.failure
        assert err is not None and slot.writing == 0
        if self.trace is not None and not slot.quarantined:
            for index in sorted(slot.unlanded):  # no write into them can happen any more
                self._landed(slot, index)
        if self._draining.get(slot.key) is slot:
            del self._draining[slot.key]
        poisoned = []
        for index in sorted(slot.touched):
            slot.views[index][:] = bytes([POISON_BYTE]) * slot.target.page_bytes
            poisoned.append(slot.target.page_ids[index])
        err.pages_poisoned = tuple(poisoned)
        self.stats.transfers_failed += 1
        if not slot.fut.done():
            slot.fut.set_exception(err)
            if err.reason in (Reason.FENCED, Reason.CLOSED):
                slot.fut.exception()  # the owner asked for it: no "never retrieved" noise
        slot.finalized.set()
        self._event("failed", slot.target.reservation_id, err.reason)

    def _finish(self, slot: Slot, reason: Reason) -> None:
        slot.live = False
        if slot.deadline_handle is not None:
            slot.deadline_handle.cancel()
        if self._slots.get(slot.key) is slot:
            del self._slots[slot.key]
            if reason is not Reason.OK and slot.writing:
                self._draining[slot.key] = slot
        self._remember(slot.key, Reason.FENCED if reason is Reason.OK else reason,
                       slot.target.page_bytes)
        if reason is Reason.OK:
            slot.finalized.set()

    def _remember(self, key: bytes, reason: Reason, page_bytes: int = 0) -> None:
        self._finished[key] = reason
        self._finished.move_to_end(key)
        self._finished_page_bytes[key] = max(page_bytes, self._finished_page_bytes.get(key, 0))
        while len(self._finished) > _FINISHED_MEMORY:
            old, _ = self._finished.popitem(last=False)
            self._finished_page_bytes.pop(old, None)

    def _reject(self, h: FrameHeader, reason: Reason, detail: str) -> bytes:
        self.stats.frames_rejected[reason] += 1
        self._event("rejected_frame", str(uuid.UUID(bytes=h.reservation)), reason)
        if self.trace is not None:
            self.dropped(h, reason)
        return nack_frame(h.reservation, h.epoch, reason, detail)

    def dropped(self, h: FrameHeader | None, reason: Reason) -> None:
        """Trace a refused frame (`h` None: its header could not be decoded)."""
        if self.trace is not None:
            lease = str(uuid.UUID(bytes=h.reservation)) if h is not None else ""
            self.trace("drop", {"lease": lease, "epoch": h.epoch if h is not None else 0,
                                "reason": reason.name})

    def _landed(self, slot: Slot, index: int) -> None:
        if index in slot.unlanded and self.trace is not None:
            slot.unlanded.discard(index)
            self.trace("land", {"lease": slot.target.reservation_id,
                                "epoch": slot.target.epoch, "index": index})

    async def fence(self, reservation_id: str) -> None:
        """Fail the live slot (FENCED) and return only once no write into its pages can
        still happen: a slot that already failed but still has a write in flight is waited
        for too. Raises TransferError(QUARANTINED) when a write's end is unknown."""
        key = reservation_bytes(reservation_id)
        slot = self._slots.get(key)
        if slot is not None:
            self.fail(slot, Reason.FENCED, "fenced by the receiver")  # guard: fence
        else:
            slot = self._draining.get(key) or self._quarantined.get(key)  # guard: fence-inflight
            if slot is None:
                self._remember(key, Reason.FENCED)
                if self.trace is not None:
                    self.trace("fence", {"lease": reservation_id, "ok": True})
                return
        try:
            await slot.finalized.wait()
        except BaseException:  # cancelled while a write was in flight
            if self.trace is not None:
                self.trace("fence", {"lease": reservation_id, "ok": False})
            raise
        if slot.quarantined:
            if self.trace is not None:
                self.trace("fence", {"lease": reservation_id, "ok": False})
            raise TransferError(reservation_id, Reason.QUARANTINED,
                                "a write into these pages may still land: never lease them "
                                "again", tuple(slot.target.page_ids))
        if self.trace is not None:
            self.trace("fence", {"lease": reservation_id, "ok": True})

    def conn_lost(self, conn_id: int, reason: Reason, detail: str) -> None:
        for slot in [s for s in self._slots.values() if s.conn_id == conn_id]:
            self.fail(slot, reason, detail, notify=False)

    def close(self) -> None:
        for slot in list(self._slots.values()):
            self.fail(slot, Reason.CLOSED, "transport closed", notify=False)

    def _event(self, event: str, reservation_id: str, reason: Reason | None) -> None:
        if self._on_event is not None:
            self._on_event(event, reservation_id, reason)
