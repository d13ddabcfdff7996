"""TCP data plane: raw non-blocking asyncio sockets, one frame header + one page per frame.

Sender: headers and pages go out with `sendmsg` straight from the pool's memory (no
per-page copies; several frames per syscall). Receiver: reads the 80-byte header, checks it
against the live expectation (`ReceiveTable`), then `recv_into` the destination page itself;
rejected payloads are read into a scratch buffer. One transfer at a time per connection;
idle connections are pooled per address.
"""

from __future__ import annotations

import asyncio
import itertools
import socket

from ._sock import RawSocket, tune
from .base import EventCallback, TransferPlan
from .core import TransportCore, parse_address, reason_of
from .errors import FrameError, Reason, TransferError
from .faults import Delay, FaultPlan, Frame
from .framing import HEADER_SIZE, FrameHeader, Kind, decode_header
from .receiver import nack_frame

_SCRATCH_BYTES = 1 << 20
_BATCH_BYTES = 8 << 20
_BATCH_FRAMES = 128
_NO_RESERVATION = bytes(16)


class TcpTransport(TransportCore):
    """KVTransport over TCP. `progress_timeout_s` bounds every wait for the peer while a
    transfer is in flight (a frozen or vanished peer fails within it on both sides)."""

    scheme = "tcp"
    lazy_frames = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, on_event: EventCallback | None = None,
                 faults: FaultPlan | None = None) -> None:
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, faults=faults)
        self._listener: socket.socket | None = None
        self._conns: dict[int, RawSocket] = {}
        self._ids = itertools.count()

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

    def _close_links(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()

    # -- receiver ----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            tune(sock)
            self._spawn(self._serve(RawSocket(sock)))

    def _post_nack(self, conn_id: int, frame: bytes) -> None:
        conn = self._conns.get(conn_id)
        if conn is not None and not conn.closed:
            self._spawn(self._send_quietly(conn, frame))

    async def _send_quietly(self, conn: RawSocket, frame: bytes) -> None:
        try:
            await conn.send_all([frame], self.progress_timeout_s)
        except (OSError, EOFError):
            pass  # the reader of that connection reports the loss

    async def _serve(self, conn: RawSocket) -> None:
        conn_id = next(self._ids)
        self._conns[conn_id] = conn
        header = memoryview(bytearray(HEADER_SIZE))
        scratch = memoryview(bytearray(_SCRATCH_BYTES))
        progress = self.progress_timeout_s
        reason, detail = Reason.PEER_LOST, "peer closed the connection"
        try:
            while True:
                idle = not self._table.bound_to(conn_id)
                if not await conn.recv_exact(header, None if idle else progress, eof_ok=True):
                    break
                try:
                    h = decode_header(header)
                except FrameError as exc:
                    reason, detail = Reason.BAD_HEADER, exc.detail
                    self.stats.frames_rejected[Reason.BAD_HEADER] += 1
                    await conn.send_all(
                        [nack_frame(_NO_RESERVATION, 0, reason, detail)], progress)
                    break
                if h.kind is Kind.DATA:
                    slot, nack = self._table.check_data(h, conn_id)
                    if slot is None:
                        await self._drain(conn, scratch, h.payload_len)
                    else:
                        await self._recv_page(conn, scratch, slot, h)
                        nack = self._table.data_done(slot, h)
                    if nack is not None:
                        await conn.send_all([nack], progress)
                elif h.kind is Kind.COMMIT:
                    await conn.send_all([self._table.check_commit(h, conn_id)], progress)
                else:
                    reason, detail = Reason.BAD_HEADER, f"{h.kind.name} frame sent to a receiver"
                    break
        except (OSError, EOFError) as exc:
            reason, detail = Reason.PEER_LOST, f"{type(exc).__name__}: {exc}"
        finally:
            self._table.conn_lost(conn_id, reason, detail)
            del self._conns[conn_id]
            conn.close()

    async def _drain(self, conn: RawSocket, scratch: memoryview, length: int) -> None:
        while length:
            chunk = min(length, scratch.nbytes)
            await conn.recv_exact(scratch[:chunk], self.progress_timeout_s)
            length -= chunk
            self.stats.bytes_drained += chunk

    async def _recv_page(self, conn: RawSocket, scratch: memoryview, slot, h: FrameHeader) -> None:
        view = slot.dest(h)
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

    # -- sender ------------------------------------------------------------------------
    async def _deliver(self, address: str, plan: TransferPlan, key: bytes, frames) -> None:
        rid = plan.reservation_id
        conn = await self._checkout(address, rid)
        reply = self._spawn(self._read_reply(conn))
        reusable = False
        try:
            try:
                if self.faults is not None:
                    await self._send_faulty(conn, frames, reply)
                else:
                    await self._send_batched(conn, frames, reply)
                async with asyncio.timeout(self.progress_timeout_s):
                    h, detail = await asyncio.shield(reply)
            except (OSError, EOFError, TimeoutError) as exc:
                # Prefer the receiver's own verdict if it arrived just before the loss.
                await asyncio.wait({reply}, timeout=0.05)
                if not reply.done() or reply.cancelled() or reply.exception() is not None:
                    raise TransferError(rid, Reason.PEER_LOST, f"{type(exc).__name__}: {exc}") from None
                h, detail = reply.result()
            if h.kind is Kind.ACK and h.reservation == key and h.token_count == plan.num_tokens:
                reusable = True
                return plan.num_pages
            if h.kind is Kind.NACK:
                raise TransferError(rid, reason_of(h.aux), detail)
            raise TransferError(rid, Reason.BAD_HEADER, f"unexpected reply {h.kind.name}")
        finally:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            if reusable and not self._closed:
                self._idle.setdefault(address, []).append(conn)
            else:
                conn.close()

    async def _checkout(self, address: str, rid: str) -> RawSocket:
        idle = self._idle.get(address, [])
        while idle:
            conn = idle.pop()
            if conn.looks_alive():
                return conn
            conn.close()
        try:
            host, port = parse_address(address, self.scheme)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
        except (ValueError, OSError) as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, f"bad address {address!r}: {exc}") from None
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self.progress_timeout_s):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise TransferError(rid, Reason.PEER_LOST, f"connect {address}: {exc!r}") from None
        tune(sock)
        return RawSocket(sock)

    async def _read_reply(self, conn: RawSocket) -> tuple[FrameHeader, str]:
        header = memoryview(bytearray(HEADER_SIZE))
        await conn.recv_exact(header, None)
        try:
            h = decode_header(header)
        except FrameError as exc:
            raise EOFError(f"malformed reply: {exc.detail}") from None
        detail = b""
        if h.payload_len:
            buf = bytearray(h.payload_len)
            await conn.recv_exact(memoryview(buf), self.progress_timeout_s)
            detail = bytes(buf)
        return h, detail.decode(errors="replace")

    async def _send_batched(self, conn: RawSocket, frames, reply: asyncio.Task) -> None:
        batch: list[bytes | memoryview] = []
        size = 0
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
        if batch and not reply.done():
            self._count_sent(await conn.send_all(batch, self.progress_timeout_s), batch)

    def _count_sent(self, sent: int, batch: list) -> None:
        self.stats.bytes_sent += sent
        self.stats.frames_sent += sum(1 for b in batch if len(b) == HEADER_SIZE)

    async def _send_faulty(self, conn: RawSocket, frames: list[Frame], reply) -> None:
        assert self.faults is not None
        budget = self.faults.cut_after
        for item in self.faults.apply(frames):
            if isinstance(item, Delay):
                await asyncio.sleep(item.seconds)
                continue
            if reply.done():
                return
            for buf in (item.header, item.payload):
                view = memoryview(buf)
                if budget is not None and view.nbytes >= budget:
                    await conn.send_all([view[:budget]], self.progress_timeout_s)
                    conn.close(reset=self.faults.reset_after is not None)
                    raise ConnectionResetError("fault injected: stream cut")
                if budget is not None:
                    budget -= view.nbytes
                self.stats.bytes_sent += await conn.send_all([view], self.progress_timeout_s)
