"""Run by test_listener.py in its own process (RLIMIT_NOFILE is process-wide): a TCP
receiver runs out of file descriptors while a connection waits to be accepted, recovers
once descriptors are free again, and still delivers a transfer. Prints one JSON object."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
from collections.abc import Iterator

from pdmesh.transports import make_transport
from tests.support.transport_cases import make_case


@contextlib.contextmanager
def no_file_descriptors(limit: int = 256) -> Iterator[None]:
    """For the block: RLIMIT_NOFILE lowered to `limit` and every descriptor left under it
    taken; afterwards they are closed and the limit restored."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    hog = []
    try:
        with contextlib.suppress(OSError):
            while True:
                hog.append(os.dup(0))
        yield
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def main() -> dict:
    receiver = make_transport("tcp", progress_timeout_s=0.5)
    sender = make_transport("tcp", progress_timeout_s=0.5)
    address = await receiver.start()
    host, port = address[len("tcp://"):].rsplit(":", 1)
    client = socket.socket()
    with no_file_descriptors():
        client.setblocking(False)
        client.connect_ex((host, int(port)))  # the kernel completes it; accept() hits EMFILE
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not receiver.accepting:
                break
        out = {"not_accepting_at_emfile": not receiver.accepting,
               "accept_errors": receiver.stats.accept_errors}
    for _ in range(200):
        await asyncio.sleep(0.02)
        if receiver.accepting:
            break
    out["accepting_again"] = receiver.accepting
    client.close()
    src, dst, target, plan = make_case(num_tokens=40)
    fut = receiver.expect(target)
    await sender.send(address, plan, src.views())
    await asyncio.wait_for(fut, 5)
    n = target.num_pages
    out["delivered_after"] = bool((dst.array[:n] == src.array[:n]).all())
    await sender.close()
    await receiver.close()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
