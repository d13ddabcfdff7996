"""loadtest/store_eval.py (the tier-3 store comparison) runs and reports: its Redis part
measures a real redis-server, its Mooncake part either measures or says why it could not
(figures are reported, never asserted)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO

SCRIPT = REPO / "loadtest" / "store_eval.py"
SMALL = ["--count", "2", "--sizes-mib", "1,2", "--latency-gets", "5", "--idle-s", "0.1"]


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALL, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_the_redis_part_measures_a_real_server() -> None:
    got = _run("--only", "redis")["redis"]
    assert got["ran"], got
    assert set(got["bandwidth"]) == {"1MiB", "2MiB"}
    for sizes in got["bandwidth"].values():
        assert sizes["put_gib_s"] > 0 and sizes["get_gib_s"] > 0
    assert got["get_1mib_ms"]["n"] == 5 and got["get_1mib_ms"]["p50"] > 0
    assert "hiredis" in got["version"]  # the project's redis client parses in C
    assert got["idle"]["rss_mib"] > 0


def test_a_mooncake_part_that_cannot_run_says_why() -> None:
    got = _run("--only", "mooncake", "--mooncake-python", "/nonexistent/python")["mooncake"]
    assert got["ran"] is False
    assert "/nonexistent/python" in got["reason"]
