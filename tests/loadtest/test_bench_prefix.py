"""`pdmesh bench prefix-cache --json`: one JSON object as the last line, sane figures."""

from __future__ import annotations

import json

import pytest

from pdmesh.loadtest.bench import prefix as prefix_bench


def test_bench_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert prefix_bench.main(["--tenants", "2", "--prefix-len", "512", "--suffix-len", "32",
                              "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["tenants_measured"] >= 1
    assert report["cached_tokens_per_hit"] == 512
    assert report["computed_tokens_with_cache"] == 32
    assert report["computed_tokens_without_cache"] == 544
    assert report["cross_tenant_hit_tokens"] == 0
    assert report["first_token_logits_identical"] is True
    assert report["ttft_ratio_with_vs_without"] > 0
