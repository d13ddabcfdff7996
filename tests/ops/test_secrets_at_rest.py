"""Secrets at rest: `pdmesh secrets` and `pdmesh certs` write every secret 0600 and every
directory they make 0700 whatever the umask; only the two certificates are public (0644).
The CA key lies in its own directory, `ca-private/`, never among the files operators copy to
every host; a rerun over a directory or key file that others may read tightens it and says
so (threat: another local user, or a backup or copy of the secrets directory, reads the NATS
passwords, the ticket signing key, the server key or the CA key)."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdmesh.services.ops import certs, natsauth
from pdmesh.services.protocol import tickets

HOSTS = "10.9.8.7,nats.example"
# Every file `pdmesh secrets` writes, by path under --out, with its mode.
SECRETS = {"nats.conf": 0o600, "signing.env": 0o600, "verify.env": 0o600, "salt.env": 0o600,
           "kvtier.env": 0o600,
           **{f"nats-{user}.env": 0o600 for user in (*natsauth.ROLES, natsauth.TOOLS_USER)}}
CERTS = {"nats-ca.crt": 0o644, "nats-server.crt": 0o644, "nats-server.key": 0o600,
         "ca-private/nats-ca.key": 0o600}
WITH_HOSTS = {**SECRETS, **CERTS, "nats-cluster.conf": 0o600}


@pytest.fixture(params=[0o022, 0o000], ids=["umask022", "umask000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(files, directories) under `root`, by relative path, with their permission bits."""
    files, dirs = {}, {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        (dirs if path.is_dir() else files)[str(path.relative_to(root))] = mode
    return files, dirs


def _octal(modes: dict[str, int]) -> dict[str, str]:
    return {name: f"{mode:04o}" for name, mode in modes.items()}


def _public_key(*openssl: str) -> str:
    return subprocess.run(["openssl", *openssl], capture_output=True, text=True,
                          check=True).stdout


def test_secrets_files_are_0600_in_a_0700_directory(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "made" / "secrets"  # a missing parent too: made 0700 as well
    assert natsauth.main(["--out", str(out)]) == 0
    files, dirs = _modes(out)
    assert _octal(files) == _octal(SECRETS)
    assert _octal(dirs) == {".": "0700"}
    assert stat.S_IMODE((tmp_path / "made").stat().st_mode) == 0o700


def test_the_pdmesh_commands_write_the_same_modes(tmp_path: Path, umask: int) -> None:
    """`pdmesh secrets` and `pdmesh certs` as an operator runs them (services/ops/cli.py)."""
    for command, out, expected in (("secrets", tmp_path / "s", WITH_HOSTS),
                                   ("certs", tmp_path / "c", CERTS)):
        done = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", command,
                               "--out", str(out), "--hosts", HOSTS], capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        files, dirs = _modes(out)
        assert _octal(files) == _octal(expected), command
        assert _octal(dirs) == {".": "0700", "ca-private": "0700"}, command


def test_secrets_with_hosts_keep_the_ca_key_apart(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "secrets"
    assert natsauth.main(["--out", str(out), "--hosts", HOSTS]) == 0
    files, dirs = _modes(out)
    assert _octal(files) == _octal(WITH_HOSTS)
    assert _octal(dirs) == {".": "0700", "ca-private": "0700"}
    # What is copied to the hosts (the files of --out, not ca-private/) holds no CA key.
    ca_key = out / certs.CA_KEY
    assert ca_key.parent.name == certs.CA_PRIVATE_DIR and ca_key.parent.parent == out
    assert _public_key("pkey", "-in", str(ca_key), "-pubout") == _public_key(
        "x509", "-in", str(out / certs.CA_CERT), "-noout", "-pubkey")  # it is the CA's key
    key = ca_key.read_bytes()
    copied = [p for p in out.iterdir() if p.is_file()]
    assert not (out / "nats-ca.key").exists()
    assert [p.name for p in copied if p.read_bytes() == key] == []


def test_certs_files_and_the_ca_key_directory(tmp_path: Path, umask: int) -> None:
    out = tmp_path / "certs"
    assert certs.main(["--out", str(out), "--hosts", HOSTS]) == 0
    files, dirs = _modes(out)
    assert _octal(files) == _octal(CERTS)
    assert _octal(dirs) == {".": "0700", "ca-private": "0700"}
    assert not (out / "nats-ca.key").exists()


def test_a_rerun_tightens_a_loose_secrets_directory_and_kept_keys(
        tmp_path: Path, umask: int, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "secrets"
    out.mkdir()
    os.chmod(out, 0o755)
    signing = tickets.generate_signing_key()
    for name, text in {"signing.env": f"PDMESH_SIGNING_KEY={signing}\n",
                       "salt.env": f"PDMESH_SALT_KEY={secrets.token_hex(32)}\n",
                       "verify.env": f"PDMESH_VERIFY_KEY={tickets.verify_key_of(signing)}\n",
                       "nats.conf": "stale\n"}.items():
        (out / name).write_text(text)
        os.chmod(out / name, 0o644)
    assert natsauth.main(["--out", str(out), "--hosts", HOSTS]) == 0
    files, dirs = _modes(out)
    assert _octal(files) == _octal(WITH_HOSTS)
    assert _octal(dirs) == {".": "0700", "ca-private": "0700"}
    assert (out / "signing.env").read_text() == f"PDMESH_SIGNING_KEY={signing}\n"  # kept
    err = capsys.readouterr().err
    assert f"tightened {out} from 0755 to 0700" in err
    for kept in ("signing.env", "salt.env", "verify.env"):
        assert f"tightened {out / kept} from 0644 to 0600" in err
    # Once private, a rerun has nothing to say.
    assert natsauth.main(["--out", str(out)]) == 0
    assert "tightened" not in capsys.readouterr().err
    assert stat.S_IMODE(out.stat().st_mode) == 0o700


def test_a_rerun_of_certs_tightens_the_directory_and_flags_a_ca_key_among_host_files(
        tmp_path: Path, umask: int, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    out.mkdir()
    os.chmod(out, 0o755)
    stray = out / "nats-ca.key"  # where a CA key must not lie
    stray.write_text("-----BEGIN PRIVATE KEY-----\n")
    os.chmod(stray, 0o644)
    assert certs.main(["--out", str(out), "--hosts", HOSTS]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE(stray.stat().st_mode) == 0o600
    err = capsys.readouterr().err
    assert f"tightened {out} from 0755 to 0700" in err
    assert f"warning: {stray}" in err and "copied to the hosts" in err


def test_write_private_sets_the_mode_it_is_given_whatever_the_umask(tmp_path: Path,
                                                                     umask: int) -> None:
    for mode in (0o600, 0o644):
        path = certs.write_private(tmp_path / f"f{mode:o}", "x", mode)
        assert stat.S_IMODE(path.stat().st_mode) == mode
        certs.write_private(path, "y", mode)  # replacing keeps it
        assert stat.S_IMODE(path.stat().st_mode) == mode and path.read_text() == "y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f600", "f644"]  # no temp file left
