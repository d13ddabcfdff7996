"""What the TCP and UCX transports share: addresses, frame building, and the parts of the
`KVTransport` contract that do not depend on the wire (task ownership, the receive table,
the sender's deadline/events/stats around one transfer, the close sequence).

A concrete transport supplies `start()`, `_deliver()` (send the frames of one transfer on a
connection and return when the receiver acked) and `_close_links()`.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Iterable, Sequence

from .base import (
    EventCallback, ExpectedTransfer, TransferAck, TransferPlan, TransferResult, TransportStats,
    validate_plan,
)
from .errors import Reason, TransferError
from .faults import FaultPlan, Frame
from .framing import (
    Kind, checksum, commit_digest, encode_header, reservation_bytes, tokens_in_page,
)
from .receiver import ReceiveTable


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """`scheme://host:port` -> (host, port); ValueError otherwise."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    host, _, port = address[len(prefix):].rpartition(":")
    return host.strip("[]"), int(port)


def build_frames(plan: TransferPlan, key: bytes, views: list[memoryview]) -> Iterable[Frame]:
    """DATA frames for each page (checksummed as they are produced), then the COMMIT."""
    sums = []
    for i, view in enumerate(views):
        digest = checksum(view)
        sums.append(digest)
        header = encode_header(
            Kind.DATA, key, plan.epoch, seq=i, dest_page_id=plan.dest_page_ids[i], page_index=i,
            token_count=tokens_in_page(i, plan.num_tokens, plan.page_tokens),
            payload_len=view.nbytes, payload_checksum=digest)
        yield Frame(i, header, view)
    n = len(views)
    yield Frame(n, encode_header(Kind.COMMIT, key, plan.epoch, seq=n, page_index=n,
                                 token_count=plan.num_tokens, aux=plan.first_token,
                                 payload_checksum=commit_digest(sums)), b"")


def reason_of(code: int) -> Reason:
    """A NACK's reason code; an unknown one reads as BAD_HEADER."""
    try:
        return Reason(code)
    except ValueError:
        return Reason.BAD_HEADER


class TransportCore:
    """Shared state and behaviour of the transports (see the module docstring)."""

    scheme = ""
    # TCP streams frames as they are built (checksums overlap the sends); UCX needs them all.
    lazy_frames = False

    def __init__(self, host: str, port: int, *, progress_timeout_s: float,
                 on_event: EventCallback | None, faults: FaultPlan | None) -> None:
        self.host, self.port = host, port
        self.progress_timeout_s = progress_timeout_s
        self.faults = faults  # test-only: applied to every send of this transport
        self.stats = TransportStats()
        self._on_event = on_event
        self._table = ReceiveTable(self.stats, on_event)
        self._table.nack_sink = self._post_nack
        self._listener = None
        self._tasks: set[asyncio.Task] = set()
        self._idle: dict[str, list] = {}
        self._closed = False
        self.address = ""

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        """An owned task: kept until done, cancelled and awaited by close()."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _event(self, event: str, rid: str, reason: Reason | None) -> None:
        if self._on_event is not None:
            self._on_event(event, rid, reason)

    # -- receiver ----------------------------------------------------------------------
    def expect(self, target: ExpectedTransfer) -> asyncio.Future[TransferResult]:
        if self._closed:
            raise RuntimeError("transport is closed")
        return self._table.expect(target)

    async def fence(self, reservation_id: str) -> None:
        await self._table.fence(reservation_id)

    def _post_nack(self, conn_id: int, frame: bytes) -> None:
        raise NotImplementedError

    # -- sender ------------------------------------------------------------------------
    async def send(self, address: str, plan: TransferPlan,
                   page_buffers: Sequence[memoryview]) -> TransferAck:
        views = validate_plan(plan, page_buffers)
        rid = plan.reservation_id
        try:
            key = reservation_bytes(rid)
            frames = build_frames(plan, key, views)
            if self.faults is not None or not self.lazy_frames:
                frames = list(frames)
        except (ValueError, struct.error) as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(plan.deadline_s):
                await self._deliver(address, plan, key, frames)
        except TimeoutError:
            self._event("send_failed", rid, Reason.DEADLINE)
            raise TransferError(rid, Reason.DEADLINE,
                                f"no ack within {plan.deadline_s}s") from None
        except TransferError as exc:
            self._event("send_failed", rid, exc.reason)
            raise
        self.stats.transfers_sent += 1
        self._event("sent", rid, None)
        return TransferAck(rid, plan.epoch, plan.num_tokens, plan.num_pages * plan.page_bytes,
                           time.perf_counter() - started)

    async def _deliver(self, address: str, plan: TransferPlan, key: bytes, frames) -> None:
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------
    async def close(self) -> None:
        """Idempotent: fail live expectations, stop listening, cancel and await every
        task, then close every connection."""
        if self._closed:
            return
        self._closed = True
        self._table.close()
        if self._listener is not None:
            self._listener.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close_links()
        self._idle.clear()

    def _close_links(self) -> None:
        raise NotImplementedError
