"""What the TCP and UCX transports share: addresses, frame building, and every part of the
`KVTransport` contract that does not depend on the wire.

- receiver: the loop that serves one inbound link (header checks against the
  `ReceiveTable`, payload into the page or drained, ACK/NACK replies), posting NACKs;
- sender: the deadline/events/stats around one transfer, checking out a pooled link,
  reading the receiver's reply (ACK or NACK) and returning the link to the idle pool;
- lifecycle: task ownership and the close sequence.

A *link* is one connection: a `RawSocket` for TCP, a UCX endpoint for UCX. A concrete
transport supplies `start()` and the wire operations on a link:

    _open(address, rid)              connect (TransferError PEER_LOST / INVALID_PLAN)
    _reusable(link), _discard(link)  an idle link still usable? close / abort one
    _recv_header(link, progress_s, idle=False)   96 header bytes, None on a clean end of
                                     stream; idle: LinkIdle when nothing of it came within
                                     progress_s (nothing consumed, the next call resumes)
    _recv_bytes(link, n, progress_s) exactly n bytes (reply headers and NACK details)
    _drain(link, n), _recv_page(link, slot, header)   a DATA payload: scratch / the page
    _send_reply(link, frame)         an ACK or NACK frame (header + detail)
    _send_frame(link, frame)         one DATA or COMMIT frame
    _cut(link, cut)                  end the stream inside a frame (frame hook only)

and may override `_stream()`, the fault-free way to send a transfer's frames (TCP batches
them into few `sendmsg` calls); `_lost` names the exceptions that mean a lost peer.
`progress_s` bounds one wait for the peer (None: no bound, an idle link).

Streamed send (`send(..., ready=PagesReady)`): the link is opened at once; the
frames of pages [sent, ready) are built (checksummed) and sent as soon as `ready` says
they are final, the last of such a segment flagged PAUSE when pages remain; the commit
goes after every page. The receiver waits for the frame after a PAUSE for as long as the
transfer is live (its deadline, or decode ending it, bounds that), and within the
progress timeout everywhere else (inside a frame, after a frame without PAUSE); a link
bound to no live transfer keeps the header timeout.

Frame hook: a transport built with `frame_filter` (only `FaultInjectingTransport` in
faults.py passes one) asks it once per send; when it answers with a function, that
function gets the transfer's frames and returns what to emit instead: frames, `Delay`s
and at most one final `Cut`.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
import itertools
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from .base import (
    EventCallback,
    ExpectedTransfer,
    PagesReady,
    ProducerFailed,
    TransferAck,
    TransferPlan,
    TransferResult,
    TransportStats,
    validate_plan,
)
from .errors import FrameError, LinkIdle, Reason, TransferError
from .framing import (
    DEFERRED,
    HEADER_SIZE,
    MAX_PAYLOAD,
    PAUSE,
    FrameHeader,
    Kind,
    checksum,
    commit_digest,
    decode_header,
    encode_header,
    mac_ok,
    reservation_bytes,
    tokens_in_page,
)
from .receiver import ReceiveTable, Slot, nack_frame

_T = TypeVar("_T")
_NO_RESERVATION = bytes(16)
_UNBOUND = object()  # `_bound_header`: the link is bound to no live transfer


@dataclasses.dataclass(slots=True)
class Frame:
    """One frame as the sender emits it; `index` counts a transfer's frames from 0 (DATA
    for page 0..n-1, then the COMMIT)."""

    index: int
    header: bytes
    payload: memoryview | bytes
    key: bytes = b""  # the transfer's MAC key (to re-encode a header: UCX runs, faults)
    # A DEFERRED frame's source: the transport calls `source.settle(index)` once it handed
    # the payload over (the page's checksum is then computed while the peer copies it).
    source: FrameSource | None = None


@dataclasses.dataclass(slots=True)
class Delay:
    """Frame hook: sleep this long before the next item."""

    seconds: float


@dataclasses.dataclass(slots=True)
class Cut:
    """Frame hook: end the stream inside a frame. The sender sends the buffers in `whole`,
    then the bytes in `partial` (the head of the next buffer), closes the link (abortively
    when `reset`) and fails the send as PEER_LOST. A UCX message cannot be cut: UCX sends
    `whole` and aborts the endpoint."""

    whole: tuple[bytes | memoryview, ...]
    partial: memoryview
    reset: bool


SendItem = Frame | Delay | Cut
# frame_filter(plan) -> None (send as usual) or a function from the transfer's frames to
# the items to emit instead.
FrameFilter = Callable[[TransferPlan], Callable[[list[Frame]], Iterable[SendItem]] | None]


def _decoded(header: Any) -> FrameHeader | None:
    """The header of a refused frame, for the protocol trace (None: it does not decode)."""
    try:
        return decode_header(header)
    except FrameError:
        return None


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """`scheme://host:port` -> (host, port); ValueError otherwise."""
    prefix = f"{scheme}://"
    if not address.startswith(prefix):
        raise ValueError(f"not a {scheme} address: {address!r}")
    host, _, port = address[len(prefix):].rpartition(":")
    return host.strip("[]"), int(port)


class FrameSource:
    """A transfer's frames, built lazily and in order: `data(start, stop)` yields the DATA
    frames of pages [start, stop), checksumming each page only as its frame is produced
    (for a streamed send: after the page is final); `commit()` is the COMMIT, once every
    DATA frame was produced. Every header is MACed under the plan's key (the COMMIT's
    covers every page digest). `defer`: the DATA frames are flagged DEFERRED and carry no
    checksum; each page is checksummed when the transport calls `settle(i)` after handing
    it over (else by `commit()`), and the COMMIT's digest covers them."""

    def __init__(self, plan: TransferPlan, rbytes: bytes, views: list[memoryview],
                 ready: PagesReady | None = None, defer: bool = False) -> None:
        self.plan, self.rbytes, self.views = plan, rbytes, views
        self.ready = ready  # a streamed send: its `first_token` (if set) goes in the commit
        self.defer = defer
        self.sums: list[int | None] = []  # None: a DEFERRED page not checksummed yet

    def data(self, start: int, stop: int, pause: bool = False) -> Iterator[Frame]:
        """pause: flag the last frame PAUSE (the pages after it are not final yet)."""
        plan, key = self.plan, self.plan.key
        deferred = self if self.defer else None
        for i in range(start, stop):
            if i != len(self.sums):
                raise RuntimeError(f"frame {i} built out of order")
            view = self.views[i]
            digest = None if self.defer else checksum(view)
            self.sums.append(digest)
            flags = (PAUSE if pause and i == stop - 1 else 0) | (DEFERRED if self.defer else 0)
            header = encode_header(
                Kind.DATA, self.rbytes, plan.epoch, seq=i, dest_page_id=plan.dest_page_ids[i],
                page_index=i, token_count=tokens_in_page(i, plan.num_tokens, plan.page_tokens),
                payload_len=view.nbytes, payload_checksum=digest or 0, flags=flags, key=key)
            yield Frame(i, header, view, key, deferred)

    def settle(self, i: int) -> None:
        """Checksum DEFERRED page i (once its frame was produced), if not done yet."""
        if self.sums[i] is None:
            self.sums[i] = checksum(self.views[i])

    def commit(self) -> Frame:
        n, plan = len(self.views), self.plan
        if len(self.sums) != n:
            raise RuntimeError(f"commit after {len(self.sums)} of {n} pages")
        for i in range(n):
            self.settle(i)
        return Frame(n, encode_header(Kind.COMMIT, self.rbytes, plan.epoch, seq=n, page_index=n,
                                      token_count=plan.num_tokens, aux=self.first_token,
                                      payload_checksum=commit_digest(self.sums), key=plan.key),
                     b"", plan.key)

    @property
    def first_token(self) -> int:
        late = self.ready.first_token if self.ready is not None else None
        return self.plan.first_token if late is None else late

    def all(self) -> Iterator[Frame]:
        yield from self.data(0, len(self.views))
        yield self.commit()


