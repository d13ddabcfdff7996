"""Production mode is unmistakable: the bundled dev API keys are refused by value wherever a
tenants file holds them, the dev keys by value, and keys that are a pattern rather than random
bytes; each service says at start which mode it runs in."""

from __future__ import annotations

import hashlib
import secrets
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdmesh.gateway.tenants import DEV_TENANTS_FILE, TenantDirectory
from pdmesh.services.protocol import tickets
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import (
    DEV_API_KEY_SHA256S,
    DEV_SALT_KEY,
    DEV_SIGNING_KEY,
    check_dev_credentials,
    dev_credentials,
    key_weakness,
    resolve,
    tenants_with_dev_keys,
)
from tests.support.meshproc import REPO, mesh_env


def _dev_keys() -> list[str]:
    data = tomllib.loads(DEV_TENANTS_FILE.read_text())
    return [k for t in data["tenant"] for k in t["api_keys"]]


@pytest.fixture
def own_tenants(tmp_path: Path) -> Path:
    """A tenants file whose one tenant has a fresh key."""
    path = tmp_path / "own.toml"
    path.write_text(f'[[tenant]]\nid = "acme"\napi_keys = ["sk-{secrets.token_hex(16)}"]\n')
    return path


def _gateway(tenants: Path | str, salt: str | None = None):
    return resolve("gateway", {}, {"PDMESH_TENANTS_FILE": str(tenants),
                                   "PDMESH_SALT_KEY": salt or secrets.token_hex(32)})


def test_the_dev_digests_are_those_of_the_bundled_dev_tenants() -> None:
    keys = _dev_keys()
    assert keys and {hashlib.sha256(k.encode()).hexdigest() for k in keys} == set(
        DEV_API_KEY_SHA256S)


def test_a_copy_of_the_dev_tenants_file_is_refused_without_allow(tmp_path: Path) -> None:
    copy = tmp_path / "secrets" / "tenants.toml"
    copy.parent.mkdir()
    shutil.copy(DEV_TENANTS_FILE, copy)
    cfg = _gateway(copy)
    with pytest.raises(ConfigError) as info:
        check_dev_credentials(cfg, allowed=False)
    message = str(info.value)
    assert info.value.field == "tenants_file" and "dev API keys" in message
    assert "alice" in message and "--allow-dev-credentials" in message
    check_dev_credentials(cfg, allowed=True)  # `make up`, a lab
    assert any("dev API keys" in what for what in dev_credentials(cfg))


def test_a_dev_key_is_refused_mixed_in_or_given_as_its_digest(tmp_path: Path) -> None:
    mine = f"sk-{secrets.token_hex(16)}"
    mixed = tmp_path / "mixed.toml"
    mixed.write_text(f'[[tenant]]\nid = "acme"\napi_keys = ["{mine}"]\n\n'
                     f'[[tenant]]\nid = "beta"\napi_key_sha256s = '
                     f'["{hashlib.sha256(b"sk-dev-bob").hexdigest().upper()}"]\n')
    assert tenants_with_dev_keys(str(mixed)) == ["beta"]
    with pytest.raises(ConfigError, match="tenant beta"):
        check_dev_credentials(_gateway(mixed), allowed=False)


def test_a_tenants_file_with_keys_of_its_own_passes(own_tenants: Path,
                                                    tmp_path: Path) -> None:
    cfg = _gateway(own_tenants)
    assert dev_credentials(cfg) == []
    check_dev_credentials(cfg, allowed=False)
    TenantDirectory.load(own_tenants, cfg.salt_key)
    # A file the check cannot read is the gateway's to refuse at load, saying why.
    assert tenants_with_dev_keys(str(tmp_path / "missing.toml")) == []


@pytest.mark.parametrize("weak", [
    "ab" * 32,                                   # one byte repeated
    "00" * 32,
    "0123" * 16,                                 # two bytes cycling
    "".join(f"{i:02x}" for i in range(32)),      # counting
    "".join(f"{(7 * i) % 256:02x}" for i in range(32)),  # a constant step
    ("deadbeef" * 8).upper(),
])
def test_a_weak_salt_or_signing_key_is_refused_in_production(weak: str,
                                                            own_tenants: Path) -> None:
    assert key_weakness(weak)
    cfg = _gateway(own_tenants, salt=weak)
    with pytest.raises(ConfigError) as info:
        check_dev_credentials(cfg, allowed=False)
    assert info.value.field == "salt_key" and "weak salt key" in str(info.value)
    assert weak not in str(info.value)
    check_dev_credentials(cfg, allowed=True)
    admission = resolve("admission", {}, {"PDMESH_SIGNING_KEY": weak})
    with pytest.raises(ConfigError, match="weak signing key"):
        check_dev_credentials(admission, allowed=False)


