"""`pdmesh soak` results never store an API key (only their number and digests' first 8 hex
characters) nor a URL password, and are written 0600 whatever the umask."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdmesh.loadtest.soak import run
from pdmesh.loadtest.soak.workload import make_tenants, tenant_name

KEYS = [f"sk-prod-{secrets.token_hex(6)}", f"sk-{secrets.token_hex(9)}", "sk-dev-alice"]
NATS_PASSWORD = "S3cretPW" + secrets.token_hex(4)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _leaks(text: str) -> list[str]:
    """Every key, or the part of a key after its last dash, found in `text`."""
    parts = {k for k in KEYS[:2]} | {k.rsplit("-", 1)[-1] for k in KEYS[:2]}
    return sorted(p for p in parts | {NATS_PASSWORD} if p in text)


def test_soak_results_hold_no_key_and_are_private(
        sse_server_factory: Callable[..., object], tmp_path: Path, umask_022: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    server = sse_server_factory(api_keys=KEYS)
    out = tmp_path / "results"
    run.main(["--base-url", server.base_url, "--api-keys", ",".join(KEYS),  # type: ignore[attr-defined]
              "--duration", "20", "--max-requests", "6", "--concurrency", "2",
              "--min-len", "16", "--max-len", "48", "--min-tokens", "2", "--max-tokens", "4",
              "--over-capacity-fraction", "0", "--abort-fraction", "0", "--fault-fraction", "0",
              "--nats-url", f"nats://tools:{NATS_PASSWORD}@127.0.0.1:1", "--pool-settle", "0.5",
              "--output-dir", str(out), "--label", "run"])
    path = out / "run.json"
    text = path.read_text()
    assert _leaks(text) == []
    printed = capsys.readouterr()
    assert _leaks(printed.out + printed.err) == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    result = json.loads(text)
    assert result["issued"] == 6
    assert result["config"]["api_keys"] == {
        "count": 3, "sha256_prefixes": [hashlib.sha256(k.encode()).hexdigest()[:8]
                                        for k in KEYS]}
    assert result["config"]["nats_url"] == "nats://tools:***@127.0.0.1:1"
    assert set(result["tenants"]) == {"t0", "t1", "alice"}


def test_a_tenant_is_named_after_a_dev_key_only() -> None:
    assert tenant_name("sk-dev-alice", 0) == "alice"
    for i, key in enumerate(KEYS[:2] + ["k", "sk-dev-9f8a7b6c", "sk-dev-Zq"]):
        assert tenant_name(key, i) == f"t{i}"
    assert [t.name for t in make_tenants(["sk-dev-k", "sk-dev-k"], 0)] == ["k", "k1"]


def test_write_results_is_0600_even_over_an_open_file(tmp_path: Path, umask_022: None) -> None:
    path = tmp_path / "out" / "r.json"
    path.parent.mkdir()
    (path.parent / "r.json.tmp").write_text("left over")
    (path.parent / "r.json.tmp").chmod(0o666)
    run.write_results(path, {"url": f"nats://u:{NATS_PASSWORD}@h", "n": [1, 2.5, None]})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"url": "nats://u:***@h", "n": [1, 2.5, None]}
    assert not (path.parent / "r.json.tmp").exists()


def test_public_config_keeps_counts_and_digest_prefixes_only() -> None:
    args = argparse.Namespace(api_keys=",".join(KEYS), seed=3)
    config = run.public_config(args)
    assert config["seed"] == 3 and config["api_keys"]["count"] == len(KEYS)
    assert all(len(p) == 8 for p in config["api_keys"]["sha256_prefixes"])
    assert _leaks(json.dumps(config)) == []
