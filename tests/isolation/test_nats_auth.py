"""The control plane is authenticated: `pdmesh up`'s NATS refuses clients without
credentials, and each identity may use only the subjects of its role (services/ops/natsauth.py).

Threats: an outsider who reaches the NATS port reads every request's control messages
(reservations, page ids, data-plane addresses) or ends anyone's request; a compromised
gateway forges a dispatch; a worker forges another worker's heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.aio.msg
import nats.errors
import pytest

from pdmesh.services.ops import natsauth
from pdmesh.services.ops.launcher import free_port, nats_server_binary
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, NatsServer
from tests.support.meshstats import heartbeats, worker_stats


class Client:
    """A NATS connection that records the server's asynchronous errors (permission
    violations arrive that way)."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def connect(self, url: str) -> nats.NATS:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False,
                                     connect_timeout=2)
        return self.nc

    def violations(self) -> list[str]:
        return [e for e in self.errors if "permissions violation" in e.lower()]


@pytest.mark.mesh
def test_nats_refuses_a_client_without_credentials(mesh: Mesh) -> None:
    assert mesh.run_dir is not None, "pdmesh up runs its embedded NATS with auth"

    async def attempt() -> None:
        nc = await nats.connect(mesh.nats_plain_url, allow_reconnect=False,
                                connect_timeout=2, max_reconnect_attempts=0)
        await nc.close()

    with pytest.raises(Exception) as info:
        asyncio.run(attempt())
    assert "authorization" in repr(info.value).lower() or isinstance(
        info.value, nats.errors.NoServersError), repr(info.value)


@pytest.mark.mesh
def test_a_reader_cannot_watch_the_control_plane(mesh: Mesh) -> None:
    """The tools identity may read heartbeats and stats, not `>`: subscribing to every
    subject is refused, and a request served meanwhile shows it nothing."""
    seen: list[str] = []

    async def watch() -> list[str]:
        client = Client()
        nc = await client.connect(mesh.nats_url)

        async def on_msg(msg: nats.aio.msg.Msg) -> None:
            seen.append(msg.subject)

        await nc.subscribe(">", cb=on_msg)
        await nc.flush()
        loop = asyncio.get_running_loop()
        status, _ = await loop.run_in_executor(None, lambda: mesh.http(
            "POST", "/v1/completions", {"model": "tiny", "prompt": "watch me", "max_tokens": 4}))
        assert status == 200
        await asyncio.sleep(0.3)
        await nc.close()
        return client.violations()

    violations = asyncio.run(watch())
    assert violations, "subscribing to '>' should be a permissions violation"
    assert not seen, seen


@pytest.mark.mesh
def test_the_gateway_cannot_dispatch_and_no_one_forges_a_heartbeat(mesh: Mesh) -> None:
    prefill = next(w for w in worker_stats(mesh.nats_url).values()
                   if w.role is m.Role.PREFILL)
    rid = f"forged-{uuid.uuid4().hex[:8]}"
    ticket = m.AdmittedTicket(request_id=rid, tenant="mallory", cache_salt="x", prompt_len=2,
                              max_tokens=2, prefill_worker=prefill.worker_id,
                              decode_worker="d", expires_at=0.0, nonce="n")
    dispatch = m.PrefillDispatch(ticket=ticket, prompt_ids=[1, 2], sampling=m.Sampling(),
                                 reservation=m.Reservation(
                                     reservation_id=str(uuid.uuid4()), epoch=1, page_ids=[0],
                                     page_tokens=16, page_bytes=64,
                                     data_address="tcp://127.0.0.1:9"))
    forged_beat = m.Heartbeat(worker_id="prefill-forged", role=m.Role.PREFILL, model="tiny",
                              pool_capacity_tokens=1 << 20, available_tokens=1 << 20,
                              page_tokens=16, served_context=1 << 20)

    async def forge() -> list[str]:
        client = Client()
        nc = await client.connect(mesh.nats_url_for("gateway"))
        await nc.publish(m.dispatch_subject(prefill.worker_id), m.encode(dispatch))
        for _ in range(3):
            await nc.publish(m.heartbeat_subject("prefill", "prefill-forged"),
                             m.encode(forged_beat))
        await nc.flush()
        await asyncio.sleep(0.3)
        await nc.close()
        return client.violations()

    violations = asyncio.run(forge())
    assert len(violations) >= 2, violations  # the dispatch and the heartbeats
    assert "prefill-forged" not in heartbeats(mesh.nats_url, listen_s=1.0)
    after = worker_stats(mesh.nats_url)[prefill.worker_id]
    assert rid not in after.request_ids  # prefill never heard of the forged dispatch


# ---- compose: role-level users from `pdmesh secrets` -------------------------------------

def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


