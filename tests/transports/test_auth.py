"""The data plane authenticates every frame: a sender without the reservation's
key can neither write a byte into its pages nor end it; a receiver cannot make the sender
allocate what a reply header announces."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import uuid

import pytest

from pdmesh.transports import Reason, TransferError, make_transport
from pdmesh.transports.framing import (
    HEADER_SIZE,
    Kind,
    decode_header,
    encode_header,
    mac_ok,
    transfer_key,
)
from tests.support.transport_cases import SECRET, make_case


def test_transfer_key_binds_secret_reservation_and_epoch():
    rid = uuid.uuid4().hex
    base = transfer_key(SECRET, rid, 3)
    assert len(base) == 32 and base == transfer_key(SECRET.encode(), rid, 3)
    assert base != transfer_key(SECRET, rid, 4)
    assert base != transfer_key(SECRET, uuid.uuid4().hex, 3)
    assert base != transfer_key("another-secret", rid, 3)


def test_header_mac_verifies_only_under_its_key():
    key = transfer_key(SECRET, uuid.uuid4().hex, 1)
    h = decode_header(encode_header(Kind.COMMIT, bytes(16), 1, payload_checksum=99, key=key))
    assert mac_ok(h, key)
    assert not mac_ok(h, transfer_key(SECRET, uuid.uuid4().hex, 1))
    assert not mac_ok(h._replace(payload_checksum=98), key)  # the commit digest is covered


@pytest.mark.parametrize("forged", ["key", "epoch_key"])
async def test_frames_without_the_key_change_nothing(pair, forged):
    """A sender holding the reservation's id, epoch and page ids but not its key: its
    frames are dropped before any byte lands, the live reservation is neither written nor
    failed, and the rightful sender still delivers afterwards."""
    receiver, sender, address = pair
    src, dst, target, plan = make_case(num_tokens=100)
    snapshot = dst.snapshot()
    fut = receiver.expect(target)
    wrong = (b"\x00" * 32 if forged == "key"
             else transfer_key(SECRET, plan.reservation_id, plan.epoch + 1))
    with pytest.raises(TransferError) as sent:
        await sender.send(address, dataclasses.replace(plan, key=wrong), src.views())
    assert sent.value.reason in (Reason.UNAUTHENTICATED, Reason.BAD_HEADER, Reason.PEER_LOST)
    await asyncio.sleep(0.1)
    assert not fut.done()
    assert (dst.array == snapshot).all()
    assert receiver.stats.frames_rejected[Reason.UNAUTHENTICATED] >= 1
    await sender.send(address, plan, src.views())
    result = await asyncio.wait_for(fut, 5)
    n = target.num_pages
    assert result.num_tokens == 100 and (dst.array[:n] == src.array[:n]).all()


async def test_sender_rejects_an_unauthenticated_ack_and_oversized_reply():
    """A fake receiver answers with an ACK MACed under the wrong key, then with a DATA
    frame announcing a 64 MiB payload: the sender fails both sends without allocating."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    replies = []

    async def fake_receiver():
        for reply in replies:
            conn, _ = await loop.sock_accept(listener)
            header = await loop.sock_recv(conn, HEADER_SIZE)
            h = decode_header(header)
            await loop.sock_sendall(conn, reply(h))
            await asyncio.sleep(0.2)
            conn.close()

    sender = make_transport("tcp", progress_timeout_s=0.5)
    src, _, _, plan = make_case(num_tokens=16)
    replies.append(lambda h: encode_header(Kind.ACK, h.reservation, h.epoch, token_count=16,
                                           key=b"wrong"))
    replies.append(lambda h: encode_header(Kind.DATA, h.reservation, h.epoch,
                                           payload_len=(64 << 20), payload_checksum=0))
    server = asyncio.create_task(fake_receiver())
    try:
        with pytest.raises(TransferError) as first:
            await sender.send(f"tcp://127.0.0.1:{port}", plan, src.views())
        assert first.value.reason is Reason.UNAUTHENTICATED
        with pytest.raises(TransferError) as second:
            await sender.send(f"tcp://127.0.0.1:{port}", plan, src.views())
        assert second.value.reason is Reason.PEER_LOST
        assert "DATA" in second.value.detail
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        await sender.close()
        listener.close()



async def test_ucx_drains_no_more_than_live_transfers_allow(kind):
    """UCX receives a rejected payload whole (a tagged message), so it would allocate what
    the header announces: beyond a window of the live transfers' pages it ends the link
    instead, and the live transfer is untouched."""
    if kind != "ucx":
        pytest.skip("TCP drains through a fixed scratch buffer")
    receiver = make_transport(kind, progress_timeout_s=0.5)
    sender = make_transport(kind, progress_timeout_s=0.5)
    address = await receiver.start()
    await sender.start()
    try:
        src, dst, target, plan = make_case(num_tokens=32, page_bytes=4096)
        snapshot = dst.snapshot()
        fut = receiver.expect(target)
        big_src, _, _, big = make_case(num_tokens=16, page_bytes=receiver.receive_window
                                       * 4096 + 4096)
        with pytest.raises(TransferError) as sent:
            await sender.send(address, big, big_src.views())
        assert sent.value.reason is Reason.PEER_LOST
        assert receiver.stats.bytes_drained == 0
        assert not fut.done() and (dst.array == snapshot).all()
        await sender.send(address, plan, src.views())
        await asyncio.wait_for(fut, 5)
    finally:
        await sender.close()
        await receiver.close()
