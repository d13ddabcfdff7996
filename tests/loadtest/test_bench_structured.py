"""`pdmesh bench structured` at its smallest: the one JSON object carries every figure it
promises. No speed assertion here: the target lives in the bench's own output."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.meshproc import REPO


def test_bench_structured_reports_mask_cost_and_step_ratio() -> None:
    res = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench",
                          "structured", "--model", "tiny", "--steps", "4", "--batch", "4",
                          "--mask-tokens", "40", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["mask_us_median"] > 0 and report["mask_us_p99"] >= report["mask_us_median"]
    assert report["step_ms_unconstrained_b4"] > 0 and report["step_ms_one_constrained_b4"] > 0
    assert report["step_ratio_one_constrained"] == (
        report["step_ms_one_constrained_b4"] / report["step_ms_unconstrained_b4"])
    assert report["vocab_size"] == 258


def test_bench_structured_refuses_bad_arguments() -> None:
    res = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench",
                          "structured", "--batch", "1"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
