"""A short bounded load against the real pdmesh mesh (tiny model), via `live_mesh`.

`live_mesh` comes from tests/conftest.py; this test skips only while that fixture does not
exist.
"""

import json

import pytest

from pdmesh.loadtest.cli import EXIT_OK, main
from pdmesh.loadtest.report import INTEGRITY_RESULT_KEYS, PDMESH_RESULT_KEYS, VLLM_RESULT_KEYS

pytestmark = pytest.mark.mesh

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def mesh(request):
    try:
        return request.getfixturevalue("live_mesh")
    except pytest.FixtureLookupError:
        pytest.skip("the live_mesh fixture (tests/conftest.py) is not there yet")


@pytest.mark.slow
def test_bounded_load_on_the_live_mesh(mesh, tmp_path):
    argv = ["--base-url", mesh.base_url, "--metrics-url", mesh.metrics_url,
            "--api-keys", ",".join(mesh.api_keys),
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
    # The TTFT by phase, from the gateway's /metrics over exactly the measured requests.
    breakdown = result["ttft_breakdown"]
    assert breakdown["requests"] == 9
    by_phase = {p["phase"]: p for p in breakdown["phases"]}
    assert by_phase["admission queue"]["requests"] == 9
    assert 0 < sum(p["share_of_ttft"] or 0 for p in breakdown["phases"]) <= 1.05
    assert (tmp_path / "latency_cdf.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_sharegpt_dataset_with_ignore_eos_as_vllm_bench_serve_runs_it(mesh, tmp_path):
    """`vllm bench serve`'s spelling: --base-url without /v1, --backend, --endpoint path,
    a ShareGPT file, --ignore-eos, percentile flags; lengths counted by /tokenize."""
    records = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"Question number {i}: what comes next?"},
        {"from": "gpt", "value": "x" * (4 + i)}]} for i in range(6)]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(records))
    root = mesh.base_url.removesuffix("/v1")
    argv = ["--base-url", root, "--backend", "openai-chat", "--endpoint",
            "/v1/chat/completions", "--api-key", mesh.api_keys[0],
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--num-requests", "6", "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9",
            "--output-dir", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == EXIT_OK
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert result["completed"] == 6, result["errors_by_kind"]
    assert result["model_id"] == mesh.model  # discovered at <root>/v1/models
    assert "server /tokenize" in result["tokenizer_id"]
    assert result["backend"] == "openai-chat"
    # ignore_eos: every reply is exactly as long as its reference completion.
    by_len = sorted(result["output_lens"])
    assert by_len == [4 + i for i in range(6)]
    # The chat template wraps each prompt: the server counts more than the text's bytes.
    assert all(n > len("Question number 0: what comes next?") for n in result["input_lens"])
    for key in ("p50_ttft_ms", "p99.9_ttft_ms", "p50_e2el_ms", "p99.9_e2el_ms",
                "mean_ttft_ms", "median_e2el_ms"):
        assert key in result, key
    assert "p99_itl_ms" not in result and "mean_tpot_ms" not in result
