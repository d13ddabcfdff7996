"""`pdmesh bench disagg` end to end, at its smallest: the meshes start, the same prompts
go to each, and the one JSON object carries every figure it promises. No speed assertion
here: the targets live in the bench's own output. The whole run is in `make test-long`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                    reason="two meshes benchmarked: make test-long")
def test_bench_disagg_reports_ratio_and_medians_for_each_length() -> None:
    res = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench", "disagg",
                          "--models", "tiny", "--lengths", "64,600", "--runs", "1",
                          "--budget-s", "300", "--tracing", "--json"], cwd=REPO,
                         capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["skipped"] == []
    for key in ("tiny_64", "tiny_600"):
        assert report[f"ttft_s_{key}_mesh"] > 0 and report[f"ttft_s_{key}_colocated"] > 0
        assert report[f"ttft_ratio_best_{key}"] > 0
        assert report[f"ttft_ratio_{key}"] == pytest.approx(
            report[f"ttft_s_{key}_mesh"] / report[f"ttft_s_{key}_colocated"])
        share = report[f"exposed_transfer_share_{key}"]
        assert share is None or share >= 0
    for side in ("mesh", "colocated"):  # a 600-token prefill takes CPU on either side
        assert report[f"cpu_s_tiny_600_{side}"] > 0
    assert report["cpu_ratio_tiny_600"] == pytest.approx(
        report["cpu_s_tiny_600_mesh"] / report["cpu_s_tiny_600_colocated"])
    assert report["prompt_tokens_tiny_600"] == 600
    # --tracing: the traced mesh took its turns and exported its spans to the bench's sink.
    for key in ("tiny_64", "tiny_600"):
        assert report[f"tracing_ttft_ratio_{key}"] == pytest.approx(
            report[f"ttft_s_{key}_traced"] / report[f"ttft_s_{key}_mesh"])
    assert report["otlp_exports"] > 0 and report["otlp_export_bytes"] > 0
    assert report["target_ttft_ratio"] == 1.05


def test_bench_disagg_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from pdmesh.loadtest.bench import disagg  # in this process: no torch import per case

    for args in (["--models", "gpt5"], ["--runs", "0"], ["--lengths", "abc"]):
        with pytest.raises(SystemExit) as exited:
            disagg.main(args)
        assert exited.value.code == 2, args
        err = capsys.readouterr().err
        assert "pdmesh bench disagg: error:" in err and "Traceback" not in err, (args, err)
