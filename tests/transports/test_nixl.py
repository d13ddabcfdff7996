"""What only the nixl transport has: one-sided WRITEs into a receiver-owned staging region.

The conformance suite, the fence races, peer loss and streaming run on nixl through the
`kind` fixture (conftest.py). These tests pin the staging design (transports/nixl.py):
a WRITE can land only in staging, never in a page; a region is not lent again before its
sender said it is done; transfers larger than the region flow by credits; a page that
does not fit and a peer that speaks another protocol fail cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import struct
import time
import uuid

import numpy as np
import pytest

from pdmesh.transports import Reason, TransferError, make_transport
from pdmesh.transports.framing import Kind, encode_header, reservation_bytes
from tests.support.transport_cases import PROGRESS_S, make_case, wait_until

# The transport's own verdict: it imports whichever NIXL build is installed (nixl_cu12,
# nixl_cu13), and its error names the extras to install.
nixl = importlib.import_module("pdmesh.transports.nixl")
if nixl.nixl_import_error is not None:
    pytest.skip(f"NIXL is not importable: {nixl.nixl_import_error}", allow_module_level=True)

pytestmark = pytest.mark.nixl
PAGE = 64 << 10
NEXT_LEASE = 0x22


@contextlib.asynccontextmanager
async def _nixl(**receiver_options):
    receiver = make_transport("nixl", progress_timeout_s=PROGRESS_S, **receiver_options)
    sender = make_transport("nixl", progress_timeout_s=PROGRESS_S)
    address = await receiver.start()
    await sender.start()
    try:
        yield receiver, sender, address
    finally:
        await sender.close()
        await receiver.close()


def _span(array: np.ndarray) -> tuple[int, int]:
    start = array.ctypes.data
    return start, start + array.nbytes


async def test_a_late_write_lands_in_staging_never_in_the_next_lease():
    async with _nixl() as (receiver, sender, address):
        src, dst, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())  # the link stays pooled
        await fut
        # The next reservation into other pages is fenced before its sender writes ...
        _, dst2, target2, _ = make_case(page_bytes=PAGE, seed=7)
        receiver.expect(target2)
        await receiver.fence(target2.reservation_id)
        dst2.array[:] = NEXT_LEASE  # ... and its pages are re-leased.
        (link, out), = sender._out.items()
        (region,) = receiver._lent.values()
        # The only address a sender ever gets is the region's: it overlaps no page.
        assert (out.address, out.address + out.length) == _span(region.array)
        for pages in (dst.array, dst2.array):
            lo, hi = _span(pages)
            assert hi <= out.address or lo >= out.address + out.length
        # A late WRITE (a sender that did not stop) lands, in staging only.
        late = np.full(PAGE, 0x77, np.uint8)
        sender._post(out, [memoryview(late)], [0], PAGE, [])
        await sender._written(out, 2.0)
        await asyncio.sleep(0.05)
        assert (region.array[:PAGE] == 0x77).all()
        assert (dst2.array == NEXT_LEASE).all()
        n = target.num_pages
        assert (dst.array[:n] == src.array[:n]).all()  # the committed lease is untouched too
        assert link is not None


async def test_a_transfer_larger_than_staging_flows_by_credits():
    async with _nixl(staging_bytes=2 * PAGE) as (receiver, sender, address):
        src, dst, target, plan = make_case(num_tokens=16 * 9, page_tokens=16, page_bytes=PAGE)
        assert target.num_pages == 9  # > 2 slots: every slot is written four or five times
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())
        await fut
        assert (dst.array[:9] == src.array[:9]).all()


async def test_a_page_larger_than_staging_is_refused_before_any_write():
    async with _nixl(staging_bytes=PAGE // 2) as (receiver, sender, address):
        src, dst, target, plan = make_case(page_bytes=PAGE)
        snapshot = dst.snapshot()
        fut = receiver.expect(target)
        with pytest.raises(TransferError) as sent:
            await sender.send(address, plan, src.views())
        assert sent.value.reason is Reason.INVALID_PLAN
        assert "staging region" in str(sent.value)
        await receiver.fence(target.reservation_id)
        with pytest.raises(TransferError):
            await fut
        assert (dst.array == snapshot).all()


def _retired_gauge(transport) -> float:
    """`pdmesh:data_plane_staging_retired` as a worker's /metrics reads it."""
    from pdmesh.services.runtime.worker import DataPlaneCollector
    families = {f.name: f for f in DataPlaneCollector(transport).collect()}
    return families["pdmesh:data_plane_staging_retired"].samples[0].value


async def test_a_region_is_lent_again_only_after_its_senders_release():
    async with _nixl(max_staging=1) as (receiver, sender, address):
        src, _, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())
        await fut
        # The sender vanishes without a word (crash, partition): its link just ends.
        (link, out), = sender._out.items()
        del sender._out[link]
        sender._idle.clear()
        link.close()
        await wait_until(lambda: receiver.staging_retired == 1)
        assert _retired_gauge(receiver) == 1  # what the worker's /metrics shows
        # The one region is not lent to anybody else while that sender may still write.
        src2, _, target2, plan2 = make_case(page_bytes=PAGE, seed=3)
        fut2 = receiver.expect(target2)
        with pytest.raises(TransferError) as refused:
            await sender.send(address, plan2, src2.views())
        assert refused.value.reason is Reason.PEER_LOST
        assert "staging regions are in use or retired" in str(refused.value)
        assert receiver.staging_retired == 1
        # Its release notification (every WRITE of it ended) frees the region.
        sender._release(out)
        await wait_until(lambda: receiver.staging_retired == 0)
        assert _retired_gauge(receiver) == 0
        await sender.send(address, plan2, src2.views())
        await fut2


