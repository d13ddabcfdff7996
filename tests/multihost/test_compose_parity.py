"""The lab runs what `compose/multihost/*.yml` runs: the same command per role and the same
values for the settings those files set (no root needed: nothing is started here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdmesh.services.ops import natsauth
from tests.support.lab import NATS_PORT, SERVICES, Lab
from tests.support.netns import Host

ROLE_FILES = {"control": ("admission", "gateway"), "prefill": ("prefill",),
              "decode": ("decode",)}
HOST_VARS = {"CONTROL_HOST": "control", "PREFILL_HOST": "prefill", "DECODE_HOST": "decode"}
COMPOSE = Path(__file__).resolve().parents[2] / "compose" / "multihost"


def _lab(secrets_dir: Path) -> Lab:
    lab = Lab("tcp")
    for i, host in enumerate(("control", "prefill", "decode", "decode2")):
        lab.switch.hosts[host] = Host(f"x-{host}", f"10.231.0.{10 + i}", f"p-{host}")
    lab.secrets_dir = secrets_dir
    natsauth.write_secrets(secrets_dir)
    return lab


def _substitute(value: str, lab: Lab) -> str:
    """compose's ${VAR:?} / ${VAR:-default} as the lab's hosts.env would fill them."""
    def one(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(3) or ""
        if name in HOST_VARS:
            return lab.addr(HOST_VARS[name])
        return {"PDMESH_TRANSPORT": "tcp", "PDMESH_MODEL": "tiny"}.get(name, default)
    return re.sub(r"\$\{(\w+)(:[?-]([^}]*))?\}", one, value)


@pytest.mark.parametrize("host", sorted(ROLE_FILES))
def test_lab_services_get_the_compose_environment(host: str, tmp_path: Path) -> None:
    lab = _lab(tmp_path)
    doc = yaml.safe_load((COMPOSE / f"{host}.yml").read_text())
    nats_cmd = [_substitute(a, lab) for a in doc["services"]["nats"]["command"]]
    assert f"--client_advertise={lab.addr(host)}:{NATS_PORT}" in nats_cmd
    for role in ROLE_FILES[host]:
        service = doc["services"][role]
        assert service["command"] == ["pdmesh", "serve", role]
        wid, port = next((w, p) for h, r, w, p in SERVICES if h == host and r == role)
        env = lab.service_env(host, role, wid, port)
        for key, value in service["environment"].items():
            if key in ("PDMESH_HTTP_PORT", "PDMESH_GATEWAY_PORT", "PDMESH_METRICS_PORT",
                       "PDMESH_TENANTS_FILE", "PDMESH_NATS_TLS_CA", "PDMESH_LOG_LEVEL"):
                continue  # per-process ports; secrets (own paths); verbosity
            assert env.get(key) == _substitute(str(value), lab), (role, key)
        # The role's NATS user, from the env file compose reads (same name as the lab's).
        env_files = [Path(f).name for f in service["env_file"]]
        assert f"nats-{role}.env" in env_files
        # The role's keys, from their key files, and no other role's (compose: env_file).
        key_files = [f for f in env_files if f in natsauth.KEY_FILES]
        assert key_files == [f for f, (_, roles) in natsauth.KEY_FILES.items()
                             if role in roles], (role, key_files)
        key_vars = [natsauth.KEY_FILES[f][0] for f in key_files]
        held = [v for v, _ in natsauth.KEY_FILES.values() if v in env]
        assert held == key_vars, (role, held)
        for key_file, key_var in zip(key_files, key_vars, strict=True):
            assert (tmp_path / key_file).read_text() == f"{key_var}={env[key_var]}\n"
        assert env["PDMESH_NATS_USER"] == role
        assert env["PDMESH_NATS_TLS_CA"].endswith("/nats-ca.crt")
        assert service["environment"]["PDMESH_NATS_TLS_CA"] == "/run/secrets/nats-ca.crt"
