"""`pdmesh check` logic as pure functions: rows, verdict/exit code, formatting, JSON; plus the
admission bench's statistics helpers."""

from __future__ import annotations

import json
import math

from pdmesh.loadtest import check
from pdmesh.loadtest.bench import admission as bench
from pdmesh.services.protocol import messages as m


def beat(worker_id: str, role: m.Role = m.Role.DECODE, *, configured: int = 4096,
         pool: int = 4096, served: int | None = None, flagged: bool | None = None,
         data_address: str = "", **kw: object) -> m.Heartbeat:
    served = min(configured, pool) if served is None else served
    data_address = data_address or f"tcp://127.0.0.1:{abs(hash(worker_id)) % 60000}"
    flagged = configured > pool if flagged is None else flagged
    return m.Heartbeat(worker_id=worker_id, role=role, model="tiny", configured_context=configured,
                       pool_capacity_tokens=pool, served_context=served,
                       capacity_mismatch=flagged, available_tokens=pool, page_tokens=16,
                       data_address=data_address, **kw)


def rows(*beats: m.Heartbeat) -> list[check.WorkerRow]:
    col = check.Collector()
    for b in beats:
        col.observe(b)
    return col.sorted_rows()


def test_healthy_mesh_exits_0() -> None:
    v = check.verdict(rows(beat("p1", m.Role.PREFILL), beat("d1")))
    assert v.code == check.EXIT_OK and not v.problems
    assert "1 prefill, 1 decode" in v.message


def test_clamped_worker_exits_1_and_is_loud() -> None:
    r = rows(beat("p1", m.Role.PREFILL, configured=16384, pool=4096), beat("d1"))
    v = check.verdict(r)
    assert v.code == check.EXIT_PROBLEM
    assert len(v.problems) == 1 and "p1" in v.problems[0] and "CLAMPED" in v.problems[0]
    text = check.format_report(r, v)
    assert "!! CLAMPED !!" in text
    assert "!! CAPACITY CHECK: p1: configured context 16384 > real pool 4096" in text
    assert text.splitlines()[-1].startswith("pdmesh check: PROBLEM")


def test_mismatch_detected_even_when_worker_did_not_flag_it() -> None:
    r = rows(beat("p1", m.Role.PREFILL), beat("d1", configured=16384, pool=4096, flagged=False))
    assert r[1].mismatch and r[1].mismatch_label == "CLAMPED"
    assert check.verdict(r).code == check.EXIT_PROBLEM


def test_serving_more_than_the_pool_is_over_pool() -> None:
    r = rows(beat("p1", m.Role.PREFILL),
             beat("d1", configured=16384, pool=4096, served=16384, flagged=False))
    assert r[1].over_pool and r[1].mismatch_label == "OVER POOL"
    v = check.verdict(r)
    assert v.code == check.EXIT_PROBLEM and "NOT clamped" in v.problems[0]


def test_no_worker_or_missing_role_exits_2() -> None:
    assert check.verdict([]).code == check.EXIT_UNREACHABLE
    v = check.verdict(rows(beat("d1"), beat("d2")))
    assert v.code == check.EXIT_UNREACHABLE and "no prefill worker" in v.message
    # A mismatch outranks a missing role: it is the louder problem.
    assert check.verdict(rows(beat("d1", configured=9000, pool=4096))).code == 1


def test_integrity_failure_exits_1() -> None:
    r = rows(beat("p1", m.Role.PREFILL), beat("d1"))
    r[1].stats = m.StatsReply(worker_id="d1", role=m.Role.DECODE, integrity_ok=False,
                              integrity_error="page 3 leased twice", total_pages=256)
    v = check.verdict(r)
    assert v.code == check.EXIT_PROBLEM and "page 3 leased twice" in v.problems[0]
    assert "!! FAILED: page 3 leased twice !!" in check.format_report(r, v, with_stats=True)


def test_collector_keeps_latest_beat_per_worker_and_ignores_other_roles() -> None:
    col = check.Collector()
    col.observe(beat("d1", configured=4096, pool=4096), now=1.0)
    col.observe(beat("d1", configured=4096, pool=4096, queue_depth=7), now=2.0)
    col.observe(m.Heartbeat(worker_id="gw", role=m.Role.GATEWAY, model="tiny"))
    col.observe(beat("p1", m.Role.PREFILL), now=2.0)
    r = col.sorted_rows()
    assert [x.beat.worker_id for x in r] == ["p1", "d1"]  # prefill first
    assert r[1].beats_seen == 2 and r[1].beat.queue_depth == 7 and r[1].last_seen == 2.0