async def test_a_closed_sender_releases_its_regions():
    async with _nixl() as (receiver, sender, address):
        src, _, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())
        await fut
        await sender.close()  # discards the pooled link: its release goes out
        await wait_until(lambda: not receiver._lent and receiver.staging_retired == 0)
        assert len(receiver._free) == 1


async def test_tcp_and_nixl_peers_refuse_each_other_cleanly():
    tcp = make_transport("tcp", progress_timeout_s=PROGRESS_S)
    tcp_address = await tcp.start()
    try:
        async with _nixl() as (receiver, sender, address):
            src, _, target, plan = make_case(page_bytes=PAGE)
            with pytest.raises(TransferError) as sent:
                await sender.send(tcp_address.replace("tcp://", "nixl://"), plan, src.views())
            assert sent.value.reason is Reason.PEER_LOST
            assert "nixl set-up" in str(sent.value)  # (a TCP receiver awaits a header)
            fut = receiver.expect(target)
            with pytest.raises(TransferError) as sent:
                await tcp.send(address.replace("nixl://", "tcp://"), plan, src.views())
            assert sent.value.reason is Reason.PEER_LOST
            assert not fut.done()  # a foreign protocol changed nothing ...
            await sender.send(address, dataclasses.replace(plan), src.views())
            await fut  # ... and the receiver still serves nixl senders
    finally:
        await tcp.close()


async def _raw_hello(address: str, proof) -> tuple[bytes, bytes]:
    """Speak the nixl link set-up by hand: hello, read the challenge, send `proof(nonce)`;
    returns the receiver's answer (8-byte tag) and whatever followed it."""
    host, port = address.removeprefix("nixl://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        name = b"intruder"
        writer.write(nixl._HELLO + struct.pack("<H", len(name)) + name)
        await writer.drain()
        tag = await asyncio.wait_for(reader.readexactly(8), 3)
        assert tag == b"PDNXCH01", tag
        nonce = await reader.readexactly(8)
        writer.write(proof(int.from_bytes(nonce, "little")))
        await writer.drain()
        answer = await asyncio.wait_for(reader.readexactly(8), 3)
        rest = await asyncio.wait_for(reader.read(4096), 3)
        return answer, rest
    finally:
        writer.close()


@pytest.mark.parametrize("forgery", ["wrong_key", "unknown_reservation", "replayed_nonce"])
async def test_a_peer_without_a_live_reservations_key_gets_no_staging_region(forgery):
    """The staging region's address and NIXL metadata let their holder WRITE into the
    receiver's memory, and a one-sided write cannot be refused: only a sender that proves
    it holds the key of a live reservation (a header MACed under it, over the receiver's
    fresh nonce) is lent one. Anyone else who reaches the port is refused with the reason,
    learns nothing, and takes no region (not lent, not retired)."""
    async with _nixl() as (receiver, sender, address):
        src, _, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        rid = reservation_bytes(plan.reservation_id)

        def proof(nonce: int) -> bytes:
            if forgery == "wrong_key":
                return encode_header(Kind.ACK, rid, plan.epoch, aux=nixl.HELLO_AUX,
                                     payload_checksum=nonce, key=b"\x00" * 32)
            if forgery == "unknown_reservation":
                return encode_header(Kind.ACK, uuid.uuid4().bytes, plan.epoch,
                                     aux=nixl.HELLO_AUX, payload_checksum=nonce, key=plan.key)
            # A proof sniffed from another link set-up: right key, someone else's nonce.
            return encode_header(Kind.ACK, rid, plan.epoch, aux=nixl.HELLO_AUX,
                                 payload_checksum=nonce ^ 1, key=plan.key)

        answer, rest = await _raw_hello(address, proof)
        assert answer == b"PDNXNR01", (answer, rest)
        (code, _), detail = struct.unpack_from("<HH", rest), rest[4:]
        expected = {"wrong_key": Reason.UNAUTHENTICATED,
                    "unknown_reservation": Reason.UNKNOWN_RESERVATION,
                    "replayed_nonce": Reason.BAD_HEADER}[forgery]
        assert Reason(code) is expected, detail
        await asyncio.sleep(0.05)
        assert not receiver._lent and not receiver._free and receiver.staging_retired == 0
        assert receiver.stats.frames_rejected[expected] >= 1
        assert not fut.done()  # the live reservation is untouched ...
        await sender.send(address, plan, src.views())
        await fut  # ... and its rightful sender is served


async def test_a_links_first_write_gets_the_set_up_bound_not_the_progress_timeout(monkeypatch):
    """UCX connects to the receiver's agent at a link's first WRITE (measured here: 21 ms
    median against 0.05-0.5 ms for later WRITEs). A process that stalls longer than the
    progress timeout while that WRITE is in flight (a loaded machine) must not fail the
    send as a lost peer: the first WRITE is bounded like the link's set-up."""
    async with _nixl() as (receiver, sender, address):
        loop = asyncio.get_running_loop()
        post = nixl.NixlTransport._post
        stalls = []

        def stalling_post(self, out, *args):
            post(self, out, *args)
            if not stalls:  # the link's first WRITE: the whole process stalls meanwhile
                stalls.append(loop.call_later(0.002, time.sleep, 1.5 * PROGRESS_S))

        monkeypatch.setattr(nixl.NixlTransport, "_post", stalling_post)
        src, dst, target, plan = make_case(page_bytes=PAGE)
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())
        await fut
        assert stalls and sender._setup_s() > 1.5 * PROGRESS_S
        assert (dst.array[:plan.num_pages] == src.array[:plan.num_pages]).all()
