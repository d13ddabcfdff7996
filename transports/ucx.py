"""UCX data plane (UCXX; ucx-py's `ucp` is accepted when that is what is installed).

Same frames and the same receiver checks (`ReceiveTable`) as TCP; each frame is two tagged
messages on the endpoint: the 80-byte header, then the page, which the receiver posts
straight into the destination page (`np.frombuffer(view, np.uint8)`) after the header was
checked. A posted UCX receive cannot be taken back, so the slot counts it as an
unstoppable write: `fence()` and every failure wait for it to end before poisoning and
reporting (and abort the endpoint when it stalls). UCX does not report a frozen peer
(measured: 24 s+), so every wait during a transfer has our own progress timeout.
What UCX shares with TCP is in core.py. Env vars: see transports/README.md (UCX_TLS,
UCXPY_PROGRESS_MODE, ...).
"""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from .base import EventCallback
from .core import Cut, Frame, FrameFilter, TransportCore, parse_address, timed
from .errors import Reason, TransferError
from .framing import HEADER_SIZE, FrameHeader
from .receiver import Slot

ucx_import_error: Exception | None = None
try:
    import ucxx as ucx
except ImportError as exc:  # pragma: no cover - depends on the install
    try:
        import ucp as ucx  # type: ignore[no-redef]
    except ImportError:
        ucx = None
        ucx_import_error = exc


def _np(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _abort(ep) -> None:
    with contextlib.suppress(Exception):
        ep.abort()


class UcxTransport(TransportCore):
    """KVTransport over UCX; see the module docstring. `frame_filter` is the test-only
    frame hook (core.py); only `FaultInjectingTransport` passes one."""

    scheme = "ucx"
    # UCX reports peer loss with its own exception types.
    _lost = (Exception,)

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 progress_timeout_s: float = 0.75, on_event: EventCallback | None = None,
                 frame_filter: FrameFilter | None = None) -> None:
        if ucx is None:
            raise RuntimeError(f"ucx transport unavailable: {ucx_import_error}")
        super().__init__(host, port, progress_timeout_s=progress_timeout_s,
                         on_event=on_event, frame_filter=frame_filter)

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

    # -- receiver ----------------------------------------------------------------------
    def _on_connect(self, ep):
        if self._closed:
            _abort(ep)
            return None
        return self._spawn(self._serve_link(ep))

    async def _recv_header(self, ep, progress_s: float | None) -> bytes:
        return await self._recv_bytes(ep, HEADER_SIZE, progress_s)

    async def _drain(self, ep, length: int) -> None:
        await timed(ep.recv(np.empty(length, np.uint8)), self.progress_timeout_s)
        self.stats.bytes_drained += length

    async def _recv_page(self, ep, slot: Slot, h: FrameHeader) -> None:
        if not slot.live:
            await timed(ep.recv(np.empty(h.payload_len, np.uint8)), self.progress_timeout_s)
            return
        dest = _np(slot.dest(h))
        slot.writing += 1
        try:
            await timed(ep.recv(dest), self.progress_timeout_s)
        except BaseException:
            # The posted receive may still be live inside UCX: tear the endpoint down so
            # it is cancelled before the slot is poisoned and reported.
            _abort(ep)
            await asyncio.sleep(0)
            raise
        finally:
            self._table.write_ended(slot)

    async def _send_reply(self, ep, frame: bytes) -> None:
        """A reply frame: header message, then its payload message if any."""
        await timed(ep.send(_np(frame[:HEADER_SIZE])), self.progress_timeout_s)
        if len(frame) > HEADER_SIZE:
            await timed(ep.send(_np(frame[HEADER_SIZE:])), self.progress_timeout_s)

    # -- sender ------------------------------------------------------------------------
    async def _open(self, address: str, rid: str):
        try:
            host, port = parse_address(address, self.scheme)
        except ValueError as exc:
            raise TransferError(rid, Reason.INVALID_PLAN, str(exc)) from None
        try:
            return await timed(ucx.create_endpoint(host, port), 2 * self.progress_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises many kinds; all mean peer lost
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

    async def _send_buffers(self, ep, buffers) -> None:
        for buf in buffers:
            if len(buf):
                await timed(ep.send(_np(buf)), self.progress_timeout_s)
                self.stats.bytes_sent += len(buf)
