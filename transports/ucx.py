"""UCX data plane (UCXX; ucx-py's `ucp` is accepted when that is what is installed).

Same frames and the same receiver checks (`ReceiveTable`) as TCP; each frame is two tagged
messages on the endpoint: the 96-byte header, then the page, which the receiver posts
straight into the destination page (`np.frombuffer(view, np.uint8)`) after the header was
checked. At link speed: the sender posts every message of a transfer at once (UCX
pipelines outstanding requests) and the receiver keeps up to `receive_window` page
receives posted while it reads the next headers; each page is checksummed when it has
landed (a large run in a worker thread, so that the next run's receive is posted
meanwhile), and the commit is checked only after every page landed. Fault-free sends carry
DEFERRED frames: a run is posted before the sender checksums its pages (it does so while
UCX moves them), and the COMMIT, sent after the pages, carries the digest that verifies
them (framing.py). Pages that lie back to
back in the sender's memory, for consecutive destination page ids, go as one message of up
to 16 MiB: the run's first DATA header carries its length in `aux` and all of the run's
headers go as one message (a header receive takes up to `receive_window` headers), the
receiver checks every header of the run (core.py `_serve_run`)
and posts one receive, straight into the
pages when they are adjacent in its memory, else into a buffer it copies from while the
slot is live. Faults injected through the frame hook go one message per frame.

Endpoints: a link is the sender's endpoint to the receiver's listener (ucxx gives it peer
error handling, which UCX can only honour on tcp or RDMA lanes: no shared memory between
processes). The receiver announces its UCX worker address on every new link; in error mode
"none" (`data_error_mode`, `--ucx-error-mode`) the sender opens a second endpoint to that
address without peer error handling and posts every message for the receiver on it, with
the link's tag (tag matching is per worker: the receiver's receives match it), so UCX may
use shared memory / CMA on one host. The listener endpoint carries the receiver's replies
and reports a lost sender to the receiver.

Fencing: a posted UCX receive cannot be taken back, so the slot counts it as an
unstoppable write; a failed slot with writes in flight stays known to the receive table
until they ended, and `fence()` waits for them. A receive that makes no progress within
`progress_timeout_s` tears the endpoint down (UCX then cancels the receive); one that is
still neither complete nor cancelled `quarantine_s` later is declared unknown: the slot
fails QUARANTINED and `fence()` raises, so the owner never leases those pages again.
UCX does not report a frozen peer (measured: 24 s+), so every wait during a transfer has
our own progress timeout. What UCX shares with TCP is in core.py. Env vars: see
transports/README.md (UCX_TLS, UCXPY_PROGRESS_MODE, ...).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import os
import struct
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from .base import EventCallback
from .core import Cut, Frame, FrameFilter, LoopTurns, TransportCore, parse_address, timed
from .errors import LinkIdle, Reason, TransferError
from .framing import HEADER_SIZE, FrameHeader, checksum, decode_header, encode_header
from .receiver import Slot

_RUN_BYTES = 16 << 20  # the most payload bytes one coalesced message carries
_RUN_PAGES = 64
# A landed run this large is checksummed in a worker thread (`UcxTransport._checked`);
# smaller ones on the event loop (their checksum takes well under a millisecond).
_THREAD_SUM_BYTES = 4 << 20
_SUMMER: concurrent.futures.ThreadPoolExecutor | None = None


def _summer() -> concurrent.futures.ThreadPoolExecutor:
    """One checksum thread per process, made at first use."""
    global _SUMMER
    if _SUMMER is None:
        _SUMMER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pdmesh-ucx-sum")
    return _SUMMER


def _checksums(views) -> list[int]:
    return [checksum(v) for v in views]

# A receiver announces its UCX worker address on every accepted link (magic + length, then
# the address); a sender in error mode "none" sends its frames on an endpoint to that
# address. Anything else, or an address over _ADDRESS_MAX bytes, is a lost peer.
_ANNOUNCE = struct.Struct("<4sI")
_ANNOUNCE_MAGIC = b"PDWA"
_ADDRESS_MAX = 64 << 10

ERROR_MODE_ENV = "PDMESH_UCX_ERROR_MODE"
# UCX transports whose peer failures surface as an error or a stall (which our progress
# timeout ends) when an endpoint has no peer error handling; measured here by killing either
# side mid-transfer (tcp, and posix/sysv/cma). On InfiniBand verbs an unhandled peer error
# can abort the process (openucx/ucx#9515), so any other transport keeps "peer".
_NO_ERRH_SAFE = frozenset({"tcp", "posix", "sysv", "cma", "knem", "xpmem", "self"})


def error_mode_setting(mode: str | None = None) -> str:
    """`mode`, else `PDMESH_UCX_ERROR_MODE`, checked: "auto" (the default), "peer" or
    "none" (services pass `--ucx-error-mode`, services/runtime/config.py)."""
    if mode is None:
        mode = (os.environ.get(ERROR_MODE_ENV) or "auto").strip().lower()
    if mode not in ("auto", "peer", "none"):
        raise ValueError(f"{ERROR_MODE_ENV}={mode!r}: expected auto, peer or none")
    return mode


def data_error_mode(setting: str | None = None, active: Iterable[str] | None = None) -> str:
    """The error handling of the endpoint a sender posts its frames on: "peer" or "none".

    `setting` (default: `PDMESH_UCX_ERROR_MODE`; checked by `error_mode_setting`): `peer`
    (UCX reports a lost peer on the endpoint; UCX then uses no shared-memory lane between
    two processes, so on one host the bytes go over tcp/lo), `none` (shared memory and CMA
    between processes on one host: measured 1.2 -> 12 GB/s for a bare 64 MiB ucxx send; a
    lost peer shows as an error or a stall that the progress timeout ends), or `auto`:
    `none` when every transport UCX may use (`active`, default ucxx's active transports,
    which follow `UCX_TLS`) is one of tcp / shared memory / self, else `peer`. Resolving
    `auto` creates ucxx's context: call it inside the event loop that will run the
    transport (ucxx binds its futures to it). Links always have peer error handling on
    their listener endpoint, which carries the receiver's replies and reports a lost
    sender to the receiver. transports/README.md."""
    setting = error_mode_setting(setting)
    if setting != "auto":
        return setting
    active = _active_transports() if active is None else frozenset(active)
    return "none" if active and active <= _NO_ERRH_SAFE else "peer"  # guard: ucx-error-mode


@functools.cache
def _active_transports() -> frozenset[str]:
    """The UCX transports ucxx's context may use: fixed for the life of the process (the
    context is created once, with the environment of that moment), so asked once."""
    if not hasattr(ucx, "get_active_transports"):
        return frozenset()
    return frozenset(ucx.get_active_transports())


# UCX's TCP transport (the one an endpoint with peer error handling gets between two
# processes on a host, and between hosts without RDMA) moves data in 8 KiB send / 64 KiB
# receive segments by default; 1 MiB segments about double its bandwidth (`pdmesh bench
# transport`). Cost: up to 1 MiB per buffer, 8 buffers per pool growth step. Set before
# UCX is loaded; an operator's own values win. transports/README.md.
UCX_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
for _key, _value in UCX_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

# What ucxx's import writes into the environment for each of these keys that is unset
# (ucxx/__init__.py: GPU-oriented defaults; UCX_CUDA_COPY_MAX_REG_RATIO only with a GPU,
# UCX_PROTO_ENABLE only for UCX < 1.18). Used when ucxx was imported before this module, so
# that what it added cannot be told from the diff below.
UCXX_DEFAULTS = {"UCX_MEMTYPE_CACHE": "n", "UCX_RNDV_THRESH": "8192",
                 "UCX_RNDV_FRAG_MEM_TYPE": "cuda", "UCX_MAX_RNDV_RAILS": "1",
                 "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0", "UCX_PROTO_ENABLE": "n"}

ucx_import_error: Exception | None = None
_ucxx_preloaded = "ucxx" in sys.modules
_env_before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
try:
    import ucxx as ucx
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull
except ImportError as exc:  # pragma: no cover - depends on the install
    try:
        import ucp as ucx  # type: ignore[no-redef]
    except ImportError:
        ucx = None
        ucx_import_error = exc
    Array = Tag = TagMaskFull = None  # type: ignore[assignment,misc]
# UCX settings ucxx's import put into this process's environment (its GPU-oriented
# defaults, e.g. UCX_RNDV_THRESH=8192). Every UCX context created later in the process reads
# them, NIXL's too: measured here, UCX_RNDV_THRESH=8192 turns NIXL's cross-process WRITE
# from zero-copy CMA (~10 GB/s) into software emulation over tcp/lo (~1 GB/s). The nixl
# transport hides them while it creates its agent (`nixl.nixl_ucx_env`). When ucxx was
# imported before this module (by other code of the process), its additions cannot be told
# from an operator's settings: every key of UCXX_DEFAULTS that holds ucxx's value is taken
# as ucxx's (measured: otherwise NIXL silently emulated its WRITEs over tcp/lo, a 4 MiB
# WRITE 1.5-1.75 ms instead of 0.85-0.9 ms over CMA).
if _ucxx_preloaded:
    UCXX_ENV = {k: v for k, v in UCXX_DEFAULTS.items() if os.environ.get(k) == v}
else:
    UCXX_ENV = {k: v for k, v in os.environ.items()
                if k.startswith("UCX_") and _env_before.get(k) != v}


def stop_notifier() -> None:
    """Stop ucxx's notifier thread (running when `UCXPY_ENABLE_PYTHON_FUTURE=1`): until it
    is stopped it keeps the process from exiting (ucxx documents this). Call once, when the
    process's last UCX transport has closed; a no-op when ucxx never started."""
    if ucx is not None and hasattr(ucx, "stop_notifier_thread"):
        ucx.stop_notifier_thread()