def build_frames(plan: TransferPlan, rbytes: bytes, views: list[memoryview]) -> Iterable[Frame]:
    """Every frame of a transfer whose pages are all final (see `FrameSource`)."""
    return FrameSource(plan, rbytes, views).all()


def reason_of(code: int) -> Reason:
    """A NACK's reason code; an unknown one reads as BAD_HEADER."""
    try:
        return Reason(code)
    except ValueError:
        return Reason.BAD_HEADER


async def timed(awaitable: Awaitable[_T], seconds: float | None) -> _T:
    """Await for at most `seconds` (then TimeoutError); None waits for ever."""
    if seconds is None:
        return await awaitable
    async with asyncio.timeout(seconds):
        return await awaitable


class LoopTurns:
    """Gives the event loop a turn once the coroutine that owns it has run `every_s`
    since its last turn. A link whose next bytes are always ready never suspends on its
    own: without turns, one transfer held its process's loop (decode's token streams,
    prefill's control plane, `fence()`) for the whole transfer (measured here: 64 MiB
    over tcp held the receiver's loop up to 48 ms, the sender's 37 ms; transports/
    README.md)."""

    __slots__ = ("every_s", "_since")

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._since = time.perf_counter()

    async def take(self) -> None:
        if time.perf_counter() - self._since >= self.every_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


