"""The benchmarks run and print their JSON (figures are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO

pytestmark = pytest.mark.slow


def _json_last_line(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench", *args,
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_engine_json() -> None:
    got = _json_last_line("engine", "--prompt-len", "256", "--context-len", "64", "--steps",
                          "4")
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s_b1", "decode_tokens_per_s_b16",
                "paged_vs_contiguous_b1", "paged_vs_contiguous_b16",
                "lease_check_pct_of_step_b16", "dense_forward_ms_b1", "dense_forward_ms_b16",
                "weights_stream_ms", "decode_vs_dense_b1", "decode_vs_dense_b16",
                "prefill_vs_dense", "dense_prefill_attention_ms", "prefill_vs_matmuls",
                "decode_weights_mb", "decode_floor_ms", "decode_vs_floor_b1"):
        assert got[key] > 0, key
    assert got["device"] == "cpu" and got["dtype"] == "float32"
    assert got["native_decode_attention"] is True  # it builds on this machine
    assert got["native_decode_linear"] is True
    assert "decode_step_q_ms_b1" not in got  # tiny has no quantized blocks


def test_bench_transport_json() -> None:
    got = _json_last_line("transport", "--kinds", "tcp", "--repeat", "1", "--budget-s", "5")
    rows = got["results"]
    assert [r["mib"] for r in rows] == [1, 16, 64]
    assert all(r["transport_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    assert got["load_avg_1m"] >= 0 and got["cpus"] > 0


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not importable")
def test_bench_transport_ucx_json_has_the_native_perftest() -> None:
    """ucx rows carry the native `ucx_perftest -t tag_bw` figure of the same run, and their
    GB/s over tcp's at the same size (the kinds take turns at each size)."""
    got = _json_last_line("transport", "--kinds", "tcp,ucx", "--repeat", "1",
                          "--budget-s", "5")
    rows = [r for r in got["results"] if r["transport"] == "ucx"]
    tcp = {r["mib"]: r for r in got["results"] if r["transport"] == "tcp"}
    assert [r["mib"] for r in rows] == [1, 16, 64] and sorted(tcp) == [1, 16, 64]
    assert [r["transport"] for r in got["results"]] == ["tcp", "ucx"] * 3
    assert not any("vs_tcp" in r for r in tcp.values())
    for r in rows:
        assert r["vs_tcp"] == pytest.approx(r["transport_gbps"] / tcp[r["mib"]]["transport_gbps"])
        assert r["transport_gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] > 0
        assert r["perftest_gbps"] > 0, "ucx_perftest from the libucx wheel did not run"
        assert r["vs_perftest"] == pytest.approx(r["transport_gbps"] / r["perftest_gbps"])
        assert r["perftest_errh_gbps"] > 0, "ucx_perftest -e did not run"
        assert r["vs_perftest_errh"] == pytest.approx(r["transport_gbps"]
                                                      / r["perftest_errh_gbps"])


def test_bench_prefix_cache_json() -> None:
    got = _json_last_line("prefix-cache", "--prefix-len", "1024")
    assert got["cross_tenant_hit_tokens"] == 0
    assert got["first_token_logits_identical"] is True
    assert got["ttft_s_with_cache"] > 0 and got["ttft_s_without_cache"] > 0
