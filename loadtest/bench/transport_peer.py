"""Receiver process for `pdmesh bench transport --layout process`.

Prefill and decode are separate processes, so each pays one checksum pass and one copy, in
parallel. This child plays decode: it runs a receiving transport and a raw receiver (plain
socket / bare ucxx) and obeys one-line commands on stdin, answering on stdout:

    expect <rid> <pages> <key>  register an expectation of <pages> 1 MiB pages whose frames
                           are MACed under <key> (hex) -> "ready"
    raw <bytes>            the next raw connection carries <bytes> bytes -> "ready"
    cpu                    -> "cpu <seconds>": this process's CPU time so far (all threads)
    quit

Usage: `python -m pdmesh.loadtest.bench.transport_peer KIND [RAW]`: KIND is any kind
`make_transport` builds; RAW is the raw baseline's wire, `tcp` (plain socket, the
default) or `ucx` (bare ucxx). It first prints one JSON line: {"address": ...,
"raw_port": ...}. Every transfer and raw receive is acknowledged to the sender (the
transport's ACK; one byte for raw), so the parent times send-until-acknowledged for both.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import numpy as np

from pdmesh.transports import ExpectedTransfer, make_transport, stop_ucx_notifier

PAGE_BYTES = 1 << 20
PAGE_TOKENS = 16
MAX_PAGES = 64


async def _serve(kind: str, raw: str) -> None:
    loop = asyncio.get_running_loop()
    dst = np.zeros((MAX_PAGES, PAGE_BYTES), np.uint8)
    views = [memoryview(p) for p in dst]
    receiver = make_transport(kind, progress_timeout_s=5.0)  # as the bench's sender
    address = await receiver.start()
    raw_expected: asyncio.Queue[int] = asyncio.Queue()
    pending: set[asyncio.Future] = set()
    if raw == "ucx":
        from pdmesh.transports.ucx import announce_worker, ucx

        async def on_connect(ep) -> None:  # ep: a ucxx endpoint
            await announce_worker(ep, 10.0)  # as the transport's links (error mode)
            nbytes = await raw_expected.get()
            await ep.recv(dst.reshape(-1)[:nbytes])
            await ep.send(np.ones(1, np.uint8))
            await ep.close()

        listener = ucx.create_listener(on_connect, port=0)
        raw_port = listener.port
    else:
        server = socket.create_server(("127.0.0.1", 0))
        server.setblocking(False)
        raw_port = server.getsockname()[1]

        async def accept_loop() -> None:
            flat = memoryview(dst).cast("B")
            while True:
                conn, _ = await loop.sock_accept(server)
                conn.setblocking(False)
                nbytes = await raw_expected.get()
                pos = 0
                while pos < nbytes:
                    pos += await loop.sock_recv_into(conn, flat[pos:nbytes])
                await loop.sock_sendall(conn, b"k")
                conn.close()

        acceptor = loop.create_task(accept_loop())
    print(json.dumps({"address": address, "raw_port": raw_port}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().split():
            if line[0] == "expect":
                n = int(line[2])
                fut = receiver.expect(ExpectedTransfer(
                    line[1], 1, tuple(range(n)), views[:n], PAGE_BYTES, PAGE_TOKENS,
                    n * PAGE_TOKENS, 60.0, key=bytes.fromhex(line[3])))
                pending.add(fut)
                fut.add_done_callback(pending.discard)
            elif line[0] == "raw":
                raw_expected.put_nowait(int(line[1]))
            elif line[0] == "cpu":
                print(f"cpu {time.process_time()}", flush=True)
                continue
            else:
                break
            print("ready", flush=True)
    finally:
        if raw != "ucx":
            acceptor.cancel()
        await receiver.close()
        stop_ucx_notifier()


def main() -> int:
    asyncio.run(_serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tcp"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