class TransportCore(abc.ABC):
    """Shared state and behaviour of the transports (see the module docstring)."""

    scheme = ""
    # Whether `_stream` gets the frames as a lazy iterator (TCP, UCX: checksums overlap the
    # sends) or as a list built first.
    lazy_frames = False
    # Pages a receiver may have posted but not yet seen land (`_recv_page` returning a
    # landing; 0 for transports whose `_recv_page` reads the page itself).
    receive_window = 0
    # Whether a DATA header's `aux` may announce a run of pages sent as one payload message
    # (UCX); other transports ignore `aux` on DATA frames.
    coalesces = False
    # Whether `_drain` allocates what it drains (UCX); then a rejected payload is drained
    # only up to what the reservation it names allows (`_check_drain`).
    drain_allocates = False
    # Whether fault-free sends build DEFERRED DATA frames (no checksum in the header): the
    # transport's `_stream` settles each page's checksum (`Frame.source`) after handing the
    # page over, and the COMMIT is streamed after the pages (UCX: see ucx.py).
    defers_checksums = False
    # What a lost peer looks like on this wire (TimeoutError is an OSError).
    _lost: tuple[type[BaseException], ...] = (OSError, EOFError)
    # Listener limits (instance attributes may override them): an inbound link bound to no
    # live transfer must send a whole header within `header_timeout_s` (else it is closed);
    # at most `max_unbound_links` such links are served at once (a new one ends the oldest).
    # Outbound idle links are not reused after `header_timeout_s / 2`.
    header_timeout_s = 30.0
    max_unbound_links = 256
    # The longest (seconds) a link's receive loop or a transfer's send holds the event
    # loop before it gives it a turn (`LoopTurns`); 0: a turn per frame. A turn per frame
    # cost tcp ~5 % at 16 / 64 MiB here; one per millisecond nothing measurable for tcp
    # and ucx, ~3 % for nixl.
    loop_turn_s = 0.001

    def __init__(self, host: str, port: int, *, progress_timeout_s: float,
                 on_event: EventCallback | None, frame_filter: FrameFilter | None) -> None:
        self.host, self.port = host, port
        self.progress_timeout_s = progress_timeout_s
        self.stats = TransportStats()
        self._on_event = on_event
        self._frame_filter = frame_filter
        self._table = ReceiveTable(self.stats, on_event)
        self._table.nack_sink = self._post_nack
        self._listener: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._links: dict[int, Any] = {}  # inbound links being served, by connection id
        self._link_tasks: dict[int, asyncio.Task] = {}  # the task serving each
        self._link_ids = itertools.count()
        # outbound links that may be reused, by address: (link, when it went idle)
        self._idle: dict[str, list[tuple[Any, float]]] = {}
        self._closed = False
        # False while the listener cannot accept (e.g. out of file descriptors): the
        # owning service reports not ready so that no new transfer is routed here.
        self.accepting = True
        self.address = ""

    def _spawn(self, coro: Awaitable[_T]) -> asyncio.Task[_T]:
        """An owned task: kept until done, cancelled and awaited by close()."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _event(self, event: str, rid: str, reason: Reason | None) -> None:
        if self._on_event is not None:
            self._on_event(event, rid, reason)

    def set_trace(self, trace: Callable[[str, dict], None] | None) -> None:
        """Report the receiving side's protocol actions to `trace` (receiver.py `trace`;
        None: off). The owning service sets it when its protocol trace is on."""
        self._table.trace = trace

    # -- receiver ----------------------------------------------------------------------
    def expect(self, target: ExpectedTransfer) -> asyncio.Future[TransferResult]:
        if self._closed:
            raise RuntimeError("transport is closed")
        return self._table.expect(target)

    async def fence(self, reservation_id: str) -> None:
        await self._table.fence(reservation_id)

    async def _serve_link(self, link: Any) -> None:
        """Serve one inbound link until it ends: every header is checked against the live
        expectation before any payload byte is read; rejections are answered with a NACK."""
        unbound = [cid for cid in self._links if not self._table.bound_to(cid)]
        if len(unbound) >= self.max_unbound_links:  # guard: unbound-cap
            # Make room by ending the longest-waiting unbound link (a flood of idle
            # connections cannot lock out a sender that sends its header at once).
            self.stats.links_refused += 1
            self._links.pop(unbound[0])  # its task's `finally` closes it
            oldest = self._link_tasks.pop(unbound[0], None)
            if oldest is not None:
                oldest.cancel()
        conn_id = next(self._link_ids)
        self._links[conn_id] = link
        task = asyncio.current_task()
        if task is not None:
            self._link_tasks[conn_id] = task
        pending: collections.deque = collections.deque()  # landings of posted pages
        progress = self.progress_timeout_s
        reason, detail = Reason.PEER_LOST, "peer closed the connection"
        paused = False  # the last DATA frame was flagged PAUSE (a streamed send)
        turns = LoopTurns(self.loop_turn_s)
        try:
            while True:
                # a link that is always full must not hold the loop
                await turns.take()  # guard: loop-turns
                header = await self._bound_header(link, conn_id, paused, pending)
                if header is _UNBOUND:  # a whole header within the header timeout
                    try:
                        header = await timed(self._recv_header(link, None),
                                             self.header_timeout_s)  # guard: header-timeout
                    except TimeoutError:
                        self.stats.links_timed_out += 1
                        raise
                if header is None:
                    break
                try:
                    h = decode_header(header)
                    self._table.authenticate(h)
                    if self.coalesces and h.kind is Kind.DATA and h.aux > 1:
                        # A run of pages whose payloads come as one message.
                        nack, paused = await self._serve_run(link, h, conn_id, progress,
                                                             pending)
                        if nack is not None:
                            await self._send_reply(link, nack)
                        continue
                except FrameError as exc:  # malformed or unauthenticated: drop, close
                    reason, detail = exc.reason, exc.detail
                    self.stats.frames_rejected[reason] += 1
                    if self._table.trace is not None:
                        self._table.dropped(_decoded(header), reason)
                    await self._send_reply(link, nack_frame(_NO_RESERVATION, 0, reason, detail))
                    break
                paused = bool(h.flags & PAUSE)  # guard: stream-pause
                if h.kind is Kind.DATA:
                    slot, nack = self._table.check_data(h, conn_id)
                    if slot is None:
                        self._check_drain(h, h.payload_len)
                        await self._drain(link, h.payload_len)
                    else:
                        landing = await self._recv_page(link, slot, h)
                        if landing is None:
                            nack = self._table.data_done(slot, h)
                        else:
                            pending.append(landing)
                            nack = await self._settle(link, pending, self.receive_window)
                    if nack is not None:
                        await self._send_reply(link, nack)
                elif h.kind is Kind.COMMIT:
                    # Every page must have landed (and been checksummed) before the commit.
                    nack = await self._settle(link, pending, 0)
                    await self._send_reply(link, nack or self._table.check_commit(h, conn_id))
                elif h.kind is Kind.NACK and h.payload_len == 0:
                    # A streamed sender's producer gave up (authenticated above).
                    await self._settle(link, pending, 0)
                    self._table.check_abort(h, conn_id)
                else:
                    reason, detail = Reason.BAD_HEADER, f"{h.kind.name} frame sent to a receiver"
                    break
        except self._lost as exc:
            reason, detail = Reason.PEER_LOST, f"{type(exc).__name__}: {exc}"
        finally:
            self._table.conn_lost(conn_id, reason, detail)
            self._links.pop(conn_id, None)
            self._link_tasks.pop(conn_id, None)
            self._discard(link)

    async def _bound_header(self, link: Any, conn_id: int, paused: bool,
                            pending: collections.deque) -> Any:
        """The next header (None at a clean end) of a link bound to a live transfer: within
        the progress timeout, or, after a frame flagged PAUSE (a streamed send between
        chunks), for as long as that transfer is live. `_UNBOUND` when the link is bound
        to none, or its transfer ended during the pause (deadline, fence, a page that
        failed its check): what that transfer had outstanding is answered first."""
        slot = self._table.bound_slot(conn_id)
        if slot is None:
            return _UNBOUND
        if not paused:
            return await self._recv_header(link, self.progress_timeout_s)
        while slot.live:
            try:
                return await self._recv_header(link, self.progress_timeout_s, idle=True)
            except LinkIdle:
                continue
        nack = await self._settle(link, pending, 0)
        if nack is not None:
            await self._send_reply(link, nack)
        return _UNBOUND

    async def _serve_run(self, link: Any, h: FrameHeader, conn_id: int, progress: float,
                         pending: collections.deque) -> tuple[bytes | None, bool]:
        """A DATA header whose `aux` is k >= 2 (transports that coalesce): it and the next
        k - 1 headers, all DATA with `aux` 0, are checked one by one as they come (the
        first binds the reservation to this link); then their k payloads come as one
        message, posted into the pages (`_recv_run`) or drained when any check failed.
        FrameError when the run is malformed. Returns the first NACK, if any, and whether
        the run's last frame was flagged PAUSE."""
        if h.aux > self.receive_window:
            raise FrameError(f"run of {h.aux} pages, at most {self.receive_window}")
        run, checked = [h], [self._table.check_data(h, conn_id)]
        for header in await self._recv_run_headers(link, h.aux - 1, progress):
            x = decode_header(header)
            self._table.authenticate(x)
            if x.kind is not Kind.DATA or x.aux != 0:
                raise FrameError(f"{x.kind.name} frame (aux {x.aux}) inside a run of pages")
            run.append(x)
            checked.append(self._table.check_data(x, conn_id))
        slot = checked[0][0]
        paused = bool(run[-1].flags & PAUSE)  # guard: stream-pause.run
        nack = next((n for _, n in checked if n is not None), None)
        if nack is not None or slot is None:
            total = sum(x.payload_len for x in run)
            if total > MAX_PAYLOAD:
                raise FrameError(f"run of {total} payload bytes")
            self._check_drain(h, total)
            await self._drain(link, total)
            return nack, paused
        pending.append(await self._recv_run(link, slot, run))
        return await self._settle(link, pending, self.receive_window), paused

    async def _recv_run_headers(self, link: Any, n: int, progress: float) -> list[bytes]:
        """The `n` headers that follow a run's first one (each checked by the caller)."""
        headers = []
        for _ in range(n):
            header = await self._recv_header(link, progress)
            if header is None:
                raise EOFError("stream ended inside a run of pages")
            headers.append(header)
        return headers

    def _check_drain(self, h: FrameHeader, length: int) -> None:
        """For transports that allocate what they drain (UCX): a rejected payload is drained
        only up to a window of the pages of the reservation it names (live or recently
        ended; else of the largest live one); a longer one ends the link (PEER_LOST)
        instead of being allocated."""
        if not self.drain_allocates:
            return
        allowed = self._table.page_bytes_for(h.reservation) * max(1, self.receive_window)
        if length > allowed:  # guard: drain-bound
            raise ConnectionAbortedError(f"rejected payload of {length} bytes, at most "
                                         f"{allowed} may be drained")

    async def _recv_run(self, link: Any, slot: Slot, run: list[FrameHeader]) -> Any:
        """Post one receive for a checked run's payloads (transports that coalesce)."""
        raise NotImplementedError

    async def _settle(self, link: Any, pending: collections.deque, keep: int) -> bytes | None:
        """Wait (oldest first) for posted page receives until at most `keep` are pending
        (the transport checksums each page as it lands: `data_done`). Returns the first
        NACK, if any."""
        nack = None
        while pending and (len(pending) > keep or pending[0].done()):
            bad = await self._landed(link, pending.popleft())
            nack = nack or bad
        return nack

    async def _landed(self, link: Any, landing: Any) -> bytes | None:
        """Wait for a posted page receive (only transports whose `_recv_page` posts); its
        result is `data_done`'s."""
        raise NotImplementedError

    def _post_nack(self, conn_id: int, frame: bytes) -> None:
        """The receive table failed a live transfer (fence, deadline): tell its sender."""
        link = self._links.get(conn_id)
        if link is not None:
            self._spawn(self._send_quietly(link, frame))

    async def _send_quietly(self, link: Any, frame: bytes) -> None:
        try:
            await self._send_reply(link, frame)
        except self._lost:
            pass  # the reader of that link reports the loss

    # -- sender ------------------------------------------------------------------------
    async def send(self, address: str, plan: TransferPlan, page_buffers: Sequence[memoryview],
                   ready: PagesReady | None = None) -> TransferAck:
        views = validate_plan(plan, page_buffers)
        rid = plan.reservation_id
        if ready is not None and ready.total != len(views):
            raise TransferError(rid, Reason.INVALID_PLAN,
                                f"ready.total {ready.total} != {len(views)} pages")
        try:
            key = reservation_bytes(rid)
        except ValueError as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
        schedule = self._frame_filter(plan) if self._frame_filter is not None else None
        source = FrameSource(plan, key, views, ready,
                             defer=self.defers_checksums and schedule is None)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(plan.deadline_s):
                await self._deliver(address, plan, key, source, schedule, ready)
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

    async def _deliver(self, address: str, plan: TransferPlan, key: bytes, source: FrameSource,
                       schedule, ready: PagesReady | None) -> None:
        """Send the frames on a pooled or new link and wait for the receiver's reply: an
        ACK that names this reservation and its token count, or a NACK with the reason."""
        rid = plan.reservation_id
        link, since = await self._checkout(address, rid)  # at once, streamed or not
        if ready is not None and ready.ready == 0:
            try:
                await self._pages(ready, 1, None, rid)
            except TransferError:
                await self._abort(link, plan, key)
                self._discard(link)
                raise
            except BaseException:
                self._discard(link)
                raise
            # The receiver closes a link that sent no header for header_timeout_s.
            if time.monotonic() - since > self.header_timeout_s / 2 or not self._reusable(link):
                self._discard(link)
                link, _ = await self._checkout(address, rid)
        reply = self._spawn(self._read_reply(link))
        reusable = False
        try:
            try:
                await self._send_frames(link, rid, source, schedule, ready, reply)
                h, detail = await timed(asyncio.shield(reply), self.progress_timeout_s)
            except TransferError as exc:
                if exc.reason is Reason.ABORTED:
                    await self._abort(link, plan, key)
                raise
            except self._lost as exc:
                # Prefer the receiver's own verdict if it arrived just before the loss.
                await asyncio.wait({reply}, timeout=0.05)
                if not reply.done() or reply.cancelled() or reply.exception() is not None:
                    raise TransferError(rid, Reason.PEER_LOST,
                                        f"{type(exc).__name__}: {exc}") from None
                h, detail = reply.result()
            if (h.kind is Kind.ACK and h.reservation == key
                    and h.token_count == plan.num_tokens):  # guard: commit-verification.ack
                if not mac_ok(h, plan.key):  # guard: ack-mac
                    raise TransferError(rid, Reason.UNAUTHENTICATED, "ACK MAC does not verify")
                reusable = True
                return
            if h.kind is Kind.NACK:
                raise TransferError(rid, reason_of(h.aux), detail)
            raise TransferError(rid, Reason.BAD_HEADER, f"unexpected reply {h.kind.name}")
        finally:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            if reusable and not self._closed:
                self._idle.setdefault(address, []).append((link, time.monotonic()))
            else:
                self._discard(link)

    async def _send_frames(self, link: Any, rid: str, source: FrameSource, schedule,
                           ready: PagesReady | None, reply: asyncio.Task) -> None:
        """Send the transfer's frames, stopping early once the receiver answered. Streamed
        (`ready` with pages not final yet): each segment of pages that became final is
        built and sent as soon as it is, the commit after the last page. With a frame hook
        (faults) every page is waited for first and the scheduled frames go as they are."""
        n = len(source.views)
        if schedule is not None:
            if ready is not None:
                await self._pages(ready, n, reply, rid)
                if reply.done():
                    return
            try:
                items = list(schedule(list(source.all())))
            except (ValueError, struct.error) as exc:
                raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
            await self._emit(link, items, reply)
            return
        if ready is None or ready.ready >= n:
            if source.defer:  # the COMMIT's digest needs the sums settled while sending
                await self._stream(link, source.data(0, n), reply)
                if not reply.done():
                    await self._stream(link, [source.commit()], reply)
                return
            frames = source.all()
            await self._stream(link, frames if self.lazy_frames else list(frames), reply)
            return
        sent = 0
        while sent < n:
            await self._pages(ready, sent + 1, reply, rid)
            if reply.done():
                return  # the receiver answered (a NACK) or the link failed
            upto = ready.ready
            frames = source.data(sent, upto, pause=upto < n)
            await self._stream(link, frames if self.lazy_frames else list(frames), reply)
            sent = upto
        if not reply.done():
            await self._stream(link, [source.commit()], reply)

    async def _pages(self, ready: PagesReady, n: int, reply: asyncio.Task | None,
                     rid: str) -> None:
        """Wait until pages [0, n) are final, or the reply task ended (the receiver answered
        or the link failed: the caller reads it). TransferError(ABORTED) when the producer
        failed first."""
        if ready.ready >= n:
            return
        waiter = asyncio.ensure_future(ready.wait(n))
        try:
            await asyncio.wait({waiter} if reply is None else {waiter, reply},
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
        if waiter.done() and not waiter.cancelled():
            exc = waiter.exception()
            if isinstance(exc, ProducerFailed):
                raise TransferError(rid, Reason.ABORTED, str(exc)) from exc.cause
            if exc is not None:
                raise exc

    async def _abort(self, link: Any, plan: TransferPlan, key: bytes) -> None:
        """Tell the receiver that this transfer ends here (the producer gave up): a NACK
        MACed under the transfer's key, ABORTED in `aux`, no detail. Best effort, within
        the progress timeout; the link is discarded after it either way."""
        frame = encode_header(Kind.NACK, key, plan.epoch, aux=int(Reason.ABORTED),
                              key=plan.key)
        try:
            await timed(self._send_reply(link, frame), self.progress_timeout_s)
        except (TimeoutError, *self._lost):
            pass  # the receiver learns from the closed link instead

    async def _checkout(self, address: str, rid: str) -> tuple[Any, float]:
        """An idle link to `address` that still looks usable, else a new one; with the
        time it last carried anything (monotonic)."""
        idle = self._idle.get(address, [])
        fresh = time.monotonic() - self.header_timeout_s / 2  # the receiver may close older
        while idle:
            link, since = idle.pop()
            if since > fresh and self._reusable(link):
                return link, since
            self._discard(link)
        return await self._open(address, rid), time.monotonic()

    async def _read_reply(self, link: Any) -> tuple[FrameHeader, str]:
        header = await self._recv_bytes(link, HEADER_SIZE, None)
        try:
            h = decode_header(header)
        except FrameError as exc:
            raise EOFError(f"malformed reply: {exc.detail}") from None
        # before any allocation the peer sized
        if h.kind not in (Kind.ACK, Kind.NACK):  # guard: reply-bound
            raise EOFError(f"malformed reply: a {h.kind.name} frame")
        detail = b""
        if h.payload_len:
            detail = await self._recv_bytes(link, h.payload_len, self.progress_timeout_s)
        return h, detail.decode(errors="replace")

    async def _stream(self, link: Any, frames: Iterable[Frame], reply: asyncio.Task) -> None:
        """Send a transfer's frames (no frame hook); by default one frame at a time."""
        await self._emit(link, frames, reply)

    async def _emit(self, link: Any, items: Iterable[SendItem], reply: asyncio.Task) -> None:
        """Send items in order, stopping once the receiver answered (a NACK)."""
        for item in items:
            if isinstance(item, Delay):
                await asyncio.sleep(item.seconds)
                continue
            if reply.done() and not (isinstance(item, Frame) and not item.header):
                return  # (the rest of a frame whose header went out is always sent)
            if isinstance(item, Cut):
                await self._cut(link, item)
                raise ConnectionResetError("fault injected: stream cut")
            await self._send_frame(link, item)

    # -- lifecycle ---------------------------------------------------------------------
    @abc.abstractmethod
    async def start(self) -> str:
        """Listen; return the advertised address (see `KVTransport.start`)."""

    async def close(self) -> None:
        """Idempotent: fail live expectations, stop listening, cancel and await every
        task, then close every link."""
        if self._closed:
            return
        self._closed = True
        self._table.close()
        if self._listener is not None:
            self._listener.close()
        while self._tasks:  # tasks ending may start others (UCX: watching torn-down links)
            tasks = list(self._tasks)
            # Taken out here, not left to their done callbacks: those run only once the
            # loop turns, and `gather` of tasks that have all ended returns without a turn
            # (Python >= 3.12), so a set holding an ended task never emptied (close() spun).
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for links in self._idle.values():
            for link, _ in links:
                self._discard(link)
        for link in list(self._links.values()):
            self._discard(link)
        self._idle.clear()

    # -- the wire (supplied by each transport) -----------------------------------------
    @abc.abstractmethod
    async def _open(self, address: str, rid: str) -> Any:
        ...

    @abc.abstractmethod
    def _reusable(self, link: Any) -> bool:
        ...

    @abc.abstractmethod
    def _discard(self, link: Any) -> None:
        ...

    @abc.abstractmethod
    async def _recv_header(self, link: Any, progress_s: float | None,
                           idle: bool = False) -> bytes | None:
        ...

    @abc.abstractmethod
    async def _recv_bytes(self, link: Any, n: int, progress_s: float | None) -> bytes:
        ...

    @abc.abstractmethod
    async def _drain(self, link: Any, length: int) -> None:
        ...

    @abc.abstractmethod
    async def _recv_page(self, link: Any, slot: Slot, h: FrameHeader) -> Any:
        """Read a checked DATA payload into `slot.dest(h)` while the slot is live (None), or
        post the receive and return a landing (a future, for `_landed`) that checks the
        page with `data_done` when it has landed (pipelined transports)."""

    @abc.abstractmethod
    async def _send_reply(self, link: Any, frame: bytes) -> None:
        ...

    @abc.abstractmethod
    async def _send_frame(self, link: Any, frame: Frame) -> None:
        ...

    @abc.abstractmethod
    async def _cut(self, link: Any, cut: Cut) -> None:
        ...
