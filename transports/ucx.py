"""UCX data plane (UCXX; ucx-py's `ucp` is accepted when that is what is installed).

Same frames and the same receiver checks (`ReceiveTable`) as TCP; each frame is two tagged
messages on the endpoint: the 80-byte header, then the page, which the receiver posts
straight into the destination page (`np.frombuffer(view, np.uint8)`) after the header was
checked. A posted UCX receive cannot be taken back, so the slot counts it as an
unstoppable write: `fence()` and every failure wait for it to end before poisoning and
reporting (and abort the endpoint when it stalls). UCX does not report a frozen peer
(measured: 24 s+), so every wait during a transfer has our own progress timeout.
Env vars: see transports/README.md (UCX_TLS, UCXPY_PROGRESS_MODE, ...).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from .base import EventCallback, TransferPlan
from .core import TransportCore, parse_address, reason_of
from .errors import FrameError, Reason, TransferError
from .faults import Delay, FaultPlan, Frame
from .framing import HEADER_SIZE, FrameHeader, Kind, decode_header
from .receiver import nack_frame

ucx_import_error: Exception | None = None
try:
    import ucxx as ucx
except ImportError as exc:  # pragma: no cover - depends on the install
    try:
        import ucp as ucx  # type: ignore[no-redef]
    except ImportError:
        ucx = None
        ucx_import_error = exc

_NO_RESERVATION = bytes(16)
_LOST = (EOFError, OSError, TimeoutError)


def _np(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


class UcxTransport(TransportCore):
    """KVTransport over UCX; see the module docstring."""

    scheme = "ucx"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, on_event: EventCallback | None = None,
                 faults: FaultPlan | None = None) -> None:
        if ucx is None:
            raise RuntimeError(f"ucx transport unavailable: {ucx_import_error}")
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, faults=faults)
        self._eps: dict[int, object] = {}
        self._next_id = 0

    async def start(self) -> str:
        if self._listener is None:
            self._listener = ucx.create_listener(self._on_connect, port=self.port)
            self.port = self._listener.port
            self.address = f"ucx://{self.host}:{self.port}"
        return self.address

    def _close_links(self) -> None:
        for eps in self._idle.values():
            for ep in eps:
                _abort(ep)
        for ep in list(self._eps.values()):
            _abort(ep)

    async def _timed(self, awaitable, timeout: float | None):
        if timeout is None:
            return await awaitable
        async with asyncio.timeout(timeout):
            return await awaitable

    # -- receiver ----------------------------------------------------------------------
    def _post_nack(self, conn_id: int, frame: bytes) -> None:
        ep = self._eps.get(conn_id)
        if ep is not None:
            self._spawn(self._send_quietly(ep, frame))

    async def _send_quietly(self, ep, frame: bytes) -> None:
        with contextlib.suppress(Exception):
            await self._send_frame(ep, frame)

    async def _send_frame(self, ep, frame: bytes) -> None:
        """A reply frame: header message, then its payload message if any."""
        await self._timed(ep.send(_np(frame[:HEADER_SIZE])), self.progress_timeout_s)
        if len(frame) > HEADER_SIZE:
            await self._timed(ep.send(_np(frame[HEADER_SIZE:])), self.progress_timeout_s)

    def _on_connect(self, ep):
        if self._closed:
            _abort(ep)
            return None
        return self._spawn(self._serve(ep))

    async def _serve(self, ep) -> None:
        conn_id = self._next_id = self._next_id + 1
        self._eps[conn_id] = ep
        header = np.empty(HEADER_SIZE, dtype=np.uint8)
        progress = self.progress_timeout_s
        reason, detail = Reason.PEER_LOST, "peer closed the endpoint"
        try:
            while True:
                idle = not self._table.bound_to(conn_id)
                await self._timed(ep.recv(header), None if idle else progress)
                try:
                    h = decode_header(header.tobytes())
                except FrameError as exc:
                    reason, detail = Reason.BAD_HEADER, exc.detail
                    self.stats.frames_rejected[reason] += 1
                    await self._send_frame(ep, nack_frame(_NO_RESERVATION, 0, reason, detail))
                    break
                if h.kind is Kind.DATA:
                    slot, nack = self._table.check_data(h, conn_id)
                    if slot is None:
                        await self._timed(ep.recv(np.empty(h.payload_len, np.uint8)), progress)
                        self.stats.bytes_drained += h.payload_len
                    else:
                        await self._recv_page(ep, slot, h)
                        nack = self._table.data_done(slot, h)
                    if nack is not None:
                        await self._send_frame(ep, nack)
                elif h.kind is Kind.COMMIT:
                    await self._send_frame(ep, self._table.check_commit(h, conn_id))
                else:
                    reason, detail = Reason.BAD_HEADER, f"{h.kind.name} frame sent to a receiver"
                    break
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # UCX reports peer loss with its own exception types
            reason, detail = Reason.PEER_LOST, f"{type(exc).__name__}: {exc}"
        finally:
            self._table.conn_lost(conn_id, reason, detail)
            self._eps.pop(conn_id, None)
            _abort(ep)

    async def _recv_page(self, ep, slot, h: FrameHeader) -> None:
        if not slot.live:
            await self._timed(ep.recv(np.empty(h.payload_len, np.uint8)), self.progress_timeout_s)
            return
        dest = _np(slot.dest(h))
        slot.writing += 1
        try:
            await self._timed(ep.recv(dest), self.progress_timeout_s)
        except BaseException:
            # The posted receive may still be live inside UCX: tear the endpoint down so
            # it is cancelled before the slot is poisoned and reported.
            _abort(ep)
            await asyncio.sleep(0)
            raise
        finally:
            self._table.write_ended(slot)

    # -- sender ------------------------------------------------------------------------
    async def _connect(self, address: str, rid: str):
        idle = self._idle.get(address, [])
        while idle:
            ep = idle.pop()
            if not ep.closed:
                return ep
        try:
            host, port = parse_address(address, self.scheme)
        except ValueError as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
        try:
            return await self._timed(ucx.create_endpoint(host, port),
                                     2 * self.progress_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise TransferError(rid, Reason.PEER_LOST, f"connect {address}: {exc!r}") from None

    async def _deliver(self, address: str, plan: TransferPlan, key: bytes, frames) -> None:
        rid = plan.reservation_id
        ep = await self._connect(address, rid)
        reply = self._spawn(self._read_reply(ep))
        reusable = False
        try:
            try:
                await self._send_frames(ep, frames, reply)
                h, detail = await self._timed(asyncio.shield(reply), self.progress_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await asyncio.wait({reply}, timeout=0.05)
                if not reply.done() or reply.cancelled() or reply.exception() is not None:
                    raise TransferError(rid, Reason.PEER_LOST, f"{type(exc).__name__}: {exc}") from None
                h, detail = reply.result()
            if h.kind is Kind.ACK and h.reservation == key and h.token_count == plan.num_tokens:
                reusable = True
                return
            if h.kind is Kind.NACK:
                raise TransferError(rid, reason_of(h.aux), detail)
            raise TransferError(rid, Reason.BAD_HEADER, f"unexpected reply {h.kind.name}")
        finally:
            reply.cancel()
            await asyncio.gather(reply, return_exceptions=True)
            if reusable and not self._closed:
                self._idle.setdefault(address, []).append(ep)
            else:
                _abort(ep)

    async def _read_reply(self, ep) -> tuple[FrameHeader, str]:
        header = np.empty(HEADER_SIZE, dtype=np.uint8)
        await ep.recv(header)
        try:
            h = decode_header(header.tobytes())
        except FrameError as exc:
            raise EOFError(f"malformed reply: {exc.detail}") from None
        detail = b""
        if h.payload_len:
            buf = np.empty(h.payload_len, dtype=np.uint8)
            await self._timed(ep.recv(buf), self.progress_timeout_s)
            detail = buf.tobytes()
        return h, detail.decode(errors="replace")

    async def _send_frames(self, ep, frames: list[Frame], reply: asyncio.Task) -> None:
        faults = self.faults
        items = faults.apply(frames) if faults is not None else frames
        budget = faults.cut_after if faults is not None else None
        progress = self.progress_timeout_s
        for item in items:
            if isinstance(item, Delay):
                await asyncio.sleep(item.seconds)
                continue
            if reply.done():
                return
            for buf in (item.header, item.payload):
                if not len(buf):
                    continue
                if budget is not None and len(buf) >= budget:
                    # A UCX message cannot be cut mid-way: the peer sees the endpoint die.
                    _abort(ep)
                    raise ConnectionResetError("fault injected: stream cut")
                if budget is not None:
                    budget -= len(buf)
                await self._timed(ep.send(_np(buf)), progress)
                self.stats.bytes_sent += len(buf)
            self.stats.frames_sent += 1


def _abort(ep) -> None:
    with contextlib.suppress(Exception):
        ep.abort()