@pytest.fixture
def compose_nats(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real nats-server run as compose runs it: `--config` the written nats.conf."""
    assert natsauth.main(["--out", str(tmp_path)]) == 0
    server = NatsServer(config=tmp_path / "nats.conf").start()
    try:
        yield server.url, tmp_path
    finally:
        server.stop()


def test_compose_secrets_refuse_strangers_and_keep_roles_apart(
        compose_nats: tuple[str, Path]) -> None:
    """Every prefill replica shares the `prefill` user (its worker id is not known in
    advance), which still may only act as a prefill: its own kind of heartbeat and dispatch,
    never a decode heartbeat or a reservation."""
    url, secrets_dir = compose_nats
    creds = {role: _env(secrets_dir / f"nats-{role}.env") for role in ("prefill", "decode")}
    assert creds["prefill"]["PDMESH_NATS_USER"] == "prefill"
    worker = f"prefill-{uuid.uuid4().hex[:6]}"

    async def run() -> tuple[list[str], list[str]]:
        with pytest.raises(Exception) as refused:
            await nats.connect(url, allow_reconnect=False, connect_timeout=2,
                               max_reconnect_attempts=0)
        assert "authorization" in repr(refused.value).lower() or isinstance(
            refused.value, nats.errors.NoServersError), repr(refused.value)
        seen: list[str] = []
        watcher = Client()
        wnc = await watcher.connect(url.replace("nats://", "nats://{}:{}@".format(
            creds["decode"]["PDMESH_NATS_USER"], creds["decode"]["PDMESH_NATS_PASSWORD"])))

        async def on_msg(msg: nats.aio.msg.Msg) -> None:
            seen.append(msg.subject)

        await wnc.subscribe(m.heartbeat_subject("prefill", "*"), cb=on_msg)
        await wnc.flush()
        replica = Client()
        nc = await replica.connect(url.replace("nats://", "nats://{}:{}@".format(
            creds["prefill"]["PDMESH_NATS_USER"], creds["prefill"]["PDMESH_NATS_PASSWORD"])))
        await nc.subscribe(m.dispatch_subject(worker))  # its own: allowed
        await nc.publish(m.heartbeat_subject("prefill", worker), b"{}")  # allowed
        await nc.flush()
        assert not replica.violations(), replica.errors
        await nc.publish(m.heartbeat_subject("decode", worker), b"{}")
        await nc.subscribe(m.reserve_subject("decode-1"))
        await nc.flush()
        await asyncio.sleep(0.3)
        await nc.close()
        await wnc.close()
        return seen, replica.violations()

    seen, violations = asyncio.run(run())
    assert seen == [m.heartbeat_subject("prefill", worker)]
    assert len(violations) >= 2, violations  # the decode heartbeat and the reserve subscription


def test_pdmesh_secrets_keeps_the_existing_keys(tmp_path: Path) -> None:
    """Every host of a multi-host mesh must share the keys: rewriting the NATS credentials
    never replaces them (tests/ops/test_secrets.py checks the key files themselves)."""
    assert natsauth.main(["--out", str(tmp_path)]) == 0
    keys = {name: (tmp_path / name).read_text() for name in natsauth.KEY_FILES}
    assert natsauth.main(["--out", str(tmp_path)]) == 0
    assert {name: (tmp_path / name).read_text() for name in natsauth.KEY_FILES} == keys
    conf = (tmp_path / "nats.conf").read_text()
    for role in natsauth.ROLES:
        password = _env(tmp_path / f"nats-{role}.env")["PDMESH_NATS_PASSWORD"]
        assert f'"{password}"' in conf
    assert natsauth.main(["--out", str(tmp_path), "--roles", "gateway,nobody"]) == 2


def _start_nats(*args: str, monitor: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([nats_server_binary(), "-m", str(monitor), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", monitor),
                                                                     timeout=0.2):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nats-server did not start")


def _num_routes(monitor: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor}/routez", timeout=2) as resp:
        return int(json.load(resp)["num_routes"])


def test_cluster_routes_need_the_route_password(tmp_path: Path) -> None:
    """Multi-host NATS (`pdmesh secrets --hosts`): the nodes route to each other with the
    route user; a server without it cannot join the cluster (it would see every message)."""
    hosts, port = ["127.0.0.1", "127.0.0.2"], free_port()
    auth = natsauth.server_config(natsauth.role_identities().values())
    password = "route-" + uuid.uuid4().hex
    procs = []
    try:
        for i, host in enumerate(hosts):
            conf = tmp_path / f"n{i}.conf"
            conf.write_text(auth + natsauth.cluster_config(hosts, password, port, host))
            procs.append(_start_nats("--config", str(conf), "-a", "127.0.0.1",
                                     "-p", str(free_port()), monitor=(mon := free_port())))
            if i == 0:
                first_monitor = mon
        intruder_monitor = free_port()
        procs.append(_start_nats(
            "-a", "127.0.0.1", "-p", str(free_port()), "--cluster_name", "pdmesh",
            "--cluster", f"nats://127.0.0.3:{port}",
            "--routes", f"nats://127.0.0.1:{port}", monitor=intruder_monitor))
        deadline = time.monotonic() + 10
        while _num_routes(first_monitor) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # the intruder has tried by now (it dials at start)
        assert _num_routes(first_monitor) > 0, "the two nodes did not form a cluster"
        assert _num_routes(intruder_monitor) == 0, "a server without the route password joined"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
