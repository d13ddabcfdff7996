"""TCP data plane: raw non-blocking asyncio sockets, one frame header + one page per frame.

Sender: headers and pages go out with `sendmsg` straight from the pool's memory (no
per-page copies; several frames per syscall). Receiver: reads the 96-byte header, checks it
against the live expectation (`ReceiveTable`), then `recv_into` the destination page itself;
rejected payloads are read into a scratch buffer. One transfer at a time per connection;
idle connections are pooled per address. What TCP shares with UCX is in core.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from ._sock import RawSocket, tune
from .base import EventCallback
from .core import Cut, Frame, FrameFilter, LoopTurns, TransportCore, parse_address
from .errors import Reason, TransferError
from .framing import HEADER_SIZE, FrameHeader
from .receiver import Slot

log = logging.getLogger(__name__)

_SCRATCH_BYTES = 1 << 20
_ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest pause after a failed accept()
# Frames per sendmsg: up to 1 MiB (or 128 frames). Each batch is checksummed right before
# it is sent, so the kernel's copy reads it from L2, where the checksum just left it: 8 MiB
# batches were read from memory twice (measure with `pdmesh bench transport`).
_BATCH_BYTES = 1 << 20
_BATCH_FRAMES = 128


class TcpTransport(TransportCore):
    """KVTransport over TCP. `progress_timeout_s` bounds every wait for the peer while a
    transfer is in flight (a frozen or vanished peer fails within it on both sides).
    `frame_filter` is the test-only frame hook (core.py); only `FaultInjectingTransport`
    passes one."""

    scheme = "tcp"
    lazy_frames = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, on_event: EventCallback | None = None,
                 frame_filter: FrameFilter | None = None) -> None:
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, frame_filter=frame_filter)
        # Rejected payloads are read here and never looked at: links may share it.
        self._scratch: memoryview | None = None

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> str:
        if self._listener is not None:
            return self.address
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.address = f"tcp://{self.host}:{self.port}"
        self._spawn(self._accept_loop())
        return self.address

    def _reusable(self, conn: RawSocket) -> bool:
        return conn.looks_alive()

    def _discard(self, conn: RawSocket) -> None:
        conn.close()

    # -- receiver ----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        """Accept for ever: a failed accept (EMFILE, ENFILE, ENOBUFS, ...) is logged and
        retried with back-off; meanwhile `accepting` is False (the service reports not
        ready) until a descriptor can be had again."""
        loop = asyncio.get_running_loop()
        pause = _ACCEPT_BACKOFF_S[0]
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # guard: accept-loop
                self.stats.accept_errors += 1
                if self.accepting:
                    log.warning("data plane %s cannot accept: %s; retrying", self.address, exc)
                self.accepting = False
                await asyncio.sleep(pause)
                pause = min(2 * pause, _ACCEPT_BACKOFF_S[1])
                self._probe_descriptors()
                continue
            pause = _ACCEPT_BACKOFF_S[0]
            if not self.accepting:
                log.warning("data plane %s accepts again", self.address)
            self.accepting = True
            try:
                tune(sock)
                link = RawSocket(sock)
            except OSError:
                sock.close()
                continue
            self._spawn(self._serve_link(link))

    def _probe_descriptors(self) -> None:
        """After accept errors: ready again once a descriptor can be had (no connection may
        be pending to prove it by an accept)."""
        try:
            os.close(os.dup(self._listener.fileno()))
        except OSError:
            return
        self.accepting = True

    async def _recv_header(self, conn: RawSocket, progress_s: float | None,
                           idle: bool = False) -> bytes | None:
        header = bytearray(HEADER_SIZE)
        if not await conn.recv_exact(memoryview(header), progress_s, eof_ok=True, idle=idle):
            return None
        return header

    def _scratch_buffer(self) -> memoryview:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch

    async def _drain(self, conn: RawSocket, length: int) -> None:
        scratch = self._scratch_buffer()
        while length:
            chunk = min(length, scratch.nbytes)
            await conn.recv_exact(scratch[:chunk], self.progress_timeout_s)
            length -= chunk
            self.stats.bytes_drained += chunk

    async def _recv_page(self, conn: RawSocket, slot: Slot, h: FrameHeader) -> None:
        view = slot.dest(h)
        scratch = self._scratch_buffer()
        pos, total = 0, h.payload_len
        while pos < total:
            # Synchronous from here to recv_into: a fence() cannot slip in between.
            buf = view[pos:] if slot.live else scratch[: min(scratch.nbytes, total - pos)]
            try:
                n = conn.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                await conn.wait_readable(self.progress_timeout_s)
                continue
            if n == 0:
                raise EOFError(f"stream truncated in page {h.page_index} after {pos} bytes")
            pos += n

    async def _send_reply(self, conn: RawSocket, frame: bytes) -> None:
        await conn.send_all([frame], self.progress_timeout_s)

    # -- sender ------------------------------------------------------------------------
    async def _open(self, address: str, rid: str) -> RawSocket:
        try:
            host, port = parse_address(address, self.scheme)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except (ValueError, OSError) as exc:
            raise TransferError(rid, Reason.INVALID_PLAN,
                                f"bad address {address!r}: {exc}") from None
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.progress_timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise TransferError(rid, Reason.PEER_LOST, f"connect {address}: {exc!r}") from None
        tune(sock)
        return RawSocket(sock)

    async def _recv_bytes(self, conn: RawSocket, n: int, progress_s: float | None) -> bytes:
        buf = bytearray(n)
        await conn.recv_exact(memoryview(buf), progress_s)
        return bytes(buf)

    async def _stream(self, conn: RawSocket, frames, reply: asyncio.Task) -> None:
        """Many frames per `sendmsg` (up to _BATCH_BYTES or 128 frames a batch), frames
        built lazily, batch by batch, so that a page is sent while still in cache."""
        batch: list[bytes | memoryview] = []
        size = 0
        turns = LoopTurns(self.loop_turn_s)
        for frame in frames:
            batch.append(frame.header)
            if len(frame.payload):
                batch.append(frame.payload)
            size += HEADER_SIZE + len(frame.payload)
            if size >= _BATCH_BYTES or len(batch) >= 2 * _BATCH_FRAMES:
                if reply.done():
                    return  # the receiver already answered (a NACK): stop sending
                self._count_sent(await conn.send_all(batch, self.progress_timeout_s), batch)
                batch, size = [], 0
                await turns.take()
        if batch and not reply.done():
            self._count_sent(await conn.send_all(batch, self.progress_timeout_s), batch)

    def _count_sent(self, sent: int, batch: list) -> None:
        self.stats.bytes_sent += sent
        self.stats.frames_sent += sum(1 for b in batch if len(b) == HEADER_SIZE)

    async def _send_frame(self, conn: RawSocket, frame: Frame) -> None:
        buffers = [b for b in (frame.header, frame.payload) if len(b)]
        self.stats.bytes_sent += await conn.send_all(buffers, self.progress_timeout_s)
        self.stats.frames_sent += 1

    async def _cut(self, conn: RawSocket, cut: Cut) -> None:
        for buf in cut.whole:
            self.stats.bytes_sent += await conn.send_all([buf], self.progress_timeout_s)
        await conn.send_all([cut.partial], self.progress_timeout_s)
        conn.close(reset=cut.reset)
