"""Robust listeners: accept errors never end the accept loop, unbound inbound
connections are bounded in number and in time, and the receiver's `accepting` flag (what
a worker's /ready and heartbeat report) follows whether it can accept."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import socket
import subprocess
import sys

from pdmesh.transports import make_transport
from tests.support.transport_cases import make_case

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"


def test_accept_loop_survives_running_out_of_file_descriptors():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SUPPORT / "emfile_process.py")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["not_accepting_at_emfile"] and out["accept_errors"] >= 1, out
    assert out["accepting_again"] and out["delivered_after"], out


async def test_idle_connection_flood_is_bounded_in_count_and_time():
    receiver = make_transport("tcp", progress_timeout_s=0.5)
    receiver.max_unbound_links = 8
    receiver.header_timeout_s = 0.6
    sender = make_transport("tcp", progress_timeout_s=0.5)
    address = await receiver.start()
    host, port = address[len("tcp://"):].rsplit(":", 1)
    flood = []
    try:
        for _ in range(40):
            s = socket.create_connection((host, int(port)))
            s.send(b"PDKV")  # a header that never completes
            flood.append(s)
        await asyncio.sleep(0.2)
        assert len(receiver._links) <= 8
        assert receiver.stats.links_refused >= 32
        # A sender that sends its header at once is served despite the flood.
        src, dst, target, plan = make_case(num_tokens=40)
        fut = receiver.expect(target)
        await sender.send(address, plan, src.views())
        await asyncio.wait_for(fut, 5)
        await asyncio.sleep(1.0)  # past the header timeout: the flood's survivors are gone
        assert receiver.stats.links_timed_out >= 1
        assert all(receiver._table.bound_to(c) for c in receiver._links)  # none unbound left
        closed = 0
        for s in flood:
            s.settimeout(1.0)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == len(flood)
    finally:
        for s in flood:
            s.close()
        await sender.close()
        await receiver.close()


async def test_pooled_link_older_than_half_the_header_timeout_is_not_reused():
    receiver = make_transport("tcp", progress_timeout_s=0.5)
    receiver.header_timeout_s = 0.4
    sender = make_transport("tcp", progress_timeout_s=0.5)
    sender.header_timeout_s = 0.4
    address = await receiver.start()
    try:
        for i in range(2):
            src, dst, target, plan = make_case(num_tokens=20, seed=i)
            fut = receiver.expect(target)
            await sender.send(address, plan, src.views())
            await asyncio.wait_for(fut, 5)
            await asyncio.sleep(0.5)  # the receiver closed the idle link meanwhile
        assert receiver.stats.links_timed_out >= 1
    finally:
        await sender.close()
        await receiver.close()


async def test_worker_reports_not_ready_while_its_data_plane_cannot_accept(nats_server):
    """A real decode worker on a real nats-server: while its transport cannot accept,
    /ready answers 503 and its heartbeat says ready=False (admission stops routing to it)."""
    import aiohttp
    import nats

    from pdmesh.services.decode.service import DecodeService
    from pdmesh.services.protocol import messages as m
    from pdmesh.services.runtime.config import resolve

    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-ready", "PDMESH_KV_TOKENS": "1024",
                                 "PDMESH_NATS_URL": nats_server.url, "PDMESH_HTTP_PORT": "0",
                                 "PDMESH_HEARTBEAT_S": "60"})
    svc = DecodeService(cfg)
    nc = await nats.connect(nats_server.url)
    beats: asyncio.Queue = asyncio.Queue()
    decoder = m.Decoder(m.Heartbeat)

    async def on_beat(msg) -> None:
        beats.put_nowait(decoder.decode(msg.subject, msg.data))

    await nc.subscribe(m.heartbeat_subject("decode", "decode-ready"), cb=on_beat)
    await svc.start()
    try:
        url = f"http://127.0.0.1:{svc.rt.http_port}/ready"
        async with aiohttp.ClientSession() as http:
            assert (await asyncio.wait_for(beats.get(), 5)).ready
            async with http.get(url) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.3)  # start() may have sent more than one beat
            while not beats.empty():
                assert beats.get_nowait().ready
            svc.transport.accepting = False  # what the accept loop sets at EMFILE
            await svc.heartbeat()
            assert not (await asyncio.wait_for(beats.get(), 5)).ready
            async with http.get(url) as resp:
                assert resp.status == 503
            svc.transport.accepting = True
            await svc.heartbeat()
            assert (await asyncio.wait_for(beats.get(), 5)).ready
            async with http.get(url) as resp:
                assert resp.status == 200
    finally:
        await nc.close()
        await svc.rt.drain("test over")
