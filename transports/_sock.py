"""A raw non-blocking socket with awaitable readiness and progress timeouts.

This is what `loop.sock_recv_into` / `loop.sock_sendall` do, kept explicit for two
reasons: the receive path re-checks, synchronously right before every `recv_into`, whether
the destination is still live (so `fence()` needs no cancellation of a pending read that
holds the page's view), and the send path uses `sendmsg` to put a header and its page (or
several) in one syscall without copying them together. `progress_s` bounds each wait for
the socket: no progress for that long raises `StalledError` (None waits for ever).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import struct
from collections.abc import Iterable

from .errors import LinkIdle

_IOV_BATCH = 512  # below IOV_MAX (1024 on Linux)


class StalledError(ConnectionError):
    """No progress on the socket within the progress timeout (peer frozen or gone)."""


class RawSocket:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.loop = asyncio.get_running_loop()
        self._wlock = asyncio.Lock()
        self.closed = False

    async def _wait(self, add, remove, progress_s: float | None) -> None:
        fut = self.loop.create_future()
        add(self.fd, _wake, fut)
        try:
            if progress_s is None:
                await fut
            else:
                try:
                    async with asyncio.timeout(progress_s):
                        await fut
                except TimeoutError:
                    raise StalledError(f"no progress for {progress_s}s") from None
        finally:
            remove(self.fd)

    async def wait_readable(self, progress_s: float | None) -> None:
        await self._wait(self.loop.add_reader, self.loop.remove_reader, progress_s)

    async def recv_exact(self, view: memoryview, progress_s: float | None,
                         eof_ok: bool = False, idle: bool = False) -> bool:
        """Fill `view`. Returns False on a clean EOF before the first byte when eof_ok.
        idle: no first byte within progress_s raises LinkIdle (nothing was consumed)."""
        pos, total = 0, view.nbytes
        while pos < total:
            try:
                n = self.sock.recv_into(view[pos:])
            except (BlockingIOError, InterruptedError):
                try:
                    await self.wait_readable(progress_s)
                except StalledError:
                    if idle and pos == 0:
                        raise LinkIdle(f"nothing for {progress_s}s") from None
                    raise
                continue
            if n == 0:
                if pos == 0 and eof_ok:
                    return False
                raise EOFError(f"stream truncated after {pos} of {total} bytes")
            pos += n
        return True

    async def send_all(self, buffers: Iterable[bytes | memoryview],
                       progress_s: float | None) -> int:
        """Send every buffer in order (sendmsg, partial sends resumed). Returns bytes sent."""
        pending = collections.deque(memoryview(b) for b in buffers)
        sent = 0
        async with self._wlock:
            while pending:
                try:
                    n = self.sock.sendmsg(list(_take(pending, _IOV_BATCH)))
                except (BlockingIOError, InterruptedError):
                    await self._wait(self.loop.add_writer, self.loop.remove_writer, progress_s)
                    continue
                sent += n
                while n:
                    head = pending[0]
                    if n >= head.nbytes:
                        n -= head.nbytes
                        pending.popleft()
                    else:
                        pending[0] = head[n:]
                        n = 0
                while pending and pending[0].nbytes == 0:
                    pending.popleft()
        return sent

    def looks_alive(self) -> bool:
        """For pooled idle connections: no EOF, no error and no unexpected bytes pending."""
        if self.closed:
            return False
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        return False

    def close(self, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def _take(pending: collections.deque, count: int):
    for i, view in enumerate(pending):
        if i == count:
            return
        yield view


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY (headers and acks must not wait for Nagle) and fast keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
