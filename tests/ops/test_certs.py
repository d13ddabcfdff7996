"""`pdmesh certs` (services/ops/certs.py): a dev CA and a NATS server certificate, made with
openssl, that nats-server serves and Python's TLS verifies for every listed host, and only
for those (threat: a client that trusts the mesh's CA talks to a server of another name)."""

from __future__ import annotations

import asyncio
import os
import ssl
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from pdmesh.services.ops import certs
from pdmesh.services.ops.launcher import free_port
from pdmesh.services.protocol import tickets
from tests.support.meshproc import NatsServer


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    assert certs.main(["--out", str(out), "--hosts", "10.9.8.7,nats.example"]) == 0
    return out


@pytest.fixture(scope="module")
def tls_nats(made: Path) -> Iterator[int]:
    conf = made / "tls.conf"
    conf.write_text(f'tls {{ cert_file: "{made / certs.SERVER_CERT}", '
                    f'key_file: "{made / certs.SERVER_KEY}" }}\n')
    server = NatsServer(config=conf).start()
    try:
        yield server.port
    finally:
        server.stop()


def _connect(port: int, ctx: ssl.SSLContext, hostname: str | None = None) -> str:
    async def attempt() -> str:
        try:
            nc = await nats.connect(f"tls://127.0.0.1:{port}", tls=ctx, tls_hostname=hostname,
                                    allow_reconnect=False, connect_timeout=3,
                                    max_reconnect_attempts=0)
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            return repr(exc)
        await nc.close()
        return "connected"
    return asyncio.run(attempt())


def test_the_certificate_names_every_host_and_loopback(made: Path) -> None:
    text = subprocess.run(["openssl", "x509", "-in", str(made / certs.SERVER_CERT), "-noout",
                           "-ext", "subjectAltName,extendedKeyUsage"], capture_output=True,
                          text=True, check=True).stdout
    for name in ("IP Address:10.9.8.7", "DNS:nats.example", "DNS:localhost",
                 "IP Address:127.0.0.1", "TLS Web Server Authentication",
                 "TLS Web Client Authentication"):  # client too: routes verify both ways
        assert name in text, text
    assert stat.S_IMODE((made / certs.CA_KEY).stat().st_mode) == 0o600


def test_nats_serves_it_and_python_verifies_it_against_the_ca(made: Path,
                                                             tls_nats: int) -> None:
    ca = ssl.create_default_context(cafile=str(made / certs.CA_CERT))
    assert _connect(tls_nats, ca) == "connected"  # 127.0.0.1 is in the SAN
    assert _connect(tls_nats, ca, "nats.example") == "connected"
    wrong_name = _connect(tls_nats, ca, "other.example")
    assert "certificate" in wrong_name.lower(), wrong_name
    assert "certificate" in _connect(tls_nats, ssl.create_default_context()).lower()


def test_bad_input_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert certs.main(["--out", str(tmp_path), "--hosts", "a host"]) == 2
    assert certs.main(["--out", str(tmp_path), "--hosts", ","]) == 2
    assert certs.main(["--out", str(tmp_path), "--hosts", "h", "--days", "0"]) == 2
    monkeypatch.setenv("PATH", "")
    assert certs.main(["--out", str(tmp_path), "--hosts", "h"]) == 2
    err = capsys.readouterr().err
    assert "not a host name" in err and "openssl" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_service_with_a_ca_never_talks_to_nats_in_clear(made: Path) -> None:
    """Threat: a man in the middle (or a misconfigured node) answers without TLS, and the
    service would send its NATS password in clear. With `PDMESH_NATS_TLS_CA` the service
    starts with a TLS handshake (runtime.connect: tls_handshake_first), so against a server
    that offers no TLS it never connects: it exits with one clear line."""
    plain = NatsServer().start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
        env.update(PDMESH_NATS_URL=f"tls://127.0.0.1:{plain.port}",
                   PDMESH_NATS_TLS_CA=str(made / certs.CA_CERT),
                   PDMESH_NATS_CONNECT_TIMEOUT_S="3",
                   PDMESH_SIGNING_KEY=tickets.generate_signing_key(),
                   PDMESH_HTTP_PORT=str(free_port()))
        done = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "serve",
                               "admission"], env=env, capture_output=True, text=True,
                              timeout=60, check=False)
    finally:
        plain.stop()
    assert done.returncode != 0, done.stderr[-2000:]
    assert "cannot start: NATS" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr[-2000:]