def test_a_short_salt_key_is_refused(own_tenants: Path) -> None:
    with pytest.raises(ConfigError, match="64 hex characters"):
        _gateway(own_tenants, salt=secrets.token_hex(16))
    assert key_weakness(secrets.token_hex(16)) == "16 bytes, under 32"


def test_random_keys_are_never_weak() -> None:
    assert not [k for k in (secrets.token_hex(32) for _ in range(20000)) if key_weakness(k)]
    for _ in range(200):
        signing = tickets.generate_signing_key()
        assert key_weakness(signing) is None
        assert key_weakness(tickets.verify_key_of(signing)) is None


def test_the_dev_keys_are_refused_by_value_however_given(own_tenants: Path) -> None:
    for given in (DEV_SALT_KEY, DEV_SALT_KEY.upper()):
        cfg = _gateway(own_tenants, salt=given)
        with pytest.raises(ConfigError, match="dev salt key"):
            check_dev_credentials(cfg, allowed=False)
    cfg = resolve("admission", {"signing_key": DEV_SIGNING_KEY.upper()}, {})
    with pytest.raises(ConfigError, match="dev signing key"):
        check_dev_credentials(cfg, allowed=False)


def _serve_gateway(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in mesh_env().items() if k != "PDMESH_ALLOW_DEV_CREDENTIALS"}
    env.update({"PDMESH_NATS_CONNECT_TIMEOUT_S": "1", "PDMESH_GATEWAY_PORT": "0",
                "PDMESH_LOG_LEVEL": "INFO", "PDMESH_SALT_KEY": secrets.token_hex(32),
                **env_extra})
    return subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "serve", "gateway",
                           "--nats-url", "nats://127.0.0.1:1", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_serve_refuses_a_copied_dev_tenants_file_and_says_which_mode_runs(
        tmp_path: Path, own_tenants: Path) -> None:
    copy = tmp_path / "tenants.toml"
    shutil.copy(DEV_TENANTS_FILE, copy)
    refused = _serve_gateway({"PDMESH_TENANTS_FILE": str(copy)})
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    errors = [ln for ln in refused.stderr.splitlines() if ln.startswith("pdmesh: error:")]
    assert len(errors) == 1 and "dev API keys" in errors[0], refused.stderr
    # Allowed, it starts (and stops on purpose: no NATS there), saying it is a dev start.
    allowed = _serve_gateway({"PDMESH_TENANTS_FILE": str(copy)}, "--allow-dev-credentials")
    assert allowed.returncode == 1 and "unreachable" in allowed.stderr, allowed.stderr
    modes = [ln for ln in allowed.stderr.splitlines() if "mode" in ln]
    assert len(modes) == 1 and "INFO" in modes[0], allowed.stderr
    assert "development mode: dev credentials allowed" in modes[0]
    production = _serve_gateway({"PDMESH_TENANTS_FILE": str(own_tenants)})
    assert production.returncode == 1 and "unreachable" in production.stderr
    modes = [ln for ln in production.stderr.splitlines() if "mode" in ln]
    assert len(modes) == 1 and modes[0].endswith("gateway: production mode"), production.stderr


def test_up_refuses_a_copied_dev_tenants_file_before_anything_starts(tmp_path: Path) -> None:
    copy = tmp_path / "tenants.toml"
    shutil.copy(DEV_TENANTS_FILE, copy)
    env = {k: v for k, v in mesh_env().items() if k != "PDMESH_ALLOW_DEV_CREDENTIALS"}
    proc = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "up", "--model",
                           "tiny", "--tenants", str(copy)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("pdmesh: error:")]
    assert len(errors) == 1 and "dev API keys" in errors[0], proc.stderr
    assert "mesh ready" not in proc.stdout
