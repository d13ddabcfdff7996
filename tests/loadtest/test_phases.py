"""`pdmesh loadtest`'s TTFT breakdown: parsed from a real GatewayMetrics exposition, as the
difference of two scrapes (so what happened before the run does not count)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

from pdmesh.gateway.metrics import GatewayMetrics
from pdmesh.loadtest import phases
from pdmesh.services.protocol import messages as m


def _observe(metrics: GatewayMetrics, ttft: float, timing: m.PhaseTiming,
             queue_s: float, first_token_s: float) -> None:
    metrics.ttft.labels("tiny", "alice").observe(ttft)
    metrics.queue_time.labels("tiny").observe(queue_s)
    metrics.observe_phases(timing)
    metrics.decode_first_token.labels("tiny").observe(first_token_s)


def test_breakdown_is_the_mean_of_each_phase_between_two_scrapes() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, "tiny")
    # Before the run: one slow request that must not count.
    _observe(metrics, 100.0, m.PhaseTiming(request_id="old", queue_s=50, prefill_s=40,
                                           transfer_s=9, exposed_transfer_s=9), 1.0, 0.5)
    before = phases.parse(generate_latest(registry).decode())
    for _ in range(4):  # the run: ttft 1.0 = 0.05 + 0.1 + 0.6 + 0.05 + 0.02 + rest 0.18
        _observe(metrics, 1.0, m.PhaseTiming(request_id="r", queue_s=0.1, prefill_s=0.6,
                                             transfer_s=0.2, exposed_transfer_s=0.05),
                 0.05, 0.02)
    after = phases.parse(generate_latest(registry).decode())
    b = phases.breakdown(before, after)
    assert b is not None
    assert b["requests"] == 4 and math.isclose(b["mean_ttft_ms"], 1000.0)
    means = {p["phase"]: p["mean_ms"] for p in b["phases"]}
    expected = {"admission queue": 50, "prefill queue": 100, "prefill compute": 600,
                "KV transfer (exposed)": 50, "decode first token": 20,
                "rest (HTTP, NATS, stream)": 180}
    assert means.keys() == expected.keys()
    for phase, ms in expected.items():
        assert math.isclose(means[phase], ms, abs_tol=1e-6), phase
    assert math.isclose(sum(p["share_of_ttft"] for p in b["phases"]), 1.0)
    assert math.isclose(b["exposed_transfer_share"], 0.25)
    rows = dict(phases.format_breakdown(b))
    assert rows["  prefill compute"] == "600.0 ms (60%)"
    assert rows["  KV transfer exposed / whole"] == "25% of 200.0 ms"


def test_no_breakdown_without_pdmesh_series_or_requests() -> None:
    assert phases.parse("# a vLLM server\nvllm:num_requests_running 0\n") == {}
    assert phases.breakdown(None, None) is None
    registry = CollectorRegistry()
    GatewayMetrics(registry, "tiny").ttft.labels("tiny", "alice")
    same = phases.parse(generate_latest(registry).decode())
    assert phases.breakdown(same, same) is None  # no request in between


def test_summary_prints_the_breakdown_rows() -> None:
    b = {"requests": 2, "mean_ttft_ms": 10.0, "mean_kv_transfer_ms": None,
         "exposed_transfer_share": None,
         "phases": [{"phase": "prefill compute", "mean_ms": 8.0, "share_of_ttft": 0.8}]}
    rows = phases.format_breakdown(b)
    assert ("  prefill compute", "8.0 ms (80%)") in rows
    assert ("  KV transfer exposed / whole", "-") in rows


async def test_a_fresh_gateway_is_scraped_so_the_first_run_gets_a_breakdown() -> None:
    # Regression: a gateway that had served nothing yet has no TTFT sample (its series
    # carry a tenant label), so the "before" scrape was taken for a server without pdmesh
    # series and the first `pdmesh loadtest` against a fresh mesh printed no breakdown.
    import aiohttp
    from aiohttp import web

    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, "tiny")

    async def serve(_request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as session:
            before = await phases.scrape(session, f"http://127.0.0.1:{port}/metrics")
            assert before is not None  # a pdmesh gateway, nothing observed yet
            _observe(metrics, 2.0, m.PhaseTiming(request_id="r", queue_s=0.1, prefill_s=1.5,
                                                 transfer_s=0.4, exposed_transfer_s=0.1),
                     0.05, 0.01)
            after = await phases.scrape(session, f"http://127.0.0.1:{port}/metrics")
        got = phases.breakdown(before, after)
        assert got is not None
    finally:
        await runner.cleanup()