async def announce_worker(ep, timeout_s: float) -> None:
    """Receiver side of a new link: send this worker's UCX address (magic + length, then
    the address) on the listener endpoint `ep`."""
    address = bytes(ucx.get_worker_address())
    await timed(ep.send(_np(_ANNOUNCE.pack(_ANNOUNCE_MAGIC, len(address)))), timeout_s)
    await timed(ep.send(_np(address)), timeout_s)


async def sending_endpoint(ep, mode: str, timeout_s: float):
    """Sender side of a new link `ep`: read the receiver's announced worker address and, in
    error mode "none", return a new endpoint to it without peer error handling (post
    every message to the receiver on it, with `ep`'s tag); in mode "peer", None (send on
    `ep`). Raises ValueError on a malformed announcement."""
    head = np.empty(_ANNOUNCE.size, np.uint8)
    await timed(ep.recv(head), timeout_s)
    magic, n = _ANNOUNCE.unpack(head.tobytes())
    if magic != _ANNOUNCE_MAGIC or not 0 < n <= _ADDRESS_MAX:
        raise ValueError(f"bad worker address announcement {magic!r} ({n} bytes)")
    worker = np.empty(n, np.uint8)
    await timed(ep.recv(worker), timeout_s)
    if mode != "none":
        return None
    return await timed(ucx.create_endpoint_from_worker_address(
        ucx.get_ucx_address_from_buffer(worker.tobytes()), endpoint_error_handling=False),
        timeout_s)


