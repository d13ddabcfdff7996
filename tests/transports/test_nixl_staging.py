"""nixl staging cannot be pinned by one key holder, and a receiver that has no region to lend
says so (transports/nixl.py `_lend`, `accepting`; base.py `TransferError.unreachable`).

Links that prove one reservation share the one region lent on that proof, whether they end
without a release or stay open: they cannot take the regions other senders need. When no
region can be lent the receiver reports not ready (`accepting`, which the worker's /ready
and heartbeat follow) and the refused sender's error is `unreachable` (prefill then reports
the receiver to admission, which routes around it); both recover once a region is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import socket
import struct

import pytest

from pdmesh.transports import PagesReady, Reason, TransferError, make_transport
from pdmesh.transports.base import PeerUnreachable
from pdmesh.transports.framing import Kind, encode_header, reservation_bytes
from tests.support.transport_cases import PROGRESS_S, make_case, wait_until

nixl = importlib.import_module("pdmesh.transports.nixl")
if nixl.nixl_import_error is not None:
    pytest.skip(f"NIXL is not importable: {nixl.nixl_import_error}", allow_module_level=True)

pytestmark = pytest.mark.nixl
PAGE = 64 << 10
STAGING = 1 << 20


@contextlib.asynccontextmanager
async def _receiver(**options):
    receiver = make_transport("nixl", progress_timeout_s=PROGRESS_S, staging_bytes=STAGING,
                              **options)
    address = await receiver.start()
    try:
        yield receiver, address
    finally:
        await receiver.close()


@contextlib.asynccontextmanager
async def _senders(n: int):
    senders = [make_transport("nixl", progress_timeout_s=PROGRESS_S) for _ in range(n)]
    try:
        for sender in senders:
            await sender.start()
        yield senders
    finally:
        for sender in senders:
            await sender.close()


async def _prove(address: str, target) -> tuple[bytes, asyncio.StreamWriter]:
    """A key holder's link set-up by hand: hello, the proof for `target` (its key over the
    receiver's nonce), the receiver's answer read through (region and token when lent). No
    WRITE and never a release notification. Returns the answer's tag and the open link."""
    host, port = address.removeprefix("nixl://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    name = b"key-holder"
    writer.write(nixl._HELLO + struct.pack("<H", len(name)) + name)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(8), 3) == b"PDNXCH01"
    nonce = int.from_bytes(await reader.readexactly(8), "little")
    writer.write(encode_header(Kind.ACK, reservation_bytes(target.reservation_id),
                               target.epoch, aux=nixl.HELLO_AUX, payload_checksum=nonce,
                               key=target.key))
    await writer.drain()
    tag = await asyncio.wait_for(reader.readexactly(8), 3)
    if tag == b"PDNXOK01":
        (size,) = struct.unpack("<I", await reader.readexactly(4))
        await reader.readexactly(size + 32)  # metadata, address and length, release token
    return tag, writer


@pytest.mark.parametrize("links", ["closed", "left_open"])
async def test_links_proving_one_reservation_share_one_staging_region(links):
    """More links than `max_staging`, each proving one live reservation's key and ending
    (or staying open) without a release, hold one region between them: another
    reservation's sender is still served, the receiver stays ready, and the honest sender
    of the proven reservation still gets the region on its own link."""
    async with _receiver(max_staging=4) as (receiver, address), \
            _senders(2) as (sender_a, sender_b):
        src_a, dst_a, target_a, plan_a = make_case(page_bytes=PAGE)
        fut_a = receiver.expect(target_a)
        opened = []
        for _ in range(2 * receiver.max_staging + 2):
            tag, writer = await _prove(address, target_a)
            assert tag == b"PDNXOK01"
            if links == "closed":
                writer.close()
            else:
                opened.append(writer)
        await asyncio.sleep(0.05)
        assert receiver._regions == 1  # one region was ever made
        assert receiver.staging_retired + len(receiver._lent) == 1
        assert receiver.accepting
        assert not fut_a.done()
        # Another tenant's reservation is served ...
        src_b, dst_b, target_b, plan_b = make_case(page_bytes=PAGE, seed=5)
        fut_b = receiver.expect(target_b)
        await sender_b.send(address, plan_b, src_b.views())
        await fut_b
        n = plan_b.num_pages
        assert (dst_b.array[:n] == src_b.array[:n]).all()
        # ... and so is the proven reservation's own sender: its new link is lent the
        # region of that proof (no third region is made).
        await sender_a.send(address, plan_a, src_a.views())
        await fut_a
        n = plan_a.num_pages
        assert (dst_a.array[:n] == src_a.array[:n]).all()
        assert receiver._regions == 2 and len(receiver._lent) == 2
        for writer in opened:
            writer.close()


