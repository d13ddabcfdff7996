"""The soak's verdicts: the per-request judgement and the tally.

Every reply the mesh serves must be the output oracle's answer (`oracle.py`: the
single-process reference engine; docs/INCIDENT.md lesson 5, invariant I4). Partial text (an
aborted stream, a stream that ended in an error event) must be a prefix of it. No reply may
carry another tenant's canary marker. An over-capacity prompt must get HTTP 400
`context_length_exceeded` (with `bypass_admission`, any error will do), never output.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

from pdmesh.loadtest.client import Reply
from pdmesh.loadtest.integrity import first_difference, prompt_fingerprint
from pdmesh.loadtest.soak.workload import RequestPlan, Tenant
from pdmesh.services.engine.oracle import Expected

Outcome = Literal["served", "rejected", "aborted", "failed"]
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass
class Verdict:
    outcome: Outcome
    oracle: str = "none"  # match, mismatch, prefix_match, prefix_mismatch, unchecked, none
    leaked_tenants: list[str] = field(default_factory=list)
    missed_rejection: bool = False  # over-capacity prompt produced output
    misreported_rejection: bool = False  # over-capacity prompt failed, but not with a 400
    unexpected_rejection: bool = False  # a valid prompt got a 400
    fault_end: str = ""  # how a faulted request ended
    problems: list[str] = field(default_factory=list)

    @property
    def mismatch(self) -> bool:
        return self.oracle in ("mismatch", "prefix_mismatch")

    @property
    def violation(self) -> bool:
        return (self.mismatch or bool(self.leaked_tenants) or self.missed_rejection
                or self.misreported_rejection or self.unexpected_rejection)


def leaked_markers(text: str, own: Tenant, tenants: list[Tenant] | tuple[Tenant, ...]
                   ) -> list[str]:
    """Names of the other tenants whose marker id appears in `text`."""
    return [t.name for t in tenants if t.index != own.index and t.marker_id in text]


def outcome_of(reply: Reply) -> Outcome:
    if reply.aborted:
        return "aborted"
    if reply.status == 400 and reply.error_code == CONTEXT_LENGTH_EXCEEDED:
        return "rejected"
    if reply.status == 200 and reply.done and not reply.stream_error and not reply.transport_error:
        return "served"
    return "failed"


def judge(plan: RequestPlan, reply: Reply, expected: Expected | None,
          tenants: list[Tenant] | tuple[Tenant, ...]) -> Verdict:
    """The verdict on one request: outcome, oracle comparison, markers, rejection."""
    verdict = Verdict(outcome_of(reply))
    verdict.leaked_tenants = leaked_markers(reply.text, plan.tenant, tenants)
    if verdict.leaked_tenants:
        verdict.problems.append(f"reply carries the marker of {verdict.leaked_tenants}")
    if plan.over_capacity:
        if reply.text or verdict.outcome == "served":
            verdict.missed_rejection = True
            verdict.problems.append(f"over-capacity prompt ({plan.prompt_len} tokens) "
                                    f"produced output (status {reply.status})")
            verdict.fault_end = "missed_rejection"
        elif verdict.outcome == "rejected":
            verdict.fault_end = "rejected"
        else:
            verdict.fault_end = "error"
            if not plan.fault:  # bypass_admission may end in any error; the rest needs 400
                verdict.misreported_rejection = True
                verdict.problems.append(f"over-capacity prompt not answered 400 "
                                        f"{CONTEXT_LENGTH_EXCEEDED}: status {reply.status} "
                                        f"{reply.error_code or reply.transport_error}")
        return verdict
    if verdict.outcome == "rejected" or (reply.status == 400 and not reply.text):
        verdict.unexpected_rejection = True
        verdict.problems.append(f"valid prompt ({plan.prompt_len} tokens + {plan.max_tokens})"
                                f" rejected: {reply.error_code} {reply.error[:200]}")
    if expected is None:
        verdict.oracle = "unchecked" if reply.text or verdict.outcome == "served" else "none"
    elif verdict.outcome == "served":
        same = (reply.text == expected.text
                and (reply.finish_reason is None or reply.finish_reason == expected.finish_reason))
        verdict.oracle = "match" if same else "mismatch"
        if not same:
            verdict.problems.append("served reply differs from the oracle")
    elif reply.text:
        prefix = expected.text.startswith(reply.text)
        verdict.oracle = "prefix_match" if prefix else "prefix_mismatch"
        if not prefix:
            verdict.problems.append(f"partial reply ({verdict.outcome}) is not a prefix of "
                                    f"the oracle")
    if plan.fault:
        if verdict.mismatch:
            verdict.fault_end = "mismatch"
        elif verdict.outcome == "served":
            verdict.fault_end = "oracle_match" if verdict.oracle == "match" else "served_unchecked"
        elif verdict.outcome == "rejected" or reply.status == 400:
            verdict.fault_end = "rejected"
        else:
            verdict.fault_end = "error"
    return verdict


def mismatch_record(plan: RequestPlan, reply: Reply, expected: Expected | None,
                    verdict: Verdict) -> dict:
    """What to keep of a request that broke a rule (for the JSON file)."""
    first_diff = None if expected is None else first_difference(reply.text, expected.text)
    return {
        "index": plan.index, "tenant": plan.tenant.name, "kind": plan.kind,
        "fault": plan.fault, "endpoint": plan.endpoint, "stream": plan.stream,
        "prompt_len": plan.prompt_len, "max_tokens": plan.max_tokens,
        **prompt_fingerprint(plan.prompt), "outcome": verdict.outcome, "oracle": verdict.oracle,
        "status": reply.status, "error_code": reply.error_code, "error": reply.error[:300],
        "leaked_tenants": verdict.leaked_tenants, "problems": verdict.problems,
        "received_text": reply.text, "received_finish_reason": reply.finish_reason,
        "expected_text": None if expected is None else expected.text,
        "expected_finish_reason": None if expected is None else expected.finish_reason,
        "first_difference_at": first_diff,
    }


@dataclass
class Tally:
    """Running counts of a soak; `summary()` is the JSON figures."""

    tenants: tuple[Tenant, ...]
    max_records: int = 50
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict = field(default_factory=lambda: defaultdict(Counter))
    per_tenant: dict = field(default_factory=lambda: defaultdict(Counter))
    faults: dict = field(default_factory=lambda: defaultdict(Counter))
    oracle: Counter = field(default_factory=Counter)
    errors_by_code: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    records: list = field(default_factory=list)
    served_e2e_s: list = field(default_factory=list)
    served_ttft_s: list = field(default_factory=list)

    def add(self, plan: RequestPlan, reply: Reply, expected: Expected | None,
            verdict: Verdict) -> None:
        c = self.counts
        c["issued"] += 1
        self.outcomes[verdict.outcome] += 1
        self.by_kind[plan.kind][verdict.outcome] += 1
        self.per_tenant[plan.tenant.name][verdict.outcome] += 1
        self.oracle[verdict.oracle] += 1
        if plan.over_capacity and not plan.fault:
            c["over_capacity"] += 1
            c["correct_rejections"] += verdict.outcome == "rejected"
        if plan.fault:
            c["faults_injected"] += 1
            self.faults[plan.fault]["injected"] += 1
            self.faults[plan.fault][verdict.fault_end] += 1
        if plan.prompt_index != plan.index:
            c["repeated_prompts"] += 1
        if verdict.outcome == "failed":
            code = reply.error_code or reply.transport_error or f"http_{reply.status}"
            self.errors_by_code[code] += 1
            if reply.status == 429:
                c["throttled"] += 1
            if not plan.fault and not plan.over_capacity:
                c["unexpected_errors"] += 1
        if verdict.outcome == "served":
            self.served_e2e_s.append(reply.e2e_s)
            if reply.chunks:
                self.served_ttft_s.append(reply.ttft_s)
        c["oracle_mismatches"] += verdict.mismatch
        c["marker_leaks"] += bool(verdict.leaked_tenants)
        c["missed_rejections"] += verdict.missed_rejection
        c["misreported_rejections"] += verdict.misreported_rejection
        c["unexpected_rejections"] += verdict.unexpected_rejection
        if verdict.violation and len(self.records) < self.max_records:
            self.records.append(mismatch_record(plan, reply, expected, verdict))

    def summary(self) -> dict:
        c = self.counts
        oracle = self.oracle
        out = {
            "issued": c["issued"],
            "served": self.outcomes["served"],
            "rejected": self.outcomes["rejected"],
            "aborted": self.outcomes["aborted"],
            "failed": self.outcomes["failed"],
            "over_capacity": c["over_capacity"],
            "correct_rejections": c["correct_rejections"],
            "faults_injected": c["faults_injected"],
            "oracle_checked": oracle["match"] + oracle["mismatch"],
            "oracle_prefix_checked": oracle["prefix_match"] + oracle["prefix_mismatch"],
            "oracle_unchecked": oracle["unchecked"],
            "oracle_mismatches": c["oracle_mismatches"],
            "marker_leaks": c["marker_leaks"],
            "missed_rejections": c["missed_rejections"],
            "misreported_rejections": c["misreported_rejections"],
            "unexpected_rejections": c["unexpected_rejections"],
            "unexpected_errors": c["unexpected_errors"],
            "throttled": c["throttled"],
            "repeated_prompts": c["repeated_prompts"],
            "faults": {name: dict(sorted(v.items())) for name, v in sorted(self.faults.items())},
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
            "per_tenant": {k: dict(sorted(v.items())) for k, v in sorted(self.per_tenant.items())},
            "errors_by_code": dict(sorted(self.errors_by_code.items())),
            "latency_ms": {"served_e2e": _stats_ms(self.served_e2e_s),
                           "served_ttft": _stats_ms(self.served_ttft_s)},
            "violations": list(self.records),
        }
        failures = []
        for key in ("oracle_mismatches", "marker_leaks", "missed_rejections",
                    "misreported_rejections", "unexpected_rejections"):
            if out[key]:
                failures.append(f"{key}={out[key]}")
        out["failures"] = failures
        out["ok"] = not failures
        return out


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    ms = sorted(v * 1000.0 for v in values_s)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, max(0, round(p / 100.0 * (len(ms) - 1))))]

    return {"count": len(ms), "mean": sum(ms) / len(ms), "p50": pct(50), "p99": pct(99),
            "max": ms[-1]}
