"""No log of a mesh carries a prompt, a key or a secret, however hostile the requests: a real
mesh (`pdmesh up`, tiny model, the default INFO logging) gets a battery of malformed,
oversized, cut-off and fuzzed HTTP requests, each carrying a marker and API keys, plus normal
requests with the marker in their prompts. Afterwards no line of any service's log holds the
marker, an API key, a NATS password or one of the mesh's keys, and every malformed request
was answered in the OpenAI error shape without its bytes."""

from __future__ import annotations

import json
import random
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.meshproc import Mesh, mesh_env, run_mesh

pytestmark = pytest.mark.mesh

MARKER = "patient-John-Doe-7f3a"
WRONG_KEY = "sk-wrong-" + MARKER


def _exchange(port: int, data: bytes, close_early: bool = False,
              timeout_s: float = 5.0) -> bytes:
    """Send raw bytes and read the answer until the server closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        if close_early:
            return b""
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _complete(raw: bytes) -> bool:
    head, _, body = raw.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip() or 0)
    return False


def _request(line: bytes, headers: list[bytes], body: bytes = b"") -> bytes:
    return line + b"\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n" + body


def _status(raw: bytes) -> int:
    parts = raw.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/1.") else 0


def _error_json(raw: bytes) -> dict:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), raw[:300]
    return json.loads(body)["error"]


def _secrets_of(mesh: Mesh) -> list[str]:
    """The NATS passwords of every identity of the run, and the mesh's keys."""
    found = [mesh.signing_key, mesh.salt_key, *mesh.api_keys, WRONG_KEY]
    if mesh.run_dir is not None:
        for url_file in Path(mesh.run_dir).glob("*.url"):
            for url in url_file.read_text().split(","):
                password = urlsplit(url.strip()).password
                if password:
                    found.append(password)
    return [s for s in found if s]


@pytest.mark.slow
def test_hostile_requests_leave_no_marker_key_or_secret_in_any_log() -> None:
    with run_mesh(env=mesh_env(PDMESH_LOG_LEVEL="INFO")) as mesh:
        port = mesh.gateway_port
        alice = mesh.api_keys[0]
        auth = f"Authorization: Bearer {alice}".encode()
        host = b"Host: 127.0.0.1"
        body = json.dumps({"model": "tiny", "prompt": f"the {MARKER} has HIV",
                           "max_tokens": 2}).encode()
        malformed = {
            "chunked with a raw JSON body": _request(
                b"POST /v1/completions HTTP/1.1",
                [host, auth, b"Content-Type: application/json",
                 b"Transfer-Encoding: chunked"], body),
            "an oversized Authorization header": _request(
                b"POST /v1/completions HTTP/1.1",
                [host, f"Authorization: Bearer {alice}{MARKER}{'x' * 9000}".encode()], b""),
            "a bad request line": _request(f"GET /{MARKER}\x01 HTTP/1.1".encode(), [host]),
            "a header with control characters": _request(
                b"GET /v1/models HTTP/1.1",
                [host, auth, f"X-Note: {MARKER}\x00\x01".encode()]),
            "an invalid method": _request(f"{MARKER}( / HTTP/1.1".encode(), [host]),
        }
        for what, data in malformed.items():
            raw = _exchange(port, data)
            assert _status(raw) // 100 == 4, (what, raw[:200])
            err = _error_json(raw)
            assert MARKER not in json.dumps(err) and alice not in json.dumps(err), what
            assert b"Python/" not in raw and b"aiohttp" not in raw.split(b"\r\n\r\n")[0], what
        # Cut off mid-upload; invalid UTF-8; a wrong key; an unknown route.
        _exchange(port, _request(b"POST /v1/completions HTTP/1.1",
                                 [host, auth, b"Content-Type: application/json",
                                  b"Content-Length: 100000"], body), close_early=True)
        for data in (
                _request(b"POST /v1/completions HTTP/1.1",
                         [host, auth, b"Content-Type: application/json",
                          b"Content-Length: %d" % (len(body) + 2)], body[:-1] + b"\xff\xfe}"),
                _request(b"POST /v1/completions HTTP/1.1",
                         [host, f"Authorization: Bearer {WRONG_KEY}".encode(),
                          b"Content-Length: %d" % len(body)], body),
                _request(f"GET /v1/{MARKER}?q={MARKER} HTTP/1.1".encode(), [host, auth])):
            raw = _exchange(port, data)
            assert _status(raw) // 100 == 4, raw[:200]
            assert MARKER.encode() not in raw
        # Fuzzed requests: random bytes around the marker, in the head and in the body.
        rng = random.Random(7)
        for _ in range(150):
            junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
            parts = [b"POST /v1/completions HTTP/1.1", host, auth,
                     b"X-" + junk + MARKER.encode() + b": v", b"Content-Length: 40"]
            rng.shuffle(parts)
            _exchange(port, b"\r\n".join(parts) + b"\r\n\r\n" + junk + MARKER.encode()[:40],
                      timeout_s=2.0)
        # The normal path, the marker in every prompt.
        assert mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": f"say {MARKER}", "max_tokens": 3}, key=alice)[0] == 200
        sse = json.dumps({"model": "tiny", "prompt": f"say {MARKER}", "max_tokens": 3,
                          "stream": True}).encode()
        streamed = _exchange(port, _request(
            b"POST /v1/completions HTTP/1.1", [host, auth, b"Content-Type: application/json",
                                               b"Connection: close",
                                               b"Content-Length: %d" % len(sse)], sse))
        assert _status(streamed) == 200 and b"[DONE]" in streamed
        assert mesh.http("POST", "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": MARKER}],
            "max_tokens": 3}, key=alice)[0] == 200
        assert mesh.http("POST", "/tokenize", {"model": "tiny", "prompt": MARKER},
                         key=alice)[0] == 200
        secrets = _secrets_of(mesh)
        time.sleep(1.0)  # let the services' last lines reach the log
    log = "\n".join(mesh.log)
    assert len(mesh.log) < 400, f"{len(mesh.log)} log lines for ~170 bad requests"
    for needle in [MARKER, *secrets]:
        hits = [line for line in mesh.log if needle in line]
        assert not hits, (needle[:12], hits[:3])
    assert "Traceback" not in log, log[-3000:]
