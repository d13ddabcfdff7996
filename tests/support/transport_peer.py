"""A transport peer in its own process, for the kill / freeze tests.

    python transport_peer.py send KIND ADDRESS RID EPOCH NUM_TOKENS PAGE_TOKENS PAGE_BYTES
        sends pages 0 and 1, then stalls (so the parent can kill or freeze it mid-transfer)
    python transport_peer.py sendall KIND ADDRESS RID EPOCH NUM_TOKENS PAGE_TOKENS PAGE_BYTES
        sends the whole transfer, then prints "sent" and, for ucx, its error mode
    python transport_peer.py stream KIND ADDRESS RID EPOCH NUM_TOKENS PAGE_TOKENS PAGE_BYTES
        the same as a streamed send: pages 0 and 1 are final, the rest never become so
    python transport_peer.py recv KIND RID EPOCH NUM_TOKENS PAGE_TOKENS PAGE_BYTES
        expects that transfer, prints its address, "landed" once two pages have landed,
        "done OK" or "done REASON" when the transfer ends, then waits (still alive: a lost
        peer did not take it down)
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from pdmesh.transports import (
    ExpectedTransfer,
    FaultPlan,
    PagesReady,
    TransferError,
    TransferPlan,
    make_transport,
)


async def main(argv: list[str]) -> None:
    role, kind = argv[0], argv[1]
    if role in ("send", "sendall", "stream"):
        address, rid = argv[2], argv[3]
        epoch, num_tokens, page_tokens, page_bytes = map(int, argv[4:8])
        n = -(-num_tokens // page_tokens)
        pages = np.full((n, page_bytes), 0x5A, dtype=np.uint8)
        transport = make_transport(kind, faults=True)
        await transport.start()
        plan = TransferPlan(rid, epoch, tuple(range(100, 100 + n)), num_tokens, page_tokens,
                            page_bytes, first_token=1, deadline_s=3600.0)
        views = [memoryview(p) for p in pages]
        if role == "stream":
            await transport.send(address, plan, views, PagesReady(n, ready=2))
        elif role == "sendall":
            await transport.send(address, plan, views)
            print("sent", getattr(transport, "error_mode", ""), flush=True)
            await transport.close()
        else:
            transport.arm(rid, FaultPlan(delay={2: 3600.0}))
            await transport.send(address, plan, views)
    else:
        rid = argv[2]
        epoch, num_tokens, page_tokens, page_bytes = map(int, argv[3:7])
        n = -(-num_tokens // page_tokens)
        pages = np.zeros((n, page_bytes), dtype=np.uint8)
        transport = make_transport(kind, progress_timeout_s=3600.0)
        address = await transport.start()
        fut = transport.expect(ExpectedTransfer(rid, epoch, tuple(range(100, 100 + n)),
                                                [memoryview(p) for p in pages], page_bytes,
                                                page_tokens, num_tokens, 3600.0))
        print(address, flush=True)

        async def landed() -> None:
            for _ in range(360_000):  # an hour, polled
                if transport.stats.frames_received >= 2:
                    print("landed", flush=True)
                    return
                await asyncio.sleep(0.01)

        watch = asyncio.ensure_future(landed())
        try:
            await fut
            print("done OK", flush=True)
        except TransferError as exc:
            print(f"done {exc.reason.name}", flush=True)
        watch.cancel()
        await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
