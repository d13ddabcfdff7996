"""A short bounded load against the real pdmesh mesh (tiny model), via `live_mesh`.

`live_mesh` comes from tests/conftest.py; this test skips only while that fixture does not
exist.
"""

import json

import pytest

from pdmesh.loadtest.cli import EXIT_OK, main
from pdmesh.loadtest.report import INTEGRITY_RESULT_KEYS, PDMESH_RESULT_KEYS, VLLM_RESULT_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mesh(request):
    try:
        return request.getfixturevalue("live_mesh")
    except pytest.FixtureLookupError:
        pytest.skip("the live_mesh fixture (tests/conftest.py) is not there yet")


@pytest.mark.slow
def test_bounded_load_on_the_live_mesh(mesh, tmp_path):
    argv = ["--base-url", mesh.base_url, "--api-keys", ",".join(mesh.api_keys),
            "--model", mesh.model, "--context-length", str(mesh.max_context),
            "--num-requests", "12", "--duration", "2", "--drain-timeout", "60",
            "--input-len-dist", "uniform",
            "--input-len-min", "16", "--input-len-max", "256", "--output-len", "8",
            "--over-capacity-fraction", "0.25", "--integrity", "--goodput", "e2el:60000",
            "--output-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == EXIT_OK
    result = json.loads((tmp_path / "results.json").read_text())
    declared = {*VLLM_RESULT_KEYS, *PDMESH_RESULT_KEYS, *INTEGRITY_RESULT_KEYS}
    assert not declared - set(result)
    assert result["issued"] == 12 and not result["interrupted"]
    assert result["expected_rejections"] == result["correct_rejections"] == 3
    assert result["missed_rejections"] == 0
    assert result["unexpected_rejections"] == 0
    assert result["completed"] == 9, result["errors_by_kind"]
    assert result["integrity_checked"] == 9 and result["integrity_mismatches"] == 0
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC
