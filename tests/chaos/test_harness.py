"""The chaos harness's own logic, without a mesh (milliseconds, in `make test`): the seeded
kill schedule, which failures count against a run, and the migration figures read off the
gateway's /metrics."""

from __future__ import annotations

from pdmesh.loadtest import chaos
from pdmesh.loadtest.client import Reply
from pdmesh.loadtest.soak.verdict import judge
from pdmesh.loadtest.soak.workload import SoakWorkload, make_tenants, plan_request

TENANTS = tuple(make_tenants(["sk-dev-alice", "sk-dev-bob"], seed=0))


def test_a_seed_draws_the_same_kills_and_covers_every_role_and_signal():
    plans = chaos.kill_plans(11, 12)
    assert plans == chaos.kill_plans(11, 12)
    assert plans != chaos.kill_plans(12, 12)
    assert len(plans) == 12 and all(15.0 <= p.gap_s <= 30.0 for p in plans)
    assert {(p.role, p.signal) for p in plans[:4]} == {
        (role, sig) for role in ("prefill", "decode") for sig in ("SIGTERM", "SIGKILL")}
    assert len(chaos.kill_plans(11, 2)) == 2


def _record(status: int | None, text: str = "", **reply: object) -> dict:
    wl = SoakWorkload(tenants=TENANTS, context_length=4096, seed=0, fault_fraction=0.0)
    plan = next(p for p in (plan_request(wl, i) for i in range(100)) if p.kind == "normal")
    tally = chaos.RecordingTally(TENANTS)
    r = Reply(status=status, text=text, **reply)
    tally.add(plan, r, None, judge(plan, r, None, TENANTS))
    (record,) = tally.failures
    summary = tally.summary()
    assert summary["failed"] == 1
    assert summary["failed_admitted"] == int(record["admitted"])
    return record


def test_only_a_429_or_503_before_any_text_is_a_refusal_before_admission():
    assert not _record(429, error_code="mesh_saturated")["admitted"]
    assert not _record(503, error_code="no_workers")["admitted"]
    assert _record(502, error_code="worker_lost")["admitted"]
    assert _record(504, error_code="deadline")["admitted"]
    assert _record(200, "partial", stream_error=True, error_code="worker_lost")["admitted"]
    assert _record(None, transport_error="timeout")["admitted"]


def test_a_served_request_is_no_failure():
    wl = SoakWorkload(tenants=TENANTS, context_length=4096, seed=0, fault_fraction=0.0)
    plan = plan_request(wl, 0)
    tally = chaos.RecordingTally(TENANTS)
    r = Reply(status=200, text="x", done=True, chunks=1)
    tally.add(plan, r, None, judge(plan, r, None, TENANTS))
    assert not tally.failures and tally.summary()["failed_admitted"] == 0


METRICS_BEFORE = """\
# TYPE pdmesh:requests_migrated_total counter
pdmesh:requests_migrated_total{model_name="tiny",from_role="decode",cause="worker_lost"} 1.0
# TYPE pdmesh:migration_gap_seconds histogram
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="0.5"} 1.0
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="2.0"} 1.0
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="+Inf"} 1.0
pdmesh:migration_gap_seconds_count{model_name="tiny"} 1.0
pdmesh:migration_gap_seconds_sum{model_name="tiny"} 0.25
"""
METRICS_AFTER = """\
# TYPE pdmesh:requests_migrated_total counter
pdmesh:requests_migrated_total{model_name="tiny",from_role="decode",cause="worker_lost"} 4.0
pdmesh:requests_migrated_total{model_name="tiny",from_role="prefill",cause="worker_drained"} 2.0
# TYPE pdmesh:request_migrations_failed_total counter
pdmesh:request_migrations_failed_total{model_name="tiny",reason="no_workers"} 1.0
# TYPE pdmesh:migration_gap_seconds histogram
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="0.5"} 3.0
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="2.0"} 5.0
pdmesh:migration_gap_seconds_bucket{model_name="tiny",le="+Inf"} 6.0
pdmesh:migration_gap_seconds_count{model_name="tiny"} 6.0
pdmesh:migration_gap_seconds_sum{model_name="tiny"} 5.25
"""


def test_migrations_are_the_difference_of_two_scrapes():
    moved = chaos.migrations(METRICS_BEFORE, METRICS_AFTER)
    assert moved["migrated"] == {"decode/worker_lost": 3, "prefill/worker_drained": 2}
    assert moved["migrated_total"] == 5
    assert moved["failed"] == {"no_workers": 1} and moved["failed_total"] == 1
    assert moved["gap_s"] == {"count": 5, "mean": 1.0, "p50_le": 2.0, "p99_le": "+Inf"}


def test_each_failure_names_the_last_kill_before_it():
    kills = [{"at_s": 10.0, "worker_id": "decode-0", "signal": "SIGKILL"},
             {"at_s": 30.0, "worker_id": "prefill-1", "signal": "SIGTERM"}]
    out = chaos.after_kills([{"at_s": 5.0}, {"at_s": 12.5}, {"at_s": 31.0}], kills)
    assert out[0]["last_kill"] is None
    assert out[1]["last_kill"] == {"worker_id": "decode-0", "signal": "SIGKILL",
                                   "seconds_before": 2.5}
    assert out[2]["last_kill"]["worker_id"] == "prefill-1"
