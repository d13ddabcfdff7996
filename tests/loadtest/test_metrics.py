"""Percentiles, goodput and rejection accounting on hand-made results."""

import numpy as np
import pytest

from pdmesh.loadtest.client import RequestResult
from pdmesh.loadtest.metrics import (
    compute_metrics,
    meets_slos,
    parse_goodput,
    rejection_accounting,
    summarize_ms,
)


def _ok(index, ttft=0.1, e2el=1.0, tokens=11, **kw):
    r = RequestResult(index=index, tenant=0, prompt_len=100, max_tokens=tokens, success=True,
                      status=200, ttft_s=ttft, e2el_s=e2el, output_tokens=tokens,
                      itls_s=[(e2el - ttft) / max(tokens - 1, 1)] * (tokens - 1),
                      generated_text="x" * tokens, **kw)
    return r


def _failed(index, status, expect_reject=False, kind=None, **kw):
    r = RequestResult(index=index, tenant=0, prompt_len=600, max_tokens=8, status=status,
                      expect_reject=expect_reject, **kw)
    return r.fail(kind or f"http_{status}", "nope")


def test_summary_matches_numpy():
    values = [0.001 * x for x in range(1, 101)]
    stats = summarize_ms(values)
    ms = np.array(values) * 1000
    assert stats["mean"] == pytest.approx(ms.mean())
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(np.percentile(ms, 90))
    assert stats["p99"] == pytest.approx(99.01)
    assert stats["std"] == pytest.approx(ms.std())
    assert summarize_ms([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:3000"]) == {
        "ttft": 500.0, "tpot": 50.0, "e2el": 3000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:abc"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_slo_check_uses_ttft_tpot_and_e2el():
    r = _ok(0, ttft=0.2, e2el=1.2, tokens=11)  # TPOT = 100 ms
    assert meets_slos(r, {"ttft": 200, "tpot": 100, "e2el": 1200})
    assert not meets_slos(r, {"ttft": 199})
    assert not meets_slos(r, {"tpot": 99})
    assert not meets_slos(_failed(1, 500), {"ttft": 1e9})


def test_rejection_accounting_counts_each_case():
    results = [
        _ok(0),
        _failed(1, 400, expect_reject=True),  # correct
        _ok(2, expect_reject=True),  # missed: the incident's failure mode
        _failed(3, 500, expect_reject=True),  # misreported
        _failed(4, 400),  # unexpected: a valid prompt got a 4xx
        _failed(5, 429),  # unexpected too
        _failed(6, None, kind="timeout"),  # an error, not a rejection
        _failed(7, None, expect_reject=True, kind="cancelled"),  # not counted
    ]
    assert rejection_accounting(results) == {
        "expected_rejections": 3, "correct_rejections": 1, "missed_rejections": 1,
        "misreported_rejections": 1, "unexpected_rejections": 2, "throttled_requests": 1}


def test_compute_metrics_fields_and_goodput():
    results = [_ok(0, ttft=0.1, e2el=1.1), _ok(1, ttft=0.3, e2el=1.3),
               _failed(2, 400, expect_reject=True), _ok(3, warmup=True, ttft=9.0)]
    m = compute_metrics(results, duration_s=2.0, slos_ms={"ttft": 200})
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["request_goodput"] == pytest.approx(0.5)  # one good request in 2 s
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["total_output_tokens"] == 22
    assert m["output_throughput"] == pytest.approx(11.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["ttfts"] == [0.1, 0.3, 0.0]  # warm-up excluded, failed as 0
    assert m["errors"][:2] == ["", ""] and m["errors"][2]
    assert m["errors_by_kind"] == {"http_400": 1}
    assert m["correct_rejections"] == 1 and m["missed_rejections"] == 0
    assert compute_metrics(results, 2.0)["request_goodput"] is None
