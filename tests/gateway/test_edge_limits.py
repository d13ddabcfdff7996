"""Slow and idle clients cannot exhaust the gateway's API port: connections are capped in
all and per client address (answered at once, then closed), headers and bodies that come
too slowly are cut, idle keep-alive connections end, and none of it floods the log. A real
gateway (scripted mesh, real nats-server); the flood comes from 127.0.0.1, the request that
must still be served from 127.0.0.2."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.support.meshproc import REPO, NatsServer
from tests.support.scripted_mesh import Running, gateways

FLOOD = 500  # half idle, half trickling their headers
PER_CLIENT = 256  # the default http_max_connections_per_client
HEADER_TIMEOUT_S = 1.0
TRICKLE_EVERY_S = 0.25
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"


async def _finish(mesh, request_id: str) -> None:
    await mesh.token(request_id, 0, finish=True)


async def _counter(run: Running, name: str, **labels: str) -> float:
    metrics = await run.metrics()
    return sum(v for (n, ls), v in metrics.items()
               if n == name and {"service": "gateway", **labels}.items() <= dict(ls).items())


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A request's head, a byte at a time, never ending."""
    try:
        writer.write(HEAD + b"X-Slow: ")
        while True:
            await asyncio.sleep(TRICKLE_EVERY_S)
            writer.write(b"a")
            await writer.drain()
    except (ConnectionError, OSError):
        return  # the server closed it


async def _ended(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection."""
    try:
        return await reader.read()
    except ConnectionError:
        return b""


async def _request_from(address: str, port: int) -> tuple[int, float]:
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as http, http.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
            headers={"Authorization": "Bearer sk-dev-alice"}) as resp:
        await resp.read()
        return resp.status, time.monotonic() - t0


async def test_idle_and_trickling_connections_neither_block_a_request_nor_flood_the_log(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with gateways(nats_server.url) as start:
        run = await start(_finish, http_header_timeout_s=HEADER_TIMEOUT_S)
        port = run.gw.rt.http_port
        caplog.clear()
        t0 = time.monotonic()
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(FLOOD)]
        trickles = [asyncio.ensure_future(_trickle(w)) for _, w in conns[1::2]]
        ends = [asyncio.ensure_future(_ended(r)) for r, _ in conns]
        status, took = await _request_from("127.0.0.2", port)
        assert status == 200 and took < 2.0, (status, took)
        # Every held connection is cut once its header time is up; the rest were refused.
        done, pending = await asyncio.wait(ends, timeout=HEADER_TIMEOUT_S + 3)
        cut_within = time.monotonic() - t0
        for task in trickles:
            task.cancel()
        await asyncio.gather(*trickles, return_exceptions=True)
        for _, writer in conns:
            writer.close()
        assert not pending, f"{len(pending)} of {FLOOD} connections still open after " \
            f"{cut_within:.1f}s"
        refused = [t.result() for t in done if t.result()]
        assert refused and all(b" 429 " in r.split(b"\r\n", 1)[0] for r in refused)
        assert await _counter(run, "pdmesh:http_connections_refused_total",
                              reason="per_client") == FLOOD - PER_CLIENT
        assert await _counter(run, "pdmesh:http_timeouts_total",
                              phase="header") == PER_CLIENT
        status, _ = await _request_from("127.0.0.1", port)
        assert status == 200  # the flood's own address is served again once it ended
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records]
    # One line each for the refusals and the timeouts, the drain's: not one per connection.
    assert len(lines) <= 5, "\n".join(lines)


async def test_caps_answer_at_once_and_slow_bodies_and_idle_keepalives_end(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with gateways(nats_server.url) as start:
        run = await start(_finish, http_max_connections=3, http_max_connections_per_client=2,
                          http_body_timeout_s=0.5, http_keepalive_timeout_s=0.5)
        port = run.gw.rt.http_port
        held = [await asyncio.open_connection(a, port, local_addr=(a, 0))
                for a in ("127.0.0.1", "127.0.0.1")]
        answers = {}
        for name, address in (("per_client", "127.0.0.1"), ("held", "127.0.0.2"),
                              ("max_connections", "127.0.0.3")):
            reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                           local_addr=(address, 0))
            held.append((reader, writer))
            try:
                answers[name] = await asyncio.wait_for(reader.read(), 0.3)
            except TimeoutError:
                answers[name] = b""  # held open: nothing to read
        assert answers["held"] == b""
        for name, status, type_ in (("per_client", 429, "rate_limit_error"),
                                    ("max_connections", 503, "server_error")):
            head, _, body = answers[name].partition(b"\r\n\r\n")
            assert head.startswith(f"HTTP/1.1 {status} ".encode()), answers[name]
            assert b"Server: pdmesh" in head
            error = json.loads(body)["error"]
            assert (error["code"], error["type"]) == ("too_many_connections", type_)
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.1)  # the server sees them go
        # A body that stops arriving: the connection ends, with no error in the log.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b"Authorization: Bearer sk-dev-alice\r\nContent-Length: 100\r\n"
                     b"\r\n{\"model\":")
        t0 = time.monotonic()
        assert await asyncio.wait_for(_ended(reader), 3) == b""
        assert 0.4 < time.monotonic() - t0 < 2.0
        writer.close()
        # A keep-alive connection left idle after its answer: closed by the server.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n")
        t0 = time.monotonic()
        answer = await asyncio.wait_for(_ended(reader), 3)
        assert answer.startswith(b"HTTP/1.1 200 ") and 0.4 < time.monotonic() - t0 < 2.0
        writer.close()
        assert await _counter(run, "pdmesh:http_timeouts_total", phase="body") == 1
        assert await _counter(run, "pdmesh:http_client_disconnects_total") == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_running_out_of_file_descriptors_logs_one_line_not_one_per_accept() -> None:
    """With no descriptor left, every accept() fails and asyncio retries many times a
    second: counted, and logged once per interval; the waiting clients are served once
    descriptors are free."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.edge_emfile_process"],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdin is not None and proc.stdout is not None
    clients: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline().split()[1])
        for _ in range(40):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            clients.append(s)
        served = sum(s.recv(64).startswith(b"HTTP/1.1 200 ") for s in clients)
        proc.stdin.write("done\n")
        proc.stdin.flush()
        report = json.loads(proc.stdout.readline())
        assert proc.wait(10) == 0
    finally:
        for s in clients:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert served == len(clients)
    assert len(report["accept_lines"]) <= 2, report["accept_lines"][:3]
    assert report["accept_errors"] > 1  # it did run out, many times
