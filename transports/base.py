"""The KV data-plane interface: what decode (receiver) and prefill (sender) program against.

Ownership: during `send()` the sender's page buffers stay owned by the sender and are only
read; the sender may release them once `send()` returns (the receiver acked) or raises.
On the receiver, the destination buffers registered by `expect()` belong to the caller's
lease; the transport writes into them only while the expectation is live, and after the
future resolves with an error or `fence()` returns it never writes into them again.
Transports report (futures, `stats`, `on_event`); the owning service changes request state
and calls its pool. Transports never touch a pool.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from pdmesh.kvstore.spec import pages_for

from .errors import Reason, TransferError

POISON_BYTE = 0xFF  # all-ones is NaN in fp32/fp16/bf16: a stray read of a poisoned page shows


@dataclasses.dataclass(frozen=True, slots=True)
class ExpectedTransfer:
    """A live destination registered by the receiver before the sender is told to go.

    `deadline_s` is a duration in seconds counted from `expect()`; when it passes without a
    verified commit the future fails with DEADLINE. `key` authenticates every frame of the
    transfer (`framing.transfer_key(data_key, reservation_id, epoch)`; the sender's plan
    carries the same key); the empty default is for tests only. Only the first
    ceil(num_tokens / page_tokens) pages are written; the rest of the lease stays untouched.
    """

    reservation_id: str  # UUID string
    epoch: int
    page_ids: tuple[int, ...]
    page_buffers: Sequence[memoryview]  # writable, one per page id, each page_bytes long
    page_bytes: int
    page_tokens: int
    num_tokens: int
    deadline_s: float = 30.0
    key: bytes = dataclasses.field(default=b"", repr=False)

    @property
    def num_pages(self) -> int:
        return pages_for(self.num_tokens, self.page_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferPlan:
    """What the sender was told: where the pages go. `deadline_s` counts from `send()`;
    `key` is the reservation's data-plane key (see `ExpectedTransfer`)."""

    reservation_id: str
    epoch: int
    dest_page_ids: tuple[int, ...]
    num_tokens: int
    page_tokens: int
    page_bytes: int
    first_token: int
    deadline_s: float = 30.0
    key: bytes = dataclasses.field(default=b"", repr=False)

    @property
    def num_pages(self) -> int:
        return pages_for(self.num_tokens, self.page_tokens)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    """Receiver side: a verified commit (coverage, lengths, checksums all matched)."""

    reservation_id: str
    epoch: int
    num_tokens: int
    first_token: int
    pages_written: tuple[int, ...]  # destination page ids, in order
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class TransferAck:
    """Sender side: the receiver acked; the sender may release its pages."""

    reservation_id: str
    epoch: int
    num_tokens: int
    bytes: int
    seconds: float


@dataclasses.dataclass(slots=True)
class TransportStats:
    """Counters a service can export as metrics."""

    bytes_sent: int = 0
    bytes_received: int = 0  # payload bytes that landed in destination pages
    bytes_drained: int = 0  # payload bytes read into scratch (rejected frames)
    frames_sent: int = 0
    frames_received: int = 0
    transfers_sent: int = 0
    transfers_committed: int = 0
    transfers_failed: int = 0
    accept_errors: int = 0  # listener accept() failures (EMFILE...): retried with back-off
    links_refused: int = 0  # unbound inbound connections ended to stay within the cap
    links_timed_out: int = 0  # unbound inbound connections closed: no header in time
    frames_rejected: collections.Counter[Reason] = dataclasses.field(
        default_factory=collections.Counter
    )


