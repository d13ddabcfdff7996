"""A NATS server that refuses a service's credentials ends its start at once with one line
saying so, not after the whole connect timeout as "unreachable"; the line carries no
password. A real nats-server with the mesh's authorization block."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdmesh.services.ops import natsauth
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.runtime.config import resolve
from pdmesh.services.runtime.service import ServiceRuntime
from tests.support.meshproc import NatsServer

CONNECT_TIMEOUT_S = 5.0


def _runtime(url: str, user: str, password: str) -> ServiceRuntime:
    return ServiceRuntime(resolve("admission", {
        "nats_url": url, "nats_user": user, "nats_password": password, "http_port": "0",
        "nats_connect_timeout_s": str(CONNECT_TIMEOUT_S)}, {}))


async def test_a_wrong_nats_password_is_an_authorization_failure(tmp_path: Path) -> None:
    ident = natsauth.identity("admission", "admission-x")
    conf = tmp_path / "nats.conf"
    conf.write_text(natsauth.server_config([ident]))
    server = NatsServer(config=conf).start()
    wrong = "wrong-" + ident.password
    try:
        rt = _runtime(f"nats://admission-x:{wrong}@127.0.0.1:{server.port}", ident.user, wrong)
        t0 = time.monotonic()
        with pytest.raises(StartupError) as refused:
            await rt.connect()
        took = time.monotonic() - t0
        text = str(refused.value)
        assert "authorization failed" in text and "'admission-x'" in text, text
        assert "unreachable" not in text and "TimeoutError" not in text, text
        assert wrong not in text and ident.password not in text, text
        assert f"127.0.0.1:{server.port}" in text
        assert took < CONNECT_TIMEOUT_S / 2, took
        ok = _runtime(server.url, ident.user, ident.password)  # the right one connects
        await ok.connect()
        assert ok.nc.is_connected
        await ok.nc.close()
    finally:
        server.stop()


def test_public_url_drops_the_userinfo() -> None:
    from pdmesh.services.runtime.service import public_url

    assert public_url("nats://u:p%40ss@host:4222") == "nats://host:4222"
    assert public_url("tls://10.0.0.1:4222/x") == "tls://10.0.0.1:4222/x"
    assert public_url("host:4222") == "host:4222"