async def test_an_honest_sender_that_reopens_its_link_gets_the_region_again():
    """A streamed send whose link waited too long for its first page opens a new link for
    the same reservation (its old link ends, its release maybe not yet read): with one
    region, the new link is lent the region of that proof."""
    async with _receiver(max_staging=1) as (receiver, address), _senders(1) as (sender,):
        sender.header_timeout_s = 0.2  # it reopens a link idle for more than half of it
        src, dst, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        pages = PagesReady(plan.num_pages)
        send = asyncio.ensure_future(sender.send(address, plan, src.views(), ready=pages))
        await wait_until(lambda: receiver._lent)
        (first,) = receiver._lent
        await asyncio.sleep(0.15)
        pages.complete(plan.first_token)
        await send
        await fut
        assert first not in receiver._lent and receiver._regions == 1
        assert (dst.array[:plan.num_pages] == src.array[:plan.num_pages]).all()


async def test_a_receiver_without_a_region_to_lend_is_not_ready_and_refuses_as_unreachable():
    """`max_staging=1` and one live transfer holding the region: the receiver reports not
    ready, and another sender's refusal is `unreachable` (PEER_LOST). Once the region is
    released both recover."""
    async with _receiver(max_staging=1) as (receiver, address), \
            _senders(2) as (holder, refused):
        assert receiver.accepting
        src, dst, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        pages = PagesReady(plan.num_pages)  # streamed: the link opens at once, pages later
        send = asyncio.ensure_future(holder.send(address, plan, src.views(), ready=pages))
        await wait_until(lambda: receiver._lent)
        assert not receiver.accepting  # what the worker's /ready and heartbeat follow
        src2, _, target2, plan2 = make_case(page_bytes=PAGE, seed=3)
        fut2 = receiver.expect(target2)
        with pytest.raises(TransferError) as caught:
            await refused.send(address, plan2, src2.views())
        err = caught.value
        assert err.unreachable and isinstance(err, PeerUnreachable)
        assert err.reason is Reason.PEER_LOST
        assert "staging regions are in use or retired" in err.detail
        pages.complete(plan.first_token)
        await send
        await fut
        assert (dst.array[:plan.num_pages] == src.array[:plan.num_pages]).all()
        assert not receiver.accepting  # the holder's pooled link keeps the region
        await holder.close()  # its release frees the region
        await wait_until(lambda: receiver.accepting)
        await refused.send(address, plan2, src2.views())
        await fut2


async def test_a_region_never_released_is_lent_again_after_retired_s():
    async with _receiver(max_staging=1, retired_s=0.3) as (receiver, address), \
            _senders(1) as (sender,):
        _, _, target_a, _ = make_case(page_bytes=PAGE)
        receiver.expect(target_a)
        tag, writer = await _prove(address, target_a)
        assert tag == b"PDNXOK01"
        writer.close()  # ended without a release
        await wait_until(lambda: receiver.staging_retired == 1)
        assert not receiver.accepting
        src, _, target, plan = make_case(page_bytes=PAGE, seed=9)
        fut = receiver.expect(target)
        with pytest.raises(TransferError) as caught:
            await sender.send(address, plan, src.views())
        assert caught.value.unreachable
        await wait_until(lambda: receiver.accepting)
        await sender.send(address, plan, src.views())
        await fut
        assert receiver.staging_retired == 0


async def test_unreachable_is_a_connect_failure_or_a_refusal_for_want_of_staging():
    """`unreachable` says the receiver cannot be reached (a connect failure); a refusal of
    the transfer itself (a link proof for a reservation the receiver does not expect) is
    not."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = f"nixl://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nobody listens there
    async with _receiver() as (_, address), _senders(1) as (sender,):
        src, _, _, plan = make_case(page_bytes=PAGE)
        with pytest.raises(TransferError) as caught:
            await sender.send(closed, plan, src.views())
        assert caught.value.unreachable and caught.value.detail.startswith("connect ")
        with pytest.raises(TransferError) as caught:
            await sender.send(address, plan, src.views())
        assert caught.value.reason is Reason.UNKNOWN_RESERVATION
        assert not caught.value.unreachable