class ProducerFailed(Exception):
    """`PagesReady.wait` when the producer gave up before the pages asked for were final;
    `cause` is what it passed to `fail()`. `send()` turns it into TransferError(ABORTED)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the producer of the pages failed: {cause!r}")
        self.cause = cause


class PagesReady:
    """Sender side: how many of a transfer's pages are final (streamed send).

    The transport builds (checksums) and sends page i only after pages [0, i] are final;
    the commit goes after all of them. The producer (prefill) calls `advance(n)` after each
    chunk whose pages [0, n) it will not write again, and `fail(exc)` when it gives up; a
    send waiting for pages then raises TransferError(ABORTED) and tells the receiver with
    a NACK MACed under the transfer's key (its expectation fails ABORTED; no byte lands in
    a page that was not final).
    Not thread-safe: call it from the event loop's thread (`loop.call_soon_threadsafe`
    from a compute thread)."""

    def __init__(self, total: int, ready: int = 0) -> None:
        if total <= 0:
            raise ValueError(f"total must be positive, got {total}")
        self.total = total
        self._ready = max(0, min(ready, total))
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        # Set by complete(): the commit's first token, known only after the last chunk.
        self.first_token: int | None = None

    @property
    def ready(self) -> int:
        return self._ready

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def advance(self, n: int) -> None:
        """Pages [0, n) are final. Monotonic (a smaller n changes nothing), clamped to
        `total`; ignored after `fail()`."""
        n = min(int(n), self.total)
        if n > self._ready and self._failure is None:
            self._ready = n
            self._wake()

    def complete(self, first_token: int) -> None:
        """Every page is final and the commit carries `first_token` (a streamed send's
        commit takes it instead of the plan's, which was made before it was sampled)."""
        if self._failure is None:
            self.first_token = first_token
        self.advance(self.total)

    def fail(self, exc: BaseException) -> None:
        """The producer gave up: a send waiting for pages that are not final raises
        TransferError(ABORTED). The first failure stands; pages already final stay so."""
        if self._failure is None and self._ready < self.total:
            self._failure = exc
            self._wake()

    async def wait(self, n: int) -> None:
        """Return once pages [0, n) are final (n is clamped to `total`); ProducerFailed if
        the producer failed before that."""
        n = min(n, self.total)
        while self._ready < n:
            if self._failure is not None:
                raise ProducerFailed(self._failure)
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class PeerUnreachable(TransferError):
    """A send refused at link set-up, before any frame, because the receiver cannot take a
    transfer now (nixl: it has no staging region to lend). Reason PEER_LOST; `unreachable`
    is True. The receiver reports not ready (`accepting` False) meanwhile."""

    @property
    def unreachable(self) -> bool:
        return True


# on_event(event, reservation_id, reason): event is one of "committed", "failed", "sent",
# "send_failed", "rejected_frame". Called synchronously; it must not block or raise.
EventCallback = Callable[[str, str, Reason | None], None]


@runtime_checkable
class KVTransport(Protocol):
    """One data-plane endpoint: receives into leased pages and sends from pool pages."""

    stats: TransportStats

    async def start(self) -> str:
        """Listen on the constructor's host/port (0 = any free port); return the advertised
        address, e.g. ``tcp://127.0.0.1:43210`` or ``ucx://127.0.0.1:43211``."""
        ...

    def expect(self, target: ExpectedTransfer) -> asyncio.Future[TransferResult]:
        """Register a live destination; the future resolves on a verified commit or raises
        TransferError. Raises ValueError if the target is inconsistent or already live."""
        ...

    async def fence(self, reservation_id: str) -> None:
        """After this returns no byte is ever written into that target's buffers again
        (frames in flight are drained to scratch; a write already in flight, even for a
        transfer that had failed before, is waited for) and a pending future fails with
        FENCED. Raises TransferError(QUARANTINED) when a write's end cannot be established:
        the caller must then never lease those pages again. Idempotent; unknown ids are
        remembered so later frames for them are rejected."""
        ...

    async def send(
        self, address: str, plan: TransferPlan, page_buffers: Sequence[memoryview],
        ready: PagesReady | None = None,
    ) -> TransferAck:
        """Send the plan's pages (page_buffers[i] goes to plan.dest_page_ids[i]) and a
        commit; return when the receiver acked. Raises TransferError (the receiver's reason
        when it rejected; PEER_LOST / DEADLINE / INVALID_PLAN / ABORTED otherwise).

        `ready` (streamed send): None means every page is final now. Otherwise the link is
        opened at once (an unreachable receiver fails the send before any page is final),
        page i is checksummed and sent only once `ready` says pages [0, i] are final, the
        commit after all of them; `ready.total` must be the plan's page count.
        `plan.deadline_s` bounds the whole send, waits for pages included."""
        ...

    async def close(self) -> None:
        """Idempotent: stop listening, fail live expectations with CLOSED, cancel and await
        every task, close every connection."""
        ...


def validate_plan(plan: TransferPlan, page_buffers: Sequence[memoryview]) -> list[memoryview]:
    """Checks a sender's plan; returns byte views of the pages to send (no copies)."""
    n = plan.num_pages if plan.page_tokens > 0 and plan.num_tokens > 0 else 0
    problem = ""
    if n == 0 or plan.page_bytes <= 0:
        problem = "num_tokens, page_tokens and page_bytes must be positive"
    elif len(plan.dest_page_ids) < n or len(page_buffers) < n:
        problem = f"{n} pages needed, {len(plan.dest_page_ids)} ids, {len(page_buffers)} buffers"
    elif not (0 <= plan.epoch < 1 << 64 and -(1 << 63) <= plan.first_token < 1 << 63):
        problem = "epoch or first_token out of range"
    elif not (plan.num_tokens < 1 << 32 and plan.page_tokens < 1 << 32):
        problem = "num_tokens and page_tokens must be u32"
    elif not all(0 <= p < 1 << 32 for p in plan.dest_page_ids[:n]):
        problem = "destination page ids must be u32"
    views = []
    for buf in page_buffers[:n] if not problem else ():
        view = memoryview(buf).cast("B") if memoryview(buf).format != "B" else memoryview(buf)
        if view.nbytes != plan.page_bytes:
            problem = f"page buffer of {view.nbytes} bytes, page_bytes={plan.page_bytes}"
            break
        views.append(view)
    if problem:
        raise TransferError(plan.reservation_id, Reason.INVALID_PLAN, problem)
    return views
