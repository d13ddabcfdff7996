"""`pdmesh loadtest` end to end against the OpenAI-style SSE TEST DOUBLE (conftest.py).

These check the load tester's own accounting, files and exit codes; the double is not
pdmesh. The run against the real mesh is test_live_mesh.py.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdmesh.loadtest.cli import EXIT_CORRECTNESS, EXIT_INTERRUPTED, EXIT_OK, main
from pdmesh.loadtest.report import INTEGRITY_RESULT_KEYS, PDMESH_RESULT_KEYS, VLLM_RESULT_KEYS

VLLM_KEYS = [
    "date", "backend", "model_id", "num_prompts", "request_rate", "burstiness",
    "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "errors", "generated_texts",
    *[f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p90", "p99")],
]
PDMESH_KEYS = ["errors_by_kind", "expected_rejections", "correct_rejections",
               "unexpected_rejections", "missed_rejections", "integrity_mismatches"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _argv(double, out: Path, *extra: str) -> list[str]:
    # The request count bounds these runs; the duration only guards against a hang (a
    # short one cut issuing short when the machine paused the loop for two seconds).
    return ["--base-url", double.base_url, "--api-keys", ",".join(double.api_keys),
            "--num-requests", "12", "--duration", "60", "--drain-timeout", "5",
            "--input-len-dist", "uniform", "--input-len-min", "50", "--input-len-max", "300",
            "--output-len", "16", "--over-capacity-fraction", "0.25",
            "--output-dir", str(out), "--no-progress", *extra]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_bounded_load_accounting_and_files(sse_server, tmp_path):
    rc = main(_argv(sse_server, tmp_path, "--warmup-requests", "2", "--max-concurrency", "4",
                    "--goodput", "ttft:500", "e2el:3000", "--integrity"))
    assert rc == EXIT_OK
    result = _load(tmp_path / "results.json")
    assert not [k for k in VLLM_KEYS + PDMESH_KEYS if k not in result]
    declared = {*VLLM_RESULT_KEYS, *PDMESH_RESULT_KEYS, *INTEGRITY_RESULT_KEYS}
    assert set(VLLM_KEYS) <= set(VLLM_RESULT_KEYS)
    assert declared <= set(result)
    assert result["num_prompts"] == 12 and len(result["ttfts"]) == 12
    assert result["model_id"] == sse_server.model  # discovered from GET /models
    assert result["context_length"] == sse_server.max_context
    assert result["expected_rejections"] == result["correct_rejections"] == 3
    assert result["missed_rejections"] == result["unexpected_rejections"] == 0
    assert result["completed"] == 9 and result["errors_by_kind"] == {"http_400": 3}
    assert result["request_goodput"] == result["request_throughput"]
    assert result["integrity_checked"] == 9 and result["integrity_mismatches"] == 0
    assert _load(tmp_path / "integrity_mismatches.json") == []
    assert sse_server.tenants_seen == set(sse_server.api_keys)
    # 2 warm-up + 9 integrity references + 12 measured
    assert sse_server.requests_seen == 23
    for png in ("latency_cdf.png", "ttft_vs_prompt_len.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_MAGIC


def test_missed_rejections_fail_the_run(sse_server_factory, tmp_path):
    leaky = sse_server_factory(miss_rejections=True)
    assert main(_argv(leaky, tmp_path)) == EXIT_CORRECTNESS
    result = _load(tmp_path / "results.json")
    assert result["expected_rejections"] == result["missed_rejections"] == 3
    assert result["correct_rejections"] == 0


def test_integrity_mismatches_are_counted_and_saved(sse_server_factory, tmp_path):
    corrupt = sse_server_factory(corrupt_when_concurrent=True, token_delay_s=0.005)
    rc = main(_argv(corrupt, tmp_path, "--integrity", "--max-concurrency", "9"))
    assert rc == EXIT_CORRECTNESS
    result = _load(tmp_path / "results.json")
    mismatches = _load(tmp_path / "integrity_mismatches.json")
    assert result["integrity_mismatches"] == len(mismatches) > 0
    assert {"index", "tenant", "prompt_sha256", "expected_text", "loaded_text"} <= set(
        mismatches[0])
    assert mismatches[0]["expected_text"] != mismatches[0]["loaded_text"]


def test_compare_prints_side_by_side_ratios(sse_server_factory, tmp_path, capsys):
    mesh = sse_server_factory(token_delay_s=0.02)
    colocated = sse_server_factory(token_delay_s=0.002)
    rc = main(_argv(mesh, tmp_path, "--compare-base-url", colocated.base_url))
    assert rc == EXIT_OK
    comp = _load(tmp_path / "comparison.json")
    assert comp["labels"] == ["mesh", "colocated"]
    # Each ratio is mesh / colocated of the two runs' own figures (not a timing verdict:
    # their direction is at the mercy of the machine's load).
    mesh_run = _load(tmp_path / "results.json")
    colocated_run = _load(tmp_path / "results-compare.json")
    for ratio, key in (("ttft_ratio", "mean_ttft_ms"), ("output_throughput_ratio",
                                                       "output_throughput")):
        assert comp[ratio] == pytest.approx(mesh_run[key] / colocated_run[key])
        assert comp["rows"][key] == {"mesh": mesh_run[key], "colocated": colocated_run[key],
                                     "ratio": comp[ratio]}
    assert comp["outputs_compared"] == 9 and comp["output_mismatches"] == 0
    assert _load(tmp_path / "results-compare.json")["label"] == "colocated"
    out = capsys.readouterr().out
    assert "Mean TTFT (ms)" in out and "ratio" in out
    # same workload, same seed: both servers got the same prompts
    assert mesh.requests_seen == colocated.requests_seen == 12


def test_sigint_saves_partial_results(sse_server_factory, tmp_path):
    slow = sse_server_factory(token_delay_s=0.5)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest",
         *_argv(slow, tmp_path, "--max-concurrency", "2", "--cancel-grace", "0.2")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while slow.requests_seen < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, stderr.decode()
    result = _load(tmp_path / "results.json")
    assert result["interrupted"] and result["issued"] < 12
    assert "cancelled" in result["errors_by_kind"]
    assert (tmp_path / "latency_cdf.png").exists()
