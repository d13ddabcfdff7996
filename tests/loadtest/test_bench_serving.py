"""`pdmesh bench serving` end to end, at its smallest: one colocated mesh of the tiny model,
one turn, and the one JSON object carries every key it promises. No speed assertion here:
the target lives in the bench's own output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.meshproc import REPO

BENCH = [sys.executable, "-m", "pdmesh.services.ops.cli", "bench", "serving"]


@pytest.mark.slow
def test_bench_serving_reports_itl_over_step() -> None:
    res = subprocess.run([*BENCH, "--model", "tiny", "--prompt-len", "32", "--max-tokens",
                          "8", "--runs", "1", "--meshes", "colocated", "--budget-s", "120",
                          "--json"], cwd=REPO, capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["runs"] == 1 and report["output_tokens"] == 8
    assert report["step_ms"] > 0 and report["step_cpu_ms"] > 0
    assert report["itl_ms_colocated"] > 0
    assert report["itl_over_step_colocated"] == pytest.approx(
        report["itl_ms_colocated"] / report["step_ms"])
    assert report["cpu_over_step_colocated"] == pytest.approx(
        report["cpu_ms_per_token_colocated"] / report["step_cpu_ms"])
    assert report["gateway_itl_ms_colocated"] > 0
    assert len(report["itl_ms_runs_colocated"]) == 1
    assert "itl_ms_mesh" not in report
    assert report["target_itl_over_step"] == 1.2


def test_bench_serving_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from pdmesh.loadtest.bench import serving  # in this process: no torch import per case

    for args in (["--runs", "0"], ["--meshes", "gpu"], ["--max-tokens", "1"]):
        with pytest.raises(SystemExit) as exited:
            serving.main(args)
        assert exited.value.code == 2, args
        err = capsys.readouterr().err
        assert "pdmesh bench serving: error:" in err and "Traceback" not in err, (args, err)