def _np(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _abort(ep) -> None:
    with contextlib.suppress(Exception):
        ep.abort()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


def _done(value) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


def _address(view) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def _span(views) -> np.ndarray | None:
    """One array over views that lie back to back in memory, else None."""
    start = _address(views[0])
    pos = start
    for view in views:
        if _address(view) != pos:
            return None
        pos += view.nbytes
    return np.frombuffer((ctypes.c_uint8 * (pos - start)).from_address(start), np.uint8)


def _runs(frames: Iterable[Frame]) -> Iterator[list[Frame]]:
    """DATA frames grouped into runs: payloads back to back in memory, destination page ids
    consecutive, at most _RUN_BYTES and _RUN_PAGES a run; other frames alone. Lazy: a run
    is yielded as soon as the next frame (or the end) closes it, so the sender posts it
    while the frames after it are still being built (checksummed)."""
    run: list[Frame] = []
    end = last_dest = -1  # where the last DATA frame's payload ends, and its page id
    run_bytes = 0
    for frame in frames:
        h = decode_header(frame.header) if len(frame.payload) else None
        if (h is not None and run and len(run) < _RUN_PAGES
                and _address(frame.payload) == end and h.dest_page_id == last_dest + 1
                and run_bytes + len(frame.payload) <= _RUN_BYTES):
            run.append(frame)
            run_bytes += len(frame.payload)
        else:
            if run:
                yield run
            run, run_bytes = [frame], len(frame.payload)
        if h is None:
            end = last_dest = -1
        else:
            end, last_dest = _address(frame.payload) + len(frame.payload), h.dest_page_id
    if run:
        yield run


def _posting(ep) -> bool:
    """Whether requests can be posted on `ep` directly (UCXX), in order and without a
    coroutine per message; ucx-py falls back to `ep.send` / `ep.recv`."""
    return Array is not None and getattr(ep, "_ep", None) is not None


def _post_send_on(tx, ep, buf):
    """Post a tagged send of `buf` on endpoint `tx` with link `ep`'s message tag (tag
    matching is per UCX worker: the receiver's receives posted on `ep` match it)."""
    return tx._ep.tag_send(Array(buf), Tag(ep._tags["msg_send"]))


def _post_recv(ep, buf):
    """Post a tagged receive into `buf` now; returns the request."""
    return ep._ep.tag_recv(Array(buf), Tag(ep._tags["msg_recv"]), TagMaskFull)


class UcxTransport(TransportCore):
    """KVTransport over UCX; see the module docstring. `frame_filter` is the test-only
    frame hook (core.py); only `FaultInjectingTransport` passes one."""

    scheme = "ucx"
    # UCX reports peer loss with its own exception types.
    _lost = (Exception,)

    # Page receives kept posted while the next headers are read (64 MiB of 1 MiB pages).
    receive_window = 64
    drain_allocates = True  # a tagged message is received whole: drains are bounded first
    # Runs of pages adjacent in the sender's memory, for adjacent destination page ids, go
    # as one payload message (up to _RUN_BYTES); the receiver posts one receive for them.
    coalesces = True
    # Frames are built as they are posted: `_runs` yields each run once the next frame
    # closes it.
    lazy_frames = True
    # A run is posted before its pages are checksummed (DEFERRED frames; the COMMIT's digest
    # covers them): the sender checksums a run while the receiver copies it, instead of
    # before its first header, so the two overlap.
    defers_checksums = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, quarantine_s: float = 5.0,
                 error_mode: str | None = None,
                 on_event: EventCallback | None = None,
                 frame_filter: FrameFilter | None = None) -> None:
        if ucx is None:
            raise RuntimeError(f"ucx transport unavailable: {ucx_import_error}")
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, frame_filter=frame_filter)
        self.quarantine_s = quarantine_s
        # The last posted page receive of each inbound endpoint (its landing task).
        self._tail: dict[int, asyncio.Task] = {}
        # A header receive kept posted across `_recv_header(idle=True)` calls, by endpoint
        # (a posted UCX receive cannot be taken back: a new one would miss the message).
        self._headers: dict[int, asyncio.Task] = {}
        # The buffer of the last header receive, by endpoint: after its first header, the
        # rest of a run's headers (sent in the same message), for `_recv_run_headers`.
        self._run_headers: dict[int, np.ndarray] = {}
        # Outbound links in error mode "none": the endpoint (to the receiver's worker
        # address, no peer error handling) every sender->receiver message goes on, so they
        # stay in order; by the listener endpoint's id.
        self._tx_eps: dict[int, object] = {}
        # "auto" is resolved at the first connect (it needs ucxx's context, in the loop).
        self.error_mode = error_mode_setting(error_mode)

    async def start(self) -> str:
        if self._listener is None:
            self._listener = ucx.create_listener(self._on_connect, port=self.port)
            self.port = self._listener.port
            self.address = f"ucx://{self.host}:{self.port}"
        return self.address

    def _reusable(self, ep) -> bool:
        return not ep.closed

    def _discard(self, ep) -> None:
        _abort(ep)
        tx = self._tx_eps.pop(id(ep), None)
        if tx is not None:
            _abort(tx)
        self._tail.pop(id(ep), None)
        self._headers.pop(id(ep), None)  # ends with the endpoint (close() awaits it)
        self._run_headers.pop(id(ep), None)

    # -- receiver ----------------------------------------------------------------------
    def _on_connect(self, ep):
        if self._closed:
            _abort(ep)
            return None
        return self._spawn(self._accept(ep))

    async def _accept(self, ep) -> None:
        """Announce this worker's UCX address (the sender may send its frames to it on an
        endpoint without peer error handling, see `data_error_mode`), then serve the link."""
        if _posting(ep):
            try:
                await announce_worker(ep, self.progress_timeout_s)
            except asyncio.CancelledError:
                _abort(ep)
                raise
            except Exception:  # noqa: BLE001 - the sender left: nothing to serve
                _abort(ep)
                return
        await self._serve_link(ep)

    async def _recv_header(self, ep, progress_s: float | None, idle: bool = False) -> bytes:
        posted = self._headers.get(id(ep))
        if posted is None and not idle:
            return await self._recv_head(ep, progress_s)
        if posted is None:
            posted = self._spawn(self._recv_head(ep, None))
            posted.add_done_callback(_retrieve)
            self._headers[id(ep)] = posted
        done, _ = await asyncio.wait({posted}, timeout=progress_s)
        if not done:
            if idle:  # the receive stays posted for the next call
                raise LinkIdle(f"nothing for {progress_s}s")
            raise TimeoutError(f"no header within {progress_s}s")
        del self._headers[id(ep)]
        return posted.result()

    async def _drain(self, ep, length: int) -> None:
        await timed(ep.recv(np.empty(length, np.uint8)), self.progress_timeout_s)
        self.stats.bytes_drained += length

    async def _recv_page(self, ep, slot: Slot, h: FrameHeader):
        if not slot.live:
            await timed(ep.recv(np.empty(h.payload_len, np.uint8)), self.progress_timeout_s)
            return None
        dest = _np(slot.dest(h))
        if not _posting(ep):  # ucx-py: one awaited receive
            self._table.write_started(slot)
            try:
                await timed(ep.recv(dest), self.progress_timeout_s)
            except BaseException:
                _abort(ep)
                await asyncio.sleep(0)
                raise
            finally:
                self._table.write_ended(slot)
            return None
        # Synchronous from the caller's check of the header to here: the slot is live when
        # the receive is posted, and from now on it counts as an unstoppable write.
        return self._post_landing(ep, slot, [h], dest)

    async def _recv_head(self, ep, progress_s: float | None) -> bytes:
        """One header message: a header, or the headers of a run of pages (the first one
        announcing the run in `aux`). Received into room for `receive_window` headers
        (UCX takes a shorter message into a larger buffer; the rest stays zero) and
        returns the first; the others wait for `_recv_run_headers`. A longer message is
        a lost peer (UCX reports it truncated). ucx-py (no runs: its senders post one
        message per header) refuses a message shorter than its buffer: exactly one header."""
        room = max(1, self.receive_window) if _posting(ep) else 1
        buf = np.zeros(room * HEADER_SIZE, np.uint8)
        await timed(ep.recv(buf), progress_s)
        self._run_headers[id(ep)] = buf
        return buf[:HEADER_SIZE].tobytes()

    async def _recv_run_headers(self, ep, n: int, progress: float) -> list[bytes]:
        """The rest of a run's headers came in the run's first header message (one receive
        instead of two: each costs a hand-off from UCX's progress thread to the event
        loop, measured 0.3-0.6 ms here). Missing ones read as zeros: they fail their
        checks (bad magic), and the link ends."""
        data = self._run_headers.pop(id(ep), b"")[HEADER_SIZE:]
        return [bytes(data[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]).ljust(HEADER_SIZE, b"\0")
                for i in range(n)]

    async def _recv_run(self, ep, slot: Slot, run: list[FrameHeader]):
        """One posted receive for a checked run of pages: straight into the pages when they
        are adjacent in memory, else into a buffer copied into them once it landed (while
        the slot is live)."""
        views = [slot.dest(x) for x in run]
        total = sum(v.nbytes for v in views)
        span = _span(views)
        if span is None or not _posting(ep):
            buf = np.empty(total, np.uint8)
            await self._wait_run(ep, buf)  # not into the pages: nothing to fence
            if not slot.live:
                return _done(None)
            pos = 0
            for view in views:
                view[:] = buf[pos:pos + view.nbytes]
                pos += view.nbytes
            return _done(self._pages_done(slot, run))
        return self._post_landing(ep, slot, run, span)

    async def _wait_run(self, ep, buf) -> None:
        await timed(ep.recv(buf), self.progress_timeout_s)

    def _pages_done(self, slot: Slot, run: list[FrameHeader],
                    sums: list[int] | None = None) -> bytes | None:
        nack = None
        for i, x in enumerate(run):
            bad = self._table.data_done(slot, x, None if sums is None else sums[i])
            nack = nack or bad
        return nack

    def _post_landing(self, ep, slot: Slot, run: list[FrameHeader], dest):
        req = _post_recv(ep, dest)
        self._table.write_started(slot)
        task = self._spawn(self._land(ep, slot, run, req, self._tail.get(id(ep))))
        task.add_done_callback(_retrieve)  # its error is the link reader's to report
        self._tail[id(ep)] = task
        return task

    async def _land(self, ep, slot: Slot, run: list[FrameHeader], req,
                    previous: asyncio.Task | None) -> bytes | None:
        """Ends when the posted receive has ended, and checks its pages (`data_done`).
        Bounded on its own, whatever the link's reader does: the page must land within
        `progress_timeout_s` of the previous one, else the endpoint is torn down (UCX then
        cancels the receive); a receive still not ended `quarantine_s` later is a write
        whose end is unknown (the slot fails QUARANTINED). Only the oldest landing of a
        link waits on its request: without ucxx's Python futures a request's `wait()`
        polls the event loop, and 64 of them at once cost more CPU than the copy."""
        wait: asyncio.Future | None = None
        try:
            if previous is not None:
                await asyncio.wait({previous})
            wait = asyncio.ensure_future(req.wait())
            done, _ = await asyncio.wait({wait}, timeout=self.progress_timeout_s)
            if not done:
                _abort(ep)
                done, _ = await asyncio.wait({wait}, timeout=self.quarantine_s)
            if not done:
                wait.cancel()
                self._table.write_unknown(slot, f"posted receive for page {run[0].page_index} "
                                          "neither completed nor cancelled")
                raise TimeoutError(f"page {run[0].page_index}: no progress")
            wait.result()  # UCX's error (cancelled, endpoint lost) means a lost peer
        except asyncio.CancelledError:  # close(): the receive may still be live
            if wait is None:
                wait = asyncio.ensure_future(req.wait())
            if not wait.done():
                _abort(ep)  # UCX cancels the receive; close() awaits this task
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({wait}, timeout=self.quarantine_s)
            if not wait.done():
                wait.cancel()
                self._table.write_unknown(slot, "transport closed with a receive posted")
            raise
        finally:
            if wait is not None and wait.done():
                self._table.write_ended(slot)
        return await self._checked(slot, run)

    async def _checked(self, slot: Slot, run: list[FrameHeader]) -> bytes | None:
        """Check landed pages (`data_done`). A run of `_THREAD_SUM_BYTES` or more is
        checksummed in a worker thread first (xxhash releases the GIL): meanwhile the event
        loop reads the next run's headers and posts its receive, so UCX copies the next run
        while this one is summed (64 MiB here: 1.83 -> 2.12 GB/s). Its pages are no longer
        written (the receive ended); should the slot fail meanwhile, `data_done` ignores
        the sums."""
        if sum(x.payload_len for x in run) < _THREAD_SUM_BYTES or not slot.live:
            return self._pages_done(slot, run)
        views = [slot.views[x.page_index] for x in run]
        sums = await asyncio.get_running_loop().run_in_executor(_summer(), _checksums, views)
        return self._pages_done(slot, run, sums)

    async def _landed(self, ep, landing: asyncio.Task) -> bytes | None:
        return await asyncio.shield(landing)  # bounded by the landing itself

    async def _send_reply(self, ep, frame: bytes) -> None:
        """A reply frame (or a sender's abort NACK): header message, then its payload
        message if any."""
        for part in (frame[:HEADER_SIZE], frame[HEADER_SIZE:]):
            if len(part):
                await self._send_message(ep, part)

    # -- sender ------------------------------------------------------------------------
    async def _open(self, address: str, rid: str):
        try:
            host, port = parse_address(address, self.scheme)
        except ValueError as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
        # A first loopback connect on a loaded 2-core machine measured ~1 s.
        connect_s = max(self.progress_timeout_s, 1.5)
        try:
            ep = await timed(ucx.create_endpoint(host, port), connect_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises many kinds; all mean peer lost
            raise TransferError(rid, Reason.PEER_LOST, f"connect {address}: {exc!r}") from None
        if not _posting(ep):
            return ep
        try:
            if self.error_mode == "auto":
                self.error_mode = data_error_mode("auto")
            tx = await sending_endpoint(ep, self.error_mode, connect_s)
            if tx is not None:
                self._tx_eps[id(ep)] = tx
            return ep
        except BaseException as exc:
            self._discard(ep)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise TransferError(rid, Reason.PEER_LOST, f"connect {address}: {exc!r}") from None

    async def _recv_bytes(self, ep, n: int, progress_s: float | None) -> bytes:
        buf = np.empty(n, dtype=np.uint8)
        await timed(ep.recv(buf), progress_s)
        return buf.tobytes()

    async def _send_frame(self, ep, frame: Frame) -> None:
        """Two tagged messages: the header, then the page (a COMMIT has none)."""
        await self._send_buffers(ep, (frame.header, frame.payload))
        self.stats.frames_sent += 1

    async def _cut(self, ep, cut: Cut) -> None:
        # A UCX message cannot be cut mid-way: the peer sees the endpoint die.
        await self._send_buffers(ep, cut.whole)
        _abort(ep)

    async def _stream(self, ep, frames, reply: asyncio.Task) -> None:
        """Post every message of the frames as soon as their run is built (UCX pipelines
        them), checksum each posted run's DEFERRED pages while UCX moves them, then wait for
        the messages in order, each within the progress timeout. (core sends the COMMIT of
        DEFERRED pages in a call of its own, after these.)"""
        if not _posting(ep):
            await self._emit(ep, frames, reply)
            return
        posted = []
        tx = self._tx_eps.get(id(ep), ep)
        turns = LoopTurns(self.loop_turn_s)
        for run in _runs(frames):
            headers = [f.header for f in run]
            if len(run) > 1:  # the first header announces the run (`aux`); all go at once
                first = decode_header(headers[0])._replace(aux=len(run))
                headers = [encode_header(**first._asdict(), key=run[0].key)
                           + b"".join(headers[1:])]
                payloads = [_span([f.payload for f in run])]
            else:
                payloads = [run[0].payload] if len(run[0].payload) else []
            for buf in (*headers, *payloads):
                array = _np(buf)
                posted.append((array, _post_send_on(tx, ep, array)))
            self.stats.frames_sent += len(run)
            for f in run:  # DEFERRED pages: checksummed while UCX moves them
                if f.source is not None:
                    f.source.settle(f.index)
                    await turns.take()
        for array, req in posted:
            await timed(req.wait(), self.progress_timeout_s)
            self.stats.bytes_sent += array.nbytes

    async def _send_buffers(self, ep, buffers) -> None:
        for buf in buffers:
            if len(buf):
                await self._send_message(ep, buf)
                self.stats.bytes_sent += len(buf)

    async def _send_message(self, ep, buf) -> None:
        """One message, on the link's sending endpoint (`_tx_eps`: every message from a
        sender to a receiver goes on one endpoint, so they arrive in order)."""
        if _posting(ep):
            req = _post_send_on(self._tx_eps.get(id(ep), ep), ep, _np(buf))
            await timed(req.wait(), self.progress_timeout_s)
        else:
            await timed(ep.send(_np(buf)), self.progress_timeout_s)