def test_table_has_every_column_and_one_row_per_worker() -> None:
    r = rows(beat("p1", m.Role.PREFILL, configured=16384, pool=2048),
             beat("d1", configured=16384, pool=4096, draining=True))
    text = check.format_report(r, check.verdict(r), with_stats=True)
    lines = text.splitlines()
    for col in check.COLUMNS:
        assert col in lines[0]
    assert lines[2].split()[:6] == ["prefill", "p1", "tiny", "16384", "2048", "2048"]
    assert lines[3].split()[:3] == ["decode", "d1", "(draining)"]
    assert "tcp://127.0.0.1:" in lines[2]
    assert "not asked" in text  # stats table present, no stats collected


def test_json_report_shape() -> None:
    r = rows(beat("p1", m.Role.PREFILL, configured=16384, pool=4096), beat("d1"))
    v = check.verdict(r)
    out = json.loads(json.dumps(check.report_json(r, v, nats_url="nats://x:1", listen_s=2)))
    assert out["exit_code"] == 1 and out["ok"] is False
    assert out["counts"] == {"prefill": 1, "decode": 1}
    assert out["mismatches"] == ["p1"]
    w = out["workers"][0]
    assert (w["configured_context"], w["pool_capacity_tokens"], w["served_context"]) == (
        16384, 4096, 4096)
    assert w["mismatch"] == "CLAMPED" and w["capacity_mismatch"] is True
    assert {"free_tokens", "queue_depth", "data_address", "model", "role"} <= set(w)


