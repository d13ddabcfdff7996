"""The gateway's API port answers what aiohttp's HTTP parser refuses as an OpenAI-shaped JSON
error that repeats none of the request's bytes, and no log line repeats them either; a
client that drops mid-upload is counted, not logged as an error; no response names the
server's software. A real gateway (scripted mesh, real nats-server), raw sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from tests.support.meshproc import NatsServer
from tests.support.scripted_mesh import Running, gateways

MARKER = "patient-John-Doe-HIV-7f3a"  # what must appear in no answer and no log line
KEY = "sk-dev-alice"
HEAD = "POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
BODY = json.dumps({"model": "tiny", "prompt": MARKER, "max_tokens": 1})
ERROR_KEYS = {"message", "type", "param", "code"}


async def _finish(mesh, request_id: str) -> None:
    await mesh.token(request_id, 0, finish=True)


def _case(head: str, body: str = "") -> bytes:
    return (head + "\r\n" + body).encode()


# (what, bytes sent at once, status)
CASES = [
    ("a chunked body that is raw JSON", _case(
        HEAD + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n", BODY), 400),
    ("an oversized Authorization header", _case(
        HEAD + f"Authorization: Bearer {KEY}{MARKER * 400}\r\nContent-Length: 2\r\n", "{}"),
     431),
    ("a bad request line", _case(f"GE T /v1/{MARKER} HTTP/1.1\r\nHost: gw\r\n"), 400),
    ("a header line without a colon", _case(HEAD + f"{MARKER}\r\n"), 400),
    ("a bad Content-Length", _case(HEAD + f"Content-Length: {MARKER}\r\n", BODY), 400),
    ("TLS on the HTTP port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + MARKER.encode(),
     400),
]


async def _exchange(port: int, *parts: bytes, pause_s: float = 0.0) -> bytes:
    """Send `parts` (pausing between them), then read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, part in enumerate(parts):
            if i and pause_s:
                await asyncio.sleep(pause_s)
            writer.write(part)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(f"{r.levelname} {r.name} {r.getMessage()} {r.exc_text or ''}"
                     for r in caplog.records)


async def _counter(run: Running, name: str, **labels: str) -> float:
    metrics = await run.metrics()
    return sum(v for (n, ls), v in metrics.items()
               if n == name and {"service": "gateway", **labels}.items() <= dict(ls).items())


async def test_parser_errors_are_json_without_the_requests_bytes(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with gateways(nats_server.url) as start:
        run = await start(_finish)
        port = run.gw.rt.http_port
        for what, data, status in CASES:
            raw = await _exchange(port, data)
            got, headers, body = _parse(raw)
            assert got == status, (what, raw[:300])
            assert headers["content-type"].startswith("application/json"), what
            error = json.loads(body)["error"]
            assert set(error) == ERROR_KEYS and error["param"] is None, (what, error)
            assert error["type"] == "invalid_request_error", (what, error)
            assert error["code"] == "bad_http_request", (what, error)
            assert MARKER.encode() not in raw and KEY.encode() not in raw, what
            assert headers["server"] == "pdmesh", what
        # Headers first, the broken chunked body a moment later: the gateway is then
        # already reading the body when the parser fails.
        raw = await _exchange(port, _case(HEAD + f"Authorization: Bearer {KEY}\r\n"
                                          "Transfer-Encoding: chunked\r\n"),
                              BODY.encode(), pause_s=0.2)
        got, _, body = _parse(raw)
        assert got == 400 and json.loads(body)["error"]["code"] == "bad_http_request"
        assert MARKER.encode() not in raw
        counted = await _counter(run, "pdmesh:http_bad_requests_total")
        assert counted == len(CASES) + 1
    logged = _logged(caplog)
    assert MARKER not in logged and KEY not in logged
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], logged


async def test_a_client_gone_mid_upload_is_a_counter_and_no_response_names_the_software(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with gateways(nats_server.url) as start:
        run = await start(_finish)
        port = run.gw.rt.http_port
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_case(HEAD + f"Authorization: Bearer {KEY}\r\n"
                           "Content-Length: 100000\r\n", BODY))
        await writer.drain()
        await asyncio.sleep(0.2)  # the gateway is reading the body
        writer.close()
        deadline = time.monotonic() + 5
        while not await _counter(run, "pdmesh:http_client_disconnects_total"):
            assert time.monotonic() < deadline, "no disconnect counted"
            await asyncio.sleep(0.05)
        # Every kind of answer: the API, an error, the public health check.
        for request in (f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                        f"{KEY}\r\nConnection: close\r\n\r\n",
                        "GET /nowhere HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n",
                        "GET /health HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"):
            status, headers, _ = _parse(await _exchange(port, request.encode()))
            assert headers.get("server") == "pdmesh", (request, status, headers)
        status, _, _ = await run.post({"prompt": "Hi", "max_tokens": 1})
        assert status == 200  # the gateway serves on
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, _logged(caplog)
