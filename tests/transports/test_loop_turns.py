"""A receiver gives its event loop turns even when the link is always full.

A decode worker's loop also serves its token streams and `fence()`. Before, a tcp receiver
whose socket always had the next bytes ready never yielded: a 64 MiB transfer held the
loop for the whole transfer (up to 48 ms measured, `transports/README.md`). Here every
byte of a transfer is queued in the receiver's socket before its loop runs, so only the
receiver's own turns let another task run. `loop_turn_s` = 0 (a turn per frame) makes the
count exact; services run with one turn per millisecond of holding the loop.
"""

from __future__ import annotations

import asyncio
import socket

from pdmesh.transports import make_transport
from pdmesh.transports.core import build_frames, parse_address
from pdmesh.transports.framing import reservation_bytes
from tests.support.transport_cases import PROGRESS_S, make_case

PAGES = 32
PAGE_BYTES = 1024  # 32 frames and the commit: ~35 KB, well within a fresh link's window


async def test_a_receiver_whose_link_is_always_full_gives_the_loop_turns():
    receiver = make_transport("tcp", progress_timeout_s=PROGRESS_S)
    receiver.loop_turn_s = 0.0
    address = await receiver.start()
    try:
        src, dst, target, plan = make_case(num_tokens=PAGES * 16, page_bytes=PAGE_BYTES)
        fut = receiver.expect(target)
        wire = b"".join(bytes(f.header) + bytes(f.payload) for f in build_frames(
            plan, reservation_bytes(plan.reservation_id), src.views()[:plan.num_pages]))
        # Blocking, from the loop's own thread: the whole transfer is queued before the
        # receiver reads a byte of it.
        with socket.create_connection(parse_address(address, "tcp"), timeout=5) as sock:
            sock.sendall(wire)  # a timeout, not a hang, should the buffers be smaller
            turns = 0

            async def ticker() -> None:
                nonlocal turns
                while True:
                    turns += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            try:
                await asyncio.wait_for(fut, 5)
            finally:
                task.cancel()
        assert (dst.array[:PAGES] == src.array[:PAGES]).all()
        # A turn per frame at least; before, a handful (accepting the link) for all 33.
        assert turns >= PAGES, f"the loop got {turns} turns while {PAGES} pages landed"
    finally:
        await receiver.close()
