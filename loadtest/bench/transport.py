"""`pdmesh bench transport [--json] [--kinds tcp,ucx] [--repeat N] [--layout L]`.

For payloads of 1, 16 and 64 MiB (1 MiB pages, checksums on) it measures each transport
beside a raw baseline of the same bytes in the same run and the same process layout: plain
non-blocking socket send/recv for tcp, a bare ucxx `send`/`recv` for ucx. Prints GB/s and
the ratio; with --json the last stdout line is one JSON object.

Layouts: `process` (default) receives in a child process
(`pdmesh.loadtest.bench.transport_peer`), as decode receives from prefill, so sender and
receiver work in parallel and each side pays one checksum pass; both the transport and the
raw baseline are timed until the receiver acknowledged. `loop` runs both sides in one event
loop (everything serialised).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from types import ModuleType

import numpy as np

from pdmesh.transports import ExpectedTransfer, TransferPlan, make_transport

SIZES_MIB = (1, 16, 64)
PAGE_BYTES = 1 << 20
PAGE_TOKENS = 16


async def _transport_once(payload: np.ndarray, dst: np.ndarray, pair) -> float:
    receiver, sender, address = pair
    n = payload.shape[0]
    rid = uuid.uuid4().hex
    ids = tuple(range(n))
    fut = receiver.expect(ExpectedTransfer(rid, 1, ids, [memoryview(p) for p in dst],
                                           PAGE_BYTES, PAGE_TOKENS, n * PAGE_TOKENS, 60.0))
    started = time.perf_counter()
    await sender.send(address, TransferPlan(rid, 1, ids, n * PAGE_TOKENS, PAGE_TOKENS,
                                            PAGE_BYTES, 0, 60.0), [memoryview(p) for p in payload])
    await fut
    return time.perf_counter() - started


async def _raw_tcp_once(payload: np.ndarray, dst: np.ndarray) -> float:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))  # loopback, no transport framing
    listener.setblocking(False)
    client = socket.socket()
    client.setblocking(False)
    await loop.sock_connect(client, listener.getsockname())
    server, _ = await loop.sock_accept(listener)
    server.setblocking(False)
    view = memoryview(dst).cast("B")

    async def recv_all() -> None:
        pos = 0
        while pos < view.nbytes:
            pos += await loop.sock_recv_into(server, view[pos:])

    started = time.perf_counter()
    await asyncio.gather(loop.sock_sendall(client, memoryview(payload).cast("B")), recv_all())
    seconds = time.perf_counter() - started
    for s in (client, server, listener):
        s.close()
    return seconds


async def _raw_ucx_once(payload: np.ndarray, dst: np.ndarray, ucx) -> float:
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connect(ep) -> None:
        await ep.recv(dst.reshape(-1))
        done.set_result(None)
        await ep.close()

    listener = ucx.create_listener(on_connect, port=0)
    ep = await ucx.create_endpoint("127.0.0.1", listener.port)
    started = time.perf_counter()
    await ep.send(payload.reshape(-1))
    await done
    seconds = time.perf_counter() - started
    await ep.close()
    listener.close()
    return seconds


class _Peer:
    """The receiving child process and its one-line command protocol."""

    def __init__(self, proc: asyncio.subprocess.Process, info: dict) -> None:
        self.proc, self.address, self.raw_port = proc, info["address"], info["raw_port"]

    @classmethod
    async def start(cls, kind: str) -> _Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdmesh.loadtest.bench.transport_peer", kind,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        while not (line := await proc.stdout.readline()).startswith(b"{"):
            if not line:
                raise RuntimeError("bench peer exited before listening")
        return cls(proc, json.loads(line))

    async def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        if (await self.proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError(f"bench peer did not take {line!r}")

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _peer_transport_once(peer: _Peer, sender, payload: np.ndarray) -> float:
    n = payload.shape[0]
    rid = uuid.uuid4().hex
    await peer.command(f"expect {rid} {n}")
    started = time.perf_counter()
    await sender.send(peer.address, TransferPlan(rid, 1, tuple(range(n)), n * PAGE_TOKENS,
                                                 PAGE_TOKENS, PAGE_BYTES, 0, 60.0),
                      [memoryview(p) for p in payload])
    return time.perf_counter() - started


async def _peer_raw_once(peer: _Peer, kind: str, payload: np.ndarray, ucx) -> float:
    await peer.command(f"raw {payload.nbytes}")
    if kind == "ucx":
        ep = await ucx.create_endpoint("127.0.0.1", peer.raw_port)
        ack = np.empty(1, np.uint8)
        started = time.perf_counter()
        await ep.send(payload.reshape(-1))
        await ep.recv(ack)
        seconds = time.perf_counter() - started
        await ep.close()
        return seconds
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.sock_connect(sock, ("127.0.0.1", peer.raw_port))
    started = time.perf_counter()
    await loop.sock_sendall(sock, memoryview(payload).cast("B"))
    await loop.sock_recv(sock, 1)
    seconds = time.perf_counter() - started
    sock.close()
    return seconds


def _ucx_for(kind: str) -> ModuleType | None:
    """The ucxx module for `ucx` (an optional dependency, imported only when asked)."""
    if kind != "ucx":
        return None
    from pdmesh.transports.ucx import ucx

    return ucx


def _payload(mib: int) -> np.ndarray:
    n = mib * (1 << 20) // PAGE_BYTES
    return np.random.default_rng(mib).integers(0, 256, (n, PAGE_BYTES), np.uint8)


async def _best_of(repeat: int, t_end: float, transport_once: Callable[[], Awaitable[float]],
                   raw_once: Callable[[], Awaitable[float]]) -> tuple[float, float]:
    """Fastest transport and raw seconds of `repeat` alternating runs (until `t_end`)."""
    best_t = best_raw = float("inf")
    for _ in range(repeat):
        if time.monotonic() > t_end:
            break
        best_t = min(best_t, await transport_once())
        best_raw = min(best_raw, await raw_once())
    return best_t, best_raw


def _row(kind: str, mib: int, layout: str, nbytes: int, best_t: float,
         best_raw: float) -> dict:
    row = {"transport": kind, "mib": mib, "layout": layout,
           "transport_gbps": nbytes / best_t / 1e9, "raw_gbps": nbytes / best_raw / 1e9}
    row["ratio"] = row["transport_gbps"] / row["raw_gbps"]
    return row


async def _run_process(kinds: list[str], repeat: int, budget_s: float) -> list[dict]:
    t_end = time.monotonic() + budget_s
    results = []
    for kind in kinds:
        ucx = _ucx_for(kind)
        peer = await _Peer.start(kind)
        sender = make_transport(kind)
        await sender.start()
        try:
            for mib in SIZES_MIB:
                payload = _payload(mib)
                await _peer_transport_once(peer, sender, payload)  # warm-up (connect, pages)
                await _peer_raw_once(peer, kind, payload, ucx)
                best_t, best_raw = await _best_of(
                    repeat, t_end, functools.partial(_peer_transport_once, peer, sender, payload),
                    functools.partial(_peer_raw_once, peer, kind, payload, ucx))
                results.append(_row(kind, mib, "process", payload.nbytes, best_t, best_raw))
        finally:
            await sender.close()
            await peer.stop()
    return results


async def _run(kinds: list[str], repeat: int, budget_s: float, layout: str) -> dict:
    results = (await _run_process(kinds, repeat, budget_s) if layout == "process"
               else await _run_loop(kinds, repeat, budget_s))
    return {"bench": "transport", "layout": layout, "page_bytes": PAGE_BYTES,
            "checksum": "xxh3_64", "ucx_tls": os.environ.get("UCX_TLS", ""),
            "ucxpy_progress_mode": os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
            "results": results}


async def _run_loop(kinds: list[str], repeat: int, budget_s: float) -> list[dict]:
    t_end = time.monotonic() + budget_s
    results = []
    for kind in kinds:
        ucx = _ucx_for(kind)
        receiver, sender = make_transport(kind), make_transport(kind)
        pair = (receiver, sender, await receiver.start())
        await sender.start()
        try:
            for mib in SIZES_MIB:
                payload = _payload(mib)
                dst = np.zeros_like(payload)
                await _transport_once(payload, dst, pair)  # warm-up (connect, pages)
                raw_once = (functools.partial(_raw_ucx_once, payload, dst, ucx)
                            if ucx is not None else functools.partial(_raw_tcp_once, payload, dst))
                best_t, best_raw = await _best_of(
                    repeat, t_end, functools.partial(_transport_once, payload, dst, pair),
                    raw_once)
                assert (dst == payload).all()
                results.append(_row(kind, mib, "loop", payload.nbytes, best_t, best_raw))
        finally:
            await sender.close()
            await receiver.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench transport", description=__doc__)
    parser.add_argument("--json", action="store_true", help="last stdout line is JSON")
    parser.add_argument("--kinds", default="tcp,ucx")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=45.0)
    parser.add_argument("--layout", choices=("process", "loop"), default="process",
                        help="receiver in a child process (default) or in the same loop")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if "ucx" in kinds:
        from pdmesh.transports.ucx import ucx_import_error

        if ucx_import_error is not None:
            print(f"skipping ucx: {ucx_import_error}", file=sys.stderr)
            kinds.remove("ucx")
    report = asyncio.run(_run(kinds, args.repeat, args.budget_s, args.layout))
    print(f"{'transport':>9} {'MiB':>4} {'GB/s':>7} {'raw GB/s':>9} {'ratio':>6}")
    for row in report["results"]:
        print(f"{row['transport']:>9} {row['mib']:>4} {row['transport_gbps']:7.2f} "
              f"{row['raw_gbps']:9.2f} {row['ratio']:6.2f}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
