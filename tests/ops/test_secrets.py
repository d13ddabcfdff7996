"""`pdmesh secrets`: one key file per holder, kept across reruns, the verify key always the
signing key's."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdmesh.services.ops import natsauth
from pdmesh.services.protocol import tickets

FILES = {"signing.env": "PDMESH_SIGNING_KEY", "verify.env": "PDMESH_VERIFY_KEY",
         "salt.env": "PDMESH_SALT_KEY", "kvtier.env": "PDMESH_KV_TIER_KEY"}


def _read(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def test_secrets_writes_one_key_file_per_holder(tmp_path: Path) -> None:
    assert natsauth.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "mesh.env").exists()
    keys = {}
    for name, var in FILES.items():
        env = _read(tmp_path / name)
        assert list(env) == [var], name  # each file holds its one key and nothing else
        assert tickets.key_problem(env[var]) is None
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
        keys[var] = env[var]
    assert keys["PDMESH_VERIFY_KEY"] == tickets.verify_key_of(keys["PDMESH_SIGNING_KEY"])
    assert len(set(keys.values())) == 4
    # The files say who mounts them (compose: env_file): every role mounts one, and prefill
    # workers the KV-tier key besides.
    holders = [r for _, roles in natsauth.KEY_FILES.values() for r in roles]
    assert sorted(holders) == sorted([*natsauth.ROLES, "prefill"])
    assert natsauth.KEY_FILES["kvtier.env"] == ("PDMESH_KV_TIER_KEY", ("prefill",))
    assert natsauth.KEY_FILES["signing.env"] == ("PDMESH_SIGNING_KEY", ("admission",))


def test_secrets_keeps_existing_keys_and_derives_the_verify_key(tmp_path: Path) -> None:
    signing, salt = tickets.generate_signing_key(), "5a" * 32
    (tmp_path / "signing.env").write_text(f"PDMESH_SIGNING_KEY={signing}\n")
    salt_text = f"# shared by every host\nPDMESH_SALT_KEY={salt}\n"
    (tmp_path / "salt.env").write_text(salt_text)
    (tmp_path / "verify.env").write_text(f"PDMESH_VERIFY_KEY={'00' * 32}\n")  # stale
    written = natsauth.write_secrets(tmp_path)
    assert _read(tmp_path / "signing.env") == {"PDMESH_SIGNING_KEY": signing}
    assert (tmp_path / "salt.env").read_text() == salt_text
    assert _read(tmp_path / "verify.env") == {
        "PDMESH_VERIFY_KEY": tickets.verify_key_of(signing)}
    assert tmp_path / "verify.env" in written
    assert tmp_path / "signing.env" not in written and tmp_path / "salt.env" not in written
    # Rerun: nothing about the keys changes.
    again = natsauth.write_secrets(tmp_path)
    assert not {tmp_path / n for n in FILES} & set(again)


@pytest.mark.parametrize("name,text", [
    ("signing.env", "PDMESH_SIGNING_KEY=not-a-key\n"),
    ("signing.env", "PDMESH_MESH_SECRET=old\n"),
    ("salt.env", "PDMESH_SALT_KEY=" + "ab" * 31 + "\n"),
    ("kvtier.env", "PDMESH_KV_TIER_KEY=xyz\n"),
])
def test_a_malformed_kept_key_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    assert natsauth.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdmesh secrets: ") and name in err and "Traceback" not in err
    assert not (tmp_path / "nats.conf").exists()  # nothing written