def test_main_unreachable_nats_is_one_line_and_exit_2(capsys) -> None:
    code = check.main(["--nats-url", "nats://127.0.0.1:1", "--connect-timeout-s", "0.5",
                       "--json"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and "unreachable" in err and "Traceback" not in err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2


# -- bench statistics -------------------------------------------------------------------
def test_percentile_and_summary() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert bench.percentile(xs, 50) == 50.5
    assert bench.percentile(xs, 0) == 1 and bench.percentile(xs, 100) == 100
    assert math.isnan(bench.percentile([], 50))
    s = bench.summary_ms([0.001, 0.002, 0.003])
    assert s["n"] == 3 and s["median_ms"] == 2.0 and s["max_ms"] == 3.0


def test_histogram_quantile_like_prometheus() -> None:
    buckets = [(0.001, 50.0), (0.002, 90.0), (0.005, 100.0), (math.inf, 100.0)]
    assert math.isclose(bench.histogram_quantile(0.5, buckets), 0.001)
    assert math.isclose(bench.histogram_quantile(0.7, buckets), 0.0015)
    assert math.isclose(bench.histogram_quantile(0.95, buckets), 0.0035)
    assert math.isnan(bench.histogram_quantile(0.5, [(math.inf, 0.0)]))
    before = [(0.001, 10.0), (math.inf, 10.0)]
    assert bench.diff_buckets([(0.001, 15.0), (math.inf, 20.0)], before) == [
        (0.001, 5.0), (math.inf, 10.0)]


def test_parse_histogram_from_metrics_text() -> None:
    text = "\n".join([
        "# HELP h Time", "# TYPE h histogram",
        'h_bucket{le="0.001",outcome="rejected"} 3.0',
        'h_bucket{le="+Inf",outcome="rejected"} 4.0',
        'h_bucket{le="0.001",outcome="admitted"} 1.0',
        'h_bucket{le="+Inf",outcome="admitted"} 1.0',
        'h_count{outcome="rejected"} 4.0', 'h_sum{outcome="rejected"} 0.003', ""])
    assert bench.parse_histogram(text, "h", {"outcome": "rejected"}) == [
        (0.001, 3.0), (math.inf, 4.0)]


def test_bench_cases_are_all_static_rejections() -> None:
    """Every bench request must be refused by a static limit: none may reach a worker."""
    from pdmesh.services.admission.policy import Rejected, WorkerView, decide

    pre = WorkerView("p", bench.PREFILL_POOL, bench.PREFILL_POOL, bench.PAGE_TOKENS,
                     bench.PREFILL_POOL)
    dec = WorkerView("d", bench.DECODE_POOL, bench.DECODE_POOL, bench.PAGE_TOKENS,
                     bench.DECODE_POOL)
    for case in bench.CASES:
        got = decide(case.prompt_len, case.max_tokens, [pre], [dec])
        assert isinstance(got, Rejected) and got.reason is case.expect, case
    got = decide(bench.NO_WORKERS.prompt_len, bench.NO_WORKERS.max_tokens, [], [])
    assert isinstance(got, Rejected) and got.reason is m.Code.NO_WORKERS


# -- data-plane reachability ---------------------------------------------------------------
def test_address_problems_peers_cannot_use() -> None:
    routable = ["tcp://10.0.0.12:4000"]
    assert check.address_problem("tcp://10.0.0.11:4000", routable) == ""
    assert check.address_problem("ucx://10.0.0.11:4000", routable) == ""
    assert "wildcard" in check.address_problem("tcp://0.0.0.0:4000", routable)
    assert "wildcard" in check.address_problem("tcp://[::]:4000", [])
    assert "loopback" in check.address_problem("tcp://127.0.0.1:4000", routable)
    assert "loopback" in check.address_problem("ucx://localhost:4000", routable)
    # One host, everything on loopback (`pdmesh up`): nothing wrong.
    assert check.address_problem("tcp://127.0.0.1:4000", ["tcp://127.0.0.1:4001"]) == ""
    assert "no data address" in check.address_problem("", routable)
    assert "host:port" in check.address_problem("10.0.0.1:4000", routable)
    assert "host:port" in check.address_problem("tcp://10.0.0.1:http", routable)


def test_loopback_among_routable_addresses_exits_1() -> None:
    r = rows(beat("p1", m.Role.PREFILL, data_address="tcp://10.0.0.11:4000"),
             beat("d1", data_address="tcp://127.0.0.1:4001"))
    v = check.verdict(r)
    assert v.code == check.EXIT_PROBLEM
    assert len(v.problems) == 1
    assert v.problems[0].startswith("d1: data plane: loopback address tcp://127.0.0.1:4001")
    assert "!! DATA PLANE: d1: data plane: loopback" in check.format_report(r, v)


def test_unreachable_data_plane_exits_1_and_is_loud() -> None:
    r = rows(beat("p1", m.Role.PREFILL), beat("d1"))
    r[0].reach = check.Reach(True, connect_ms=0.2, from_host="h2")
    r[1].reach = check.Reach(False, "ConnectionRefusedError: refused", from_host="h2")
    v = check.verdict(r)
    assert v.code == check.EXIT_PROBLEM
    assert v.problems == [f"d1: data plane {r[1].beat.data_address} unreachable from h2: "
                          "ConnectionRefusedError: refused"]
    text = check.format_report(r, v)
    assert "!! UNREACHABLE: ConnectionRefusedError: refused !!" in text
    assert "ok 0.2 ms" in text and "reach: each data plane dialled from h2" in text
    report = check.report_json(r, v, nats_url="nats://x:4222", listen_s=1)
    assert report["unreachable"] == ["d1"]
    assert report["workers"][1]["data_plane"] == {
        "reachable": False, "error": "ConnectionRefusedError: refused", "connect_ms": 0.0,
        "from_host": "h2"}
    r[1].reach = check.Reach(True, from_host="h2")
    v = check.verdict(r)
    assert v.code == check.EXIT_OK and "every data plane reachable" in v.message


async def test_probe_dials_a_real_listener_and_reports_a_closed_port() -> None:
    import asyncio

    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reach = await check.probe_data_plane(f"tcp://127.0.0.1:{port}", 2.0)
        assert reach.ok and reach.error == "" and reach.from_host
    finally:
        server.close()
        await server.wait_closed()
    reach = await check.probe_data_plane(f"ucx://127.0.0.1:{port}", 2.0)
    assert not reach.ok and "ConnectionRefused" in reach.error
    reach = await check.probe_data_plane("garbage", 2.0)
    assert not reach.ok and "host:port" in reach.error
