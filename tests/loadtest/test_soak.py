"""`pdmesh soak`: the canary workload, its verdicts, and a soak against the real mesh.

The verdict tests feed canned replies (a leaked marker, a wrong answer, an over-capacity
prompt that got output, ...) to the soak's own checking code and assert each one is
counted: remove a check and its test fails. The double-server tests run the whole command
against a small OpenAI-style server that answers with the reference engine and can be told
to misbehave, and assert the exit status. The slow test soaks the real mesh.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from pdmesh.loadtest.client import Reply
from pdmesh.loadtest.soak.run import EXIT_CORRECTNESS, EXIT_OK, main
from pdmesh.loadtest.soak.verdict import Tally, judge, leaked_markers
from pdmesh.loadtest.soak.workload import (
    CHAT_TEMPLATE_OVERHEAD,
    DEFAULT_FAULTS,
    SoakWorkload,
    make_tenants,
    plan_request,
)
from pdmesh.services.engine.oracle import Expected, reference

KEYS = ["sk-dev-alice", "sk-dev-bob", "sk-dev-carol"]
TENANTS = tuple(make_tenants(KEYS, seed=0))
ALICE, BOB, CAROL = TENANTS


def workload(**overrides: object) -> SoakWorkload:
    values: dict = {"tenants": TENANTS, "context_length": 4096, "seed": 0}
    values.update(overrides)
    return SoakWorkload(**values)


def plan_of(kind: str, fault: str = "", **overrides: object):
    """The first plan of that kind (and fault) in a seeded workload."""
    wl = workload(**overrides)
    for i in range(2000):
        plan = plan_request(wl, i)
        if plan.kind == kind and (not fault or plan.fault == fault):
            return plan
    raise AssertionError(f"no {kind} {fault} plan")


# -- the workload ----------------------------------------------------------------------------
def test_tenants_have_distinct_names_and_marker_ids():
    assert [t.name for t in TENANTS] == ["alice", "bob", "carol"]
    assert len({t.marker_id for t in TENANTS}) == 3
    assert make_tenants(KEYS, 0) == list(TENANTS)  # deterministic
    assert make_tenants(KEYS, 1)[0].marker_id != ALICE.marker_id
    assert [t.name for t in make_tenants(["sk-dev-k", "sk-dev-k"], 0)] == ["k", "k1"]


def test_prompts_carry_their_tenants_marker_and_fit_the_context():
    wl = workload(min_len=64, max_len=1024)
    plans = [plan_request(wl, i) for i in range(300)]
    assert plans == [plan_request(wl, i) for i in range(300)]  # same seed, same prompts
    kinds = {p.kind for p in plans}
    assert kinds == {"normal", "over_capacity", "abort", "fault"}
    for p in plans:
        assert p.tenant == TENANTS[p.index % 3]
        assert p.prompt.isascii() and p.prompt.startswith("<<CANARY:" + p.tenant.name)
        assert p.tenant.marker_id in p.prompt
        assert not leaked_markers(p.prompt, p.tenant, TENANTS)
        assert wl.min_tokens <= p.max_tokens <= wl.max_tokens
        if p.over_capacity:
            assert p.prompt_len > wl.context_length
            assert p.kind == "over_capacity" or p.fault == "bypass_admission"
        else:
            assert p.prompt_len <= wl.max_len
            assert p.prompt_len + CHAT_TEMPLATE_OVERHEAD + p.max_tokens < wl.context_length
            assert p.fault != "bypass_admission"
        if p.kind == "abort":
            assert p.stream and p.abort_after_chunks in (1, 2)
        if p.kind == "fault":
            assert p.fault in DEFAULT_FAULTS
    long_prompt = max(plans, key=lambda p: 0 if p.over_capacity else p.prompt_len)
    assert long_prompt.prompt.count(long_prompt.tenant.marker_id) >= 4  # repeated in filler
    repeated = [p for p in plans if p.prompt_index != p.index]
    assert repeated
    by_prompt: dict[int, str] = {}
    for p in repeated:  # an earlier prompt of the same tenant, always the same text
        assert p.prompt_index < p.index and p.prompt_index % 3 == p.index % 3
        assert f"#{p.prompt_index}>>" in p.prompt
        assert by_prompt.setdefault(p.prompt_index, p.prompt) == p.prompt


def test_workload_validation():
    with pytest.raises(ValueError):
        workload(over_capacity_fraction=0.5, abort_fraction=0.4, fault_fraction=0.2)
    with pytest.raises(ValueError):
        workload(context_length=64)  # no room for a 64-token prompt
    with pytest.raises(ValueError):
        workload(faults=())
    assert workload(faults=(), fault_fraction=0.0)


# -- the verdicts ----------------------------------------------------------------------------
EXPECTED = Expected("the right answer", "length", 16)


def served(text: str, finish: str | None = "length") -> Reply:
    return Reply(status=200, text=text, finish_reason=finish, done=True, chunks=3)


def test_a_correct_reply_passes():
    plan = plan_of("normal")
    verdict = judge(plan, served("the right answer"), EXPECTED, TENANTS)
    assert verdict.outcome == "served" and verdict.oracle == "match"
    assert not verdict.violation and not verdict.problems


def test_a_reply_that_differs_from_the_oracle_is_a_mismatch():
    plan = plan_of("normal")
    verdict = judge(plan, served("someone else's answer"), EXPECTED, TENANTS)
    assert verdict.oracle == "mismatch" and verdict.violation
    # same text, but it stopped (eos) where the oracle ran to max_tokens: different tokens
    assert judge(plan, served("the right answer", "stop"), EXPECTED, TENANTS).mismatch


def test_a_reply_with_another_tenants_marker_is_a_leak():
    plan = plan_of("normal")
    other = BOB if plan.tenant != BOB else CAROL
    reply = served(f"blah <<CANARY:{other.name}:{other.marker_id}#7>> blah")
    verdict = judge(plan, reply, Expected(reply.text, "length", 16), TENANTS)
    assert verdict.oracle == "match"  # even when the oracle agrees, a foreign marker counts
    assert verdict.leaked_tenants == [other.name] and verdict.violation
    own = served(f"{plan.tenant.marker_id}")
    assert not judge(plan, own, Expected(own.text, "length", 1), TENANTS).violation


def test_partial_replies_must_be_a_prefix_of_the_oracle():
    plan = plan_of("abort")
    ok = judge(plan, Reply(status=200, text="the ri", aborted=True, chunks=2), EXPECTED,
               TENANTS)
    assert ok.outcome == "aborted" and ok.oracle == "prefix_match" and not ok.violation
    bad = judge(plan, Reply(status=200, text="xyz", aborted=True, chunks=2), EXPECTED, TENANTS)
    assert bad.oracle == "prefix_mismatch" and bad.violation
    # an error event after wrong text: the client saw wrong text
    err = judge(plan_of("normal"), Reply(status=200, text="xyz", stream_error=True,
                                         error_code="transfer_failed"), EXPECTED, TENANTS)
    assert err.outcome == "failed" and err.violation


def test_over_capacity_prompts_must_get_a_400():
    plan = plan_of("over_capacity")
    ok = judge(plan, Reply(status=400, error_code="context_length_exceeded"), None, TENANTS)
    assert ok.outcome == "rejected" and not ok.violation
    missed = judge(plan, served("fluent text from someone else's prompt"), None, TENANTS)
    assert missed.missed_rejection and missed.violation
    partial = judge(plan, Reply(status=200, text="x", stream_error=True), None, TENANTS)
    assert partial.missed_rejection
    wrong_code = judge(plan, Reply(status=503, error_code="no_workers"), None, TENANTS)
    assert wrong_code.misreported_rejection and wrong_code.violation


def test_bypass_admission_may_end_in_any_error_but_never_in_output():
    plan = plan_of("fault", "bypass_admission")
    assert plan.over_capacity
    ok = judge(plan, Reply(status=503, error_code="no_workers"), None, TENANTS)
    assert ok.fault_end == "error" and not ok.violation
    missed = judge(plan, served("output"), None, TENANTS)
    assert missed.fault_end == "missed_rejection" and missed.violation


def test_a_faulted_request_ends_in_an_error_or_the_oracles_output():
    plan = plan_of("fault", "corrupt_payload")
    err = judge(plan, Reply(status=200, stream_error=True, error_code="transfer_failed"),
                EXPECTED, TENANTS)
    assert err.fault_end == "error" and not err.violation
    same = judge(plan, served("the right answer"), EXPECTED, TENANTS)
    assert same.fault_end == "oracle_match" and not same.violation
    wrong = judge(plan, served("garbage from unwritten pages"), EXPECTED, TENANTS)
    assert wrong.fault_end == "mismatch" and wrong.violation


def test_a_valid_prompt_refused_is_a_violation():
    plan = plan_of("normal")
    verdict = judge(plan, Reply(status=400, error_code="context_length_exceeded"), EXPECTED,
                    TENANTS)
    assert verdict.unexpected_rejection and verdict.violation


def test_tally_counts_and_fails_on_violations():
    tally = Tally(TENANTS)
    normal, over = plan_of("normal"), plan_of("over_capacity")
    fault = plan_of("fault", "truncate")
    cases = [
        (normal, served("the right answer"), EXPECTED),
        (over, Reply(status=400, error_code="context_length_exceeded"), None),
        (fault, Reply(status=502, error_code="transfer_failed"), EXPECTED),
        (plan_of("abort"), Reply(status=200, text="the", aborted=True, chunks=1), EXPECTED),
    ]
    for plan, reply, expected in cases:
        tally.add(plan, reply, expected, judge(plan, reply, expected, TENANTS))
    s = tally.summary()
    assert (s["issued"], s["served"], s["rejected"], s["aborted"], s["failed"]) == (4, 1, 1, 1, 1)
    assert s["over_capacity"] == 1 and s["faults_injected"] == 1
    assert s["faults"] == {"truncate": {"error": 1, "injected": 1}}
    assert s["oracle_checked"] == 1 and s["oracle_prefix_checked"] == 1
    assert s["ok"] and s["failures"] == [] and s["violations"] == []
    json.dumps(s)
    bad = served(f"leak {BOB.marker_id}") if normal.tenant != BOB else served(ALICE.marker_id)
    tally.add(normal, bad, EXPECTED, judge(normal, bad, EXPECTED, TENANTS))
    s = tally.summary()
    assert not s["ok"] and s["oracle_mismatches"] == 1 and s["marker_leaks"] == 1
    assert s["violations"][0]["expected_text"] == "the right answer"


def test_pool_summary_counts_leaked_leases_and_integrity_failures():
    from types import SimpleNamespace

    from pdmesh.loadtest.soak.pool import _summary
    from pdmesh.services.protocol.messages import Role

    def row(worker, role, leases, ok, stats=True):
        beat = SimpleNamespace(worker_id=worker, role=role)
        st = SimpleNamespace(live_leases=leases, leased_pages=leases * 2, total_pages=256,
                             integrity_ok=ok, integrity_error="" if ok else "page 3 owned twice")
        return SimpleNamespace(beat=beat, stats=st if stats else None, stats_error="")

    clean = _summary([row("p", Role.PREFILL, 0, True), row("d", Role.DECODE, 0, True)], 1.0)
    assert clean["checked"] and clean["leaked_leases"] == clean["integrity_failures"] == 0
    bad = _summary([row("p", Role.PREFILL, 0, False), row("d", Role.DECODE, 3, True),
                    row("x", Role.DECODE, 0, True, stats=False)], 10.0)
    assert bad["leaked_leases"] == 3 and bad["integrity_failures"] == 1
    assert bad["unanswered"] == 1


# -- the whole command against a double that answers with the reference engine ---------------
class OracleDouble:
    """OpenAI-style test double serving the reference engine's greedy answers (so the soak's
    oracle agrees with it), 400 for over-capacity prompts, 502 for any fault header. `misbehave`
    makes it break one rule; it proves the soak notices, not anything about pdmesh."""

    def __init__(self, misbehave: str = "", context: int = 512) -> None:
        self.oracle = reference("tiny")
        self.misbehave, self.context = misbehave, context
        self.base_url = ""
        self.requests = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        return app

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": self.context}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        tok = self.oracle.tokenizer
        chat = request.path.endswith("/chat/completions")
        text = (tok.apply_chat_template(body["messages"]) if chat else body["prompt"])
        ids = tok.encode(text)
        over = len(ids) + body["max_tokens"] > self.context
        fault = request.headers.get("X-Pdmesh-Fault", "")
        if fault and self.misbehave != "fault_serves_garbage":
            return _error(502, "transfer failed", "transfer_failed")
        if over and self.misbehave != "miss_rejection":
            return _error(400, "too long", "context_length_exceeded")
        if over:
            out, finish = "fluent text for someone else's prompt", "length"
        else:
            expected = self.oracle.answer(ids, body["max_tokens"])
            out, finish = expected.text, expected.finish_reason
        if self.misbehave == "wrong_answer" and self.requests % 5 == 3:
            out = out[::-1] + "?"
        if self.misbehave == "fault_serves_garbage" and fault:
            out = "garbage" + out
        if self.misbehave == "leak" and self.requests % 5 == 3:
            out += " <<CANARY:bob:" + BOB.marker_id + ">> <<CANARY:alice:" + ALICE.marker_id
        if not body.get("stream"):
            part = {"message": {"role": "assistant", "content": out}} if chat else {"text": out}
            return web.json_response({"choices": [{**part, "index": 0, "finish_reason": finish}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, char in enumerate(out):
                part = {"delta": {"content": char}} if chat else {"text": char}
                end = finish if i == len(out) - 1 else None
                chunk = {"choices": [{**part, "index": 0, "finish_reason": end}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.001)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "x", "code": code}},
                             status=status)


@pytest.fixture
def oracle_double(serve_double) -> Callable[..., OracleDouble]:
    def make(misbehave: str = "") -> OracleDouble:
        return serve_double(OracleDouble(misbehave))

    return make


def soak_double(double: OracleDouble, out: Path, *extra: str) -> tuple[int, dict]:
    argv = ["--base-url", double.base_url, "--duration", "30", "--max-requests", "25",
            "--concurrency", "3", "--min-len", "16", "--max-len", "96", "--min-tokens", "2",
            "--max-tokens", "6", "--over-capacity-fraction", "0.2", "--abort-fraction", "0.1",
            "--fault-fraction", "0.3", "--output-dir", str(out), "--label", "run",
            "--quiet", *extra]
    code = main(argv)
    return code, json.loads((out / "run.json").read_text())


def test_soak_passes_against_an_honest_server(oracle_double, tmp_path):
    code, result = soak_double(oracle_double(), tmp_path)
    assert code == EXIT_OK, result["failures"]
    assert result["issued"] == 25 and result["stopped_by"] == "max_requests"
    assert (result["served"] + result["rejected"] + result["aborted"] + result["failed"]
            == result["issued"])
    assert result["served"] > 0 and result["oracle_checked"] == result["served"]
    assert result["rejected"] == result["correct_rejections"] == result["over_capacity"] > 0
    assert result["faults_injected"] > 0
    assert sum(v["injected"] for v in result["faults"].values()) == result["faults_injected"]
    assert result["oracle_mismatches"] == result["marker_leaks"] == 0


@pytest.mark.parametrize(("misbehave", "counter"), [
    ("wrong_answer", "oracle_mismatches"),
    ("leak", "marker_leaks"),
    ("miss_rejection", "missed_rejections"),
    ("fault_serves_garbage", "oracle_mismatches"),
])
def test_soak_exits_1_when_the_server_breaks_a_rule(oracle_double, tmp_path, misbehave,
                                                   counter):
    code, result = soak_double(oracle_double(misbehave), tmp_path)
    assert code == EXIT_CORRECTNESS
    assert result[counter] > 0 and not result["ok"]
    assert result["violations"]


def test_soak_refuses_bad_arguments(tmp_path):
    assert main(["--faults", "no_such_fault", "--output-dir", str(tmp_path)]) == 2
    assert main(["--duration", "0"]) == 2
    assert main(["--base-url", "http://127.0.0.1:9/v1", "--quiet"]) == 2  # unreachable


# -- the real mesh -----------------------------------------------------------------------------
def _faults_honoured(mesh) -> bool:
    status, _ = mesh.http("POST", "/v1/completions", {
        "model": mesh.model, "prompt": "probe " * 40, "max_tokens": 2, "temperature": 0},
        headers={"X-Pdmesh-Fault": "corrupt_payload"}, timeout=30)
    return status >= 500


@pytest.fixture(scope="module")
def fault_mesh(request):
    """The shared `live_mesh` when it honours X-Pdmesh-Fault, else a mesh of our own started
    the same way plus PDMESH_FAULTS=request_faults."""
    try:
        mesh = request.getfixturevalue("live_mesh")
    except pytest.FixtureLookupError:
        mesh = None
    if mesh is not None and _faults_honoured(mesh):
        yield mesh
        return
    from tests.support.meshproc import mesh_env, run_mesh

    with run_mesh("--kv-tokens", "4096", env=mesh_env(PDMESH_ALLOW_FAULTS="1",
                                                      PDMESH_FAULTS="request_faults")) as own:
        assert _faults_honoured(own)
        yield own


@pytest.mark.mesh
@pytest.mark.slow
def test_soak_on_the_real_mesh(fault_mesh, tmp_path):
    t0 = time.monotonic()
    argv = ["--base-url", fault_mesh.base_url, "--api-keys", ",".join(fault_mesh.api_keys),
            "--duration", "15", "--concurrency", "2", "--min-len", "32", "--max-len", "512",
            "--min-tokens", "4", "--max-tokens", "12", "--over-capacity-fraction", "0.15",
            "--abort-fraction", "0.15", "--fault-fraction", "0.25", "--drain-timeout", "20",
            "--request-timeout", "30", "--output-dir", str(tmp_path), "--label", "soak",
            "--nats-url", fault_mesh.nats_url, "--quiet"]
    code = main(argv)
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == EXIT_OK, (result["failures"], result["violations"][:3])
    assert time.monotonic() - t0 < 45
    assert (result["served"] + result["rejected"] + result["aborted"] + result["failed"]
            == result["issued"])
    assert result["oracle_mismatches"] == 0 and result["marker_leaks"] == 0
    assert result["missed_rejections"] == result["misreported_rejections"] == 0
    assert result["served"] > 0 and result["oracle_checked"] == result["served"]
    assert result["correct_rejections"] == result["over_capacity"] > 0
    bypass_refused = result["faults"].get("bypass_admission", {}).get("rejected", 0)
    assert result["rejected"] == result["over_capacity"] + bypass_refused
    assert result["faults_injected"] > 0
    assert sum(v["injected"] for v in result["faults"].values()) == result["faults_injected"]
    # every fault ended in an error, a clean refusal or the oracle's own output
    for name, ends in result["faults"].items():
        assert set(ends) <= {"injected", "error", "oracle_match", "rejected"}, (name, ends)
    assert result["aborted"] > 0 and result["unexpected_errors"] == 0, result["errors_by_code"]
    assert set(result["per_tenant"]) == {"alice", "bob", "carol"}
    pool = result["pool_check"]  # aborts, faults and rejections left no lease behind
    assert pool["checked"] and pool["leaked_leases"] == pool["integrity_failures"] == 0, pool
    assert {w["role"] for w in pool["workers"]} == {"prefill", "decode"}


def test_soak_and_loadtest_take_the_server_root_or_its_v1_alike(oracle_double, tmp_path):
    """One URL rule for the tools: `--base-url http://host:port` works as `.../v1` does."""
    from pdmesh.loadtest.cli import build_parser as loadtest_parser
    from pdmesh.loadtest.soak.run import build_parser as soak_parser

    for parser in (loadtest_parser(), soak_parser()):
        for url in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1"):
            assert parser.parse_args(["--base-url", url]).base_url == "http://127.0.0.1:8000/v1"
    double = oracle_double()
    root = double.base_url.removesuffix("/v1")
    code = main(["--base-url", root, "--duration", "20", "--max-requests", "4",
                 "--concurrency", "2", "--min-len", "16", "--max-len", "32", "--min-tokens", "2",
                 "--max-tokens", "3", "--output-dir", str(tmp_path), "--label", "root",
                 "--quiet"])
    assert code == EXIT_OK
