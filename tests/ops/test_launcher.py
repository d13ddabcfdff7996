"""`pdmesh up` end to end: real processes, real nats-server, real sockets, real HTTP."""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdmesh.services.ops import cli
from pdmesh.services.ops.launcher import KEY_ENV, Launcher
from pdmesh.services.ops.topology import mesh_services
from pdmesh.services.protocol import tickets
from pdmesh.services.runtime.config import up_settings
from tests.support.meshproc import REPO, NatsServer, mesh_env, run_mesh
from tests.support.oracle import expected_text

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.mesh
def test_up_serves_a_completion_then_stops_every_process() -> None:
    with run_mesh() as mesh:
        children = mesh.child_pids()
        # nats-server + admission + prefill + decode + gateway
        assert len(children) == 5, children
        status, body = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": "pdmesh says hello", "max_tokens": 12,
            "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == expected_text("pdmesh says hello", 12)
        assert body["usage"]["completion_tokens"] == 12
        assert mesh.stop() == 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in children if _alive(p)] == [], "orphaned processes after stop"


@pytest.mark.mesh
def test_services_reconnect_after_nats_restart() -> None:
    nats = NatsServer().start()
    try:
        with run_mesh("--nats-url", nats.url) as mesh:
            req = {"model": "tiny", "prompt": "before the outage", "max_tokens": 4,
                   "temperature": 0}
            assert mesh.http("POST", "/v1/completions", req)[0] == 200
            nats.stop()
            time.sleep(3)
            nats.start()
            # Heartbeats resume once every service has reconnected; then it serves again.
            deadline = time.monotonic() + 30
            status, body = 0, {}
            while time.monotonic() < deadline:
                status, body = mesh.http("POST", "/v1/completions", {
                    **req, "prompt": "after the outage"}, timeout=20)
                if status == 200:
                    break
                time.sleep(0.5)
            assert status == 200, body
            assert body["choices"][0]["text"] == expected_text("after the outage", 4)
    finally:
        nats.stop()


def _run(*args: str, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", *args], cwd=REPO,
                          env=env or mesh_env(), capture_output=True, text=True,
                          timeout=timeout)


def _one_clear_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pdmesh: error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_transport_is_one_clear_line() -> None:
    _one_clear_line(_run("serve", "decode", "--transport", "carrier-pigeon"), "transport")
    env = mesh_env(PDMESH_TRANSPORT="smoke-signals")
    _one_clear_line(_run("serve", "prefill", env=env), "PDMESH_TRANSPORT")


def test_unreachable_nats_is_one_clear_line() -> None:
    env = mesh_env(PDMESH_NATS_CONNECT_TIMEOUT_S="1", PDMESH_HTTP_PORT="0")
    proc = _run("serve", "admission", "--nats-url", "nats://127.0.0.1:1", env=env)
    _one_clear_line(proc, "NATS", "unreachable")


def test_port_in_use_is_one_clear_line() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _one_clear_line(_run("up", "--model", "tiny", "--gateway-port", str(port)),
                        str(port), "in use")
        env = mesh_env(PDMESH_HTTP_PORT=str(port))
        _one_clear_line(_run("serve", "admission", env=env), str(port))


def test_dev_credentials_are_refused_unless_allowed(tmp_path: Path) -> None:
    """A production start never runs on a built-in dev key or the bundled dev API keys by
    accident: one clear line, nothing started; `make up` passes --allow-dev-credentials."""
    env = {k: v for k, v in mesh_env().items() if k != "PDMESH_ALLOW_DEV_CREDENTIALS"
           and k not in KEY_ENV}
    _one_clear_line(_run("serve", "decode", env=env), "dev verify key",
                    "--allow-dev-credentials")
    _one_clear_line(_run("serve", "admission", env=env), "dev signing key",
                    "--allow-dev-credentials")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nid = "acme"\napi_keys = ["sk-{secrets.token_hex(16)}"]\n')
    salt = {"PDMESH_SALT_KEY": secrets.token_hex(32)}
    _one_clear_line(_run("serve", "gateway", env={**env, **salt}), "dev tenants")
    _one_clear_line(_run("serve", "gateway", env={**env, "PDMESH_TENANTS_FILE": str(tenants)}),
                    "dev salt key")
    # `pdmesh up` makes fresh keys, so the bundled tenants are what it refuses.
    _one_clear_line(_run("up", "--model", "tiny", env=env), "dev tenants",
                    "--allow-dev-credentials")
    # A copy of the dev tenants file holds the dev API keys: refused whatever its path.
    _one_clear_line(_run("serve", "gateway", env={
        **env, **salt, "PDMESH_TENANTS_FILE": str(REPO / "gateway" / "dev_tenants.toml")}),
        "dev API keys", "--allow-dev-credentials")
    # Real credentials pass the gate (this start then fails on purpose: no NATS there).
    proc = _run("serve", "gateway", "--nats-url", "nats://127.0.0.1:1", env={
        **env, **salt, "PDMESH_TENANTS_FILE": str(tenants),
        "PDMESH_NATS_CONNECT_TIMEOUT_S": "1", "PDMESH_GATEWAY_PORT": "0"})
    _one_clear_line(proc, "NATS", "unreachable")


@pytest.mark.parametrize("colocated", [False, True])
def test_each_process_gets_only_its_roles_key(colocated: bool) -> None:
    """The environment the launcher builds per process: admission the signing key, the
    workers its verify key, the gateway the salt key, and a key in the launcher's own
    environment reaches nobody it is not handed to."""
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    cfgs = cli.up_configs(args, colocated=colocated, env={})
    launcher = Launcher(nats_url="nats://127.0.0.1:4222", gateway_port=8000, prefill=2,
                        decode=2, env=cli.up_env(cfgs, allow_dev=True), colocated=colocated)
    specs = mesh_services(prefill=1 if colocated else 2, decode=1 if colocated else 2,
                          colocated=colocated)
    outer = {name: "ff" * 32 for name in KEY_ENV} | {"HOME": "/home/x"}
    signing = cfgs["admission"].signing_key
    holds = {"admission": "PDMESH_SIGNING_KEY", "gateway": "PDMESH_SALT_KEY"}
    for spec in specs:
        env = launcher.child_env(spec, outer)
        own = holds.get(spec.role, "PDMESH_VERIFY_KEY")
        tier = ["PDMESH_KV_TIER_KEY"] if spec.role == "prefill" else []
        assert [k for k in KEY_ENV if k in env] == [own, *tier], spec.name
        assert not tier or env[tier[0]] != "ff" * 32
        assert env[own] != "ff" * 32 and env["HOME"] == "/home/x"
        if own == "PDMESH_VERIFY_KEY":
            assert env[own] == tickets.verify_key_of(signing)
        elif own == "PDMESH_SIGNING_KEY":
            assert env[own] == signing
