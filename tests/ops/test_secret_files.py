"""Secrets from files: every setting marked `secret` may be given as a file its env var plus
`_FILE` names (as Docker and compose secrets mount them), never only on a command line."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.services.ops import cli
from pdmesh.services.protocol import tickets
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import (
    FILE_SUFFIX,
    file_env,
    in_env,
    resolve,
    resolve_nats,
    up_settings,
)
from pdmesh.services.runtime.settings import BY_FIELD, SETTINGS
from tests.support.meshproc import REPO, mesh_env

SECRET = [s for s in SETTINGS if s.secret]
ROLE_OF = {"nats_password": "admission", "signing_key": "admission", "salt_key": "gateway",
           "kv_tier_key": "prefill"}


def _value_for(field: str) -> str:
    if field == "signing_key":
        return tickets.generate_signing_key()
    return secrets.token_hex(32)


def _file_var(field: str) -> str:
    return BY_FIELD[field].env + FILE_SUFFIX


def test_the_secret_settings_are_the_ones_with_a_file_form() -> None:
    assert {s.field for s in SECRET} == set(ROLE_OF)
    assert all(file_env(s) == s.env + FILE_SUFFIX for s in SECRET)
    assert all(file_env(s) is None for s in SETTINGS if not s.secret)


@pytest.mark.parametrize("field", sorted(ROLE_OF))
@pytest.mark.parametrize("ending", ["", "\n", "\r\n"])
def test_a_secret_is_read_from_the_file_its_file_env_var_names(field: str, ending: str,
                                                               tmp_path: Path) -> None:
    value = _value_for(field)
    path = tmp_path / "secret"
    path.write_text(value + ending)
    cfg = resolve(ROLE_OF[field], {}, {_file_var(field): str(path)})
    assert getattr(cfg, field) == value
    assert in_env(field, {_file_var(field): str(path)})
    # A flag still comes first, as over the env var.
    flag_value = _value_for(field)
    cfg = resolve(ROLE_OF[field], {field: flag_value}, {_file_var(field): str(path)})
    assert getattr(cfg, field) == flag_value


def test_only_one_trailing_newline_is_stripped(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("pass word \n\n")
    assert resolve_nats({}, {_file_var("nats_password"): str(path)}).nats_password == (
        "pass word \n")


@pytest.mark.parametrize("field", sorted(ROLE_OF))
def test_env_var_and_file_both_set_is_refused_naming_both(field: str, tmp_path: Path) -> None:
    value = _value_for(field)
    path = tmp_path / "secret"
    path.write_text(value)
    env = {BY_FIELD[field].env: value, _file_var(field): str(path)}
    with pytest.raises(ConfigError) as info:
        resolve(ROLE_OF[field], {}, env)
    message = str(info.value)
    assert BY_FIELD[field].env in message and _file_var(field) in message
    assert value not in message


def test_a_missing_empty_or_bad_file_is_one_clear_error_without_the_value(
        tmp_path: Path) -> None:
    var = _file_var("salt_key")
    with pytest.raises(ConfigError, match=f"{var}=.*missing: cannot read it"):
        resolve("gateway", {}, {var: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        resolve("gateway", {}, {var: str(tmp_path / "empty")})
    short = secrets.token_hex(8)
    (tmp_path / "short").write_text(short)
    with pytest.raises(ConfigError) as info:
        resolve("gateway", {}, {var: str(tmp_path / "short")})
    assert var in str(info.value) and "64 hex" in str(info.value)
    assert short not in str(info.value)


def test_a_setting_that_is_not_secret_has_no_file_form(tmp_path: Path) -> None:
    path = tmp_path / "model"
    path.write_text("smollm2")
    cfg = resolve("gateway", {}, {BY_FIELD["model"].env + FILE_SUFFIX: str(path)})
    assert cfg.model == BY_FIELD["model"].default


def test_up_takes_the_keys_from_files_instead_of_making_fresh_ones(tmp_path: Path) -> None:
    import argparse

    signing, salt = tickets.generate_signing_key(), secrets.token_hex(32)
    (tmp_path / "signing").write_text(signing + "\n")
    (tmp_path / "salt").write_text(salt + "\n")
    env = {_file_var("signing_key"): str(tmp_path / "signing"),
           _file_var("salt_key"): str(tmp_path / "salt")}
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    cfgs = cli.up_configs(args, colocated=False, env=env)
    assert cfgs["admission"].signing_key == signing
    assert cfgs["gateway"].salt_key == salt
    assert cfgs["decode"].verify_key == tickets.verify_key_of(signing)


def test_serve_reads_the_salt_key_file_and_help_names_it(tmp_path: Path) -> None:
    """The whole command: a gateway given its salt key only as a file passes the key checks
    (it then stops on purpose: no NATS there)."""
    salt = tmp_path / "salt"
    salt.write_text(secrets.token_hex(32) + "\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[[tenant]]\nid = "acme"\napi_keys = ["sk-{secrets.token_hex(16)}"]\n')
    env = {k: v for k, v in mesh_env().items() if not k.startswith("PDMESH_SALT_KEY")}
    env.update({_file_var("salt_key"): str(salt), "PDMESH_TENANTS_FILE": str(tenants),
                "PDMESH_NATS_CONNECT_TIMEOUT_S": "1", "PDMESH_GATEWAY_PORT": "0"})
    env.pop("PDMESH_ALLOW_DEV_CREDENTIALS", None)
    proc = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "serve", "gateway",
                           "--nats-url", "nats://127.0.0.1:1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "NATS" in proc.stderr and "unreachable" in proc.stderr, proc.stderr
    assert "salt" not in proc.stderr.split("pdmesh: error:")[-1]
    help_text = subprocess.run(
        [sys.executable, "-m", "pdmesh.services.ops.cli", "serve", "gateway", "--help"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60).stdout
    assert _file_var("salt_key") in " ".join(help_text.split())
