"""Chaos against a running mesh: a seeded killer of prefill and decode workers, the soak's
tally with every failed request kept, and the gateway's migration figures.

`Killer` sends SIGTERM (the worker drains) or SIGKILL to a prefill or decode worker on a
schedule drawn from a seed (`kill_plans`: the gap before each kill, the role, which worker
of it, the signal), so a failing run replays with the same seed. It finds a worker's
process id in its StatsReply (the stats request `pdmesh check` makes) and kills only a
process the caller says it owns. Before each kill it waits until every worker of the role
killed so far is back (a new process heartbeating ready under the same worker id: the
launcher restarts it), so at most one worker of a role is down at a time and every request
has somewhere to go, and up to `busy_wait_s` for the victim to hold a request (a kill should
cut work, not an idle process). Bounded: at most `max_kills`, none after `until_s`.

`RecordingTally` is the soak's tally that also keeps each failed request. A failure is a
refusal before admission when the gateway answered HTTP 429 or 503 (gateway/README.md,
"Errors and status codes": the mesh saturated, no worker, a tenant limit): the reply of an
admitted request starts only once admission placed it, so such a refusal reserved nothing
and the client may retry it. Anything else (502, 504, an error event inside a stream, no
answer at all) is a failed admitted request.

`migrations` reads `pdmesh:requests_migrated_total`, `pdmesh:request_migrations_failed_total`
and `pdmesh:migration_gap_seconds` off two scrapes of the gateway's /metrics.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import nats
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.loadtest.check import collect
from pdmesh.loadtest.client import Reply
from pdmesh.loadtest.soak.verdict import Tally, Verdict
from pdmesh.loadtest.soak.workload import RequestPlan
from pdmesh.services.engine.oracle import Expected
from pdmesh.services.protocol import messages as m

KILL_SIGNALS = (signal.SIGTERM, signal.SIGKILL)
KILL_ROLES = ("prefill", "decode")
REFUSED_BEFORE_ADMISSION = frozenset({429, 503})
MIGRATED = "pdmesh:requests_migrated_total"
MIGRATIONS_FAILED = "pdmesh:request_migrations_failed_total"
MIGRATION_GAP = "pdmesh:migration_gap_seconds"


# -- the schedule ----------------------------------------------------------------------------
@dataclass(frozen=True)
class KillPlan:
    gap_s: float  # after the previous kill (the first: after the start)
    role: str  # "prefill" | "decode"
    slot: int  # which worker of the role: in worker-id order, modulo how many there are
    signal: str  # "SIGTERM" | "SIGKILL"


def kill_plans(seed: int, count: int, gap_s: tuple[float, float] = (15.0, 30.0)
               ) -> list[KillPlan]:
    """The kills a seed draws, the same on every run: the first four are every (role,
    signal) pair in a random order (a drained worker rarely leaves anything to resume: each
    run also kills one of each role outright), the rest are drawn one by one."""
    rng = random.Random(seed)
    pairs = [(role, sig) for role in KILL_ROLES for sig in KILL_SIGNALS]
    rng.shuffle(pairs)
    pairs += [(rng.choice(KILL_ROLES), rng.choice(KILL_SIGNALS))
              for _ in range(max(0, count - len(pairs)))]
    return [KillPlan(round(rng.uniform(*gap_s), 3), role, rng.randrange(1 << 16), sig.name)
            for role, sig in pairs[:count]]


@dataclass
class Kill:
    at_s: float  # since the killer started
    at: str  # wall clock, as the services' logs have it
    worker_id: str
    role: str
    pid: int
    signal: str
    waited_s: float  # past its planned time: workers killed before coming back, or idle
    active_requests: int  # the victim's, in the heartbeat that showed work (0: none did)
    back_after_s: float | None = None  # a new process of the worker heartbeats ready
    new_pid: int = 0


@dataclass(frozen=True)
class WorkerSeen:
    worker_id: str
    role: str
    pid: int
    ready: bool


class Killer:
    """Kills workers of a running mesh on a seeded schedule (module docstring)."""

    def __init__(self, nats_url: str, workers: dict[str, int], seed: int, *, until_s: float,
                 max_kills: int = 12, gap_s: tuple[float, float] = (15.0, 30.0),
                 recover_timeout_s: float = 90.0, owns: Callable[[int], bool] = lambda _: True,
                 poll_s: float = 1.0, busy_wait_s: float = 5.0) -> None:
        self.nats_url = nats_url
        self.workers = dict(workers)  # role -> how many the mesh runs
        self.seed = seed
        self.until_s = until_s
        self.plans = kill_plans(seed, max_kills, gap_s)
        self.recover_timeout_s = recover_timeout_s
        self.owns = owns  # may this process be signalled (a child of the caller's launcher)
        self.poll_s = poll_s
        self.busy_wait_s = busy_wait_s  # how long a kill waits for its victim to hold work
        self.kills: list[Kill] = []
        self.problems: list[str] = []
        self.t0 = time.monotonic()

    def seen(self) -> dict[str, WorkerSeen]:
        """The workers heartbeating now that answered their stats, by worker id."""
        col = asyncio.run(collect(self.nats_url, listen_s=self.poll_s, probe=False))
        return {r.beat.worker_id: WorkerSeen(r.beat.worker_id, r.beat.role.value, r.stats.pid,
                                             r.beat.ready and not r.beat.draining)
                for r in col.rows.values() if r.stats is not None and r.beat.role.value
                in self.workers}

    async def _when_busy(self, worker_id: str, timeout_s: float) -> int:
        """Requests the worker holds, in its first heartbeat that shows any (0: none within
        `timeout_s`): a kill then has work to cut, not only an idle process."""
        nc = await nats.connect(self.nats_url)
        busy: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        decoder = m.Decoder(m.Heartbeat)

        async def on_beat(msg: Msg) -> None:
            try:
                beat = decoder.decode(msg.subject, msg.data)
            except m.MessageError:
                return
            held = beat.active_requests + beat.queue_depth
            if beat.worker_id == worker_id and held and not busy.done():
                busy.set_result(held)

        try:
            await nc.subscribe(m.HEARTBEAT_WILDCARD, cb=on_beat)
            try:
                return await asyncio.wait_for(busy, timeout_s)
            except TimeoutError:
                return 0
        finally:
            await nc.close()

    def _all_back(self, seen: dict[str, WorkerSeen], role: str = "") -> bool:
        """Every worker (of `role`, when given) up and ready, each one killed before under
        a new process; notes when each victim came back."""
        now = time.monotonic() - self.t0
        for kill in self.kills:
            w = seen.get(kill.worker_id)
            if kill.back_after_s is None and w is not None and w.ready and w.pid != kill.pid:
                kill.back_after_s, kill.new_pid = round(now - kill.at_s, 2), w.pid
                print(f"chaos: {now:7.1f}s {kill.worker_id} back (pid {w.pid}), "
                      f"{kill.back_after_s:g}s after its {kill.signal}", file=sys.stderr,
                      flush=True)
        ready = Counter(w.role for w in seen.values() if w.ready)
        roles = [role] if role else list(self.workers)
        return (all(ready[r] >= self.workers[r] for r in roles)
                and all(k.back_after_s is not None for k in self.kills if k.role in roles))

    def wait_all_back(self, timeout_s: float, stop: threading.Event | None = None,
                      not_before: float = 0.0, role: str = "") -> dict[str, WorkerSeen] | None:
        """The workers once all (of `role`, when given) are back, and not before the
        monotonic time `not_before`; None `timeout_s` past that (or at `stop`). Polls all
        along: each kill learns when its worker came back."""
        deadline = max(time.monotonic(), not_before) + timeout_s
        while True:
            seen = self.seen()
            now = time.monotonic()
            if self._all_back(seen, role) and now >= not_before:
                return seen
            if now >= deadline or (stop is not None and stop.is_set()):
                return None

    def run(self, stop: threading.Event) -> None:
        """Kill per the plans until they run out, `until_s` passes or `stop` is set; then
        watch until every worker killed is back (or `stop`)."""
        try:
            if self._run(stop) and not stop.is_set():
                self.wait_all_back(self.recover_timeout_s, stop)
        except Exception as exc:  # noqa: BLE001 - the caller reads problems, not a thread's
            self.problems.append(f"killer stopped: {type(exc).__name__}: {exc}")

    def _run(self, stop: threading.Event) -> bool:
        """The kills; False when one went wrong (a problem says what)."""
        last = self.t0
        for plan in self.plans:
            due = last + plan.gap_s
            if due - self.t0 > self.until_s:
                return True
            seen = self.wait_all_back(self.recover_timeout_s, stop, not_before=due,
                                      role=plan.role)
            if stop.is_set():
                return True
            if seen is None:
                gone = [k.worker_id for k in self.kills if k.back_after_s is None]
                self.problems.append(f"{plan.role} workers not back within "
                                     f"{self.recover_timeout_s:g}s (killed and not restarted: "
                                     f"{gone or 'none'})")
                return False
            now = time.monotonic()
            if now - self.t0 > self.until_s:
                return True
            of_role = sorted((w for w in seen.values() if w.role == plan.role),
                             key=lambda w: w.worker_id)
            victim = of_role[plan.slot % len(of_role)]
            if not self.owns(victim.pid):
                self.problems.append(f"{victim.worker_id}: pid {victim.pid} is not ours")
                return False
            held = asyncio.run(self._when_busy(victim.worker_id, self.busy_wait_s))
            now = time.monotonic()
            os.kill(victim.pid, signal.Signals[plan.signal])
            kill = Kill(round(now - self.t0, 2), datetime.datetime.now().isoformat(" ", "seconds"),
                        victim.worker_id, victim.role, victim.pid, plan.signal,
                        round(now - due, 2), held)
            self.kills.append(kill)
            print(f"chaos: {kill.at_s:7.1f}s {plan.signal} {victim.worker_id} "
                  f"(pid {victim.pid}, {held} requests held)", file=sys.stderr, flush=True)
            last = now
        return True

    def report(self) -> dict:
        return {"seed": self.seed, "until_s": self.until_s,
                "plans": [asdict(p) for p in self.plans],
                "kills": [asdict(k) for k in self.kills], "problems": list(self.problems)}


# -- the soak's failures ---------------------------------------------------------------------
def admitted_failure(record: dict) -> bool:
    """A failed request that admission had placed (module docstring)."""
    return not (record["status"] in REFUSED_BEFORE_ADMISSION and not record["text_chars"])


@dataclass
class RecordingTally(Tally):
    """The soak's tally, plus a record of every failed request (up to `max_failures`)."""

    t0: float = field(default_factory=time.monotonic)  # at_s counts from here
    max_failures: int = 200
    failures: list = field(default_factory=list)

    def add(self, plan: RequestPlan, reply: Reply, expected: Expected | None,
            verdict: Verdict) -> None:
        super().add(plan, reply, expected, verdict)
        if verdict.outcome != "failed" or len(self.failures) >= self.max_failures:
            return
        end_s = time.monotonic() - self.t0
        record = {
            "at_s": round(end_s, 2), "started_s": round(end_s - reply.e2e_s, 2),
            "index": plan.index, "tenant": plan.tenant.name, "kind": plan.kind,
            "endpoint": plan.endpoint, "stream": plan.stream, "prompt_len": plan.prompt_len,
            "max_tokens": plan.max_tokens, "status": reply.status,
            "error_code": reply.error_code, "transport_error": reply.transport_error,
            "stream_error": reply.stream_error, "error": reply.error[:300],
            "text_chars": len(reply.text)}
        record["admitted"] = admitted_failure(record)
        self.failures.append(record)

    def summary(self) -> dict:
        out = super().summary()
        refused = [f for f in self.failures if not f["admitted"]]
        out["failed_requests"] = list(self.failures)
        out["failed_admitted"] = out["failed"] - len(refused)
        out["refused_before_admission"] = {
            "count": len(refused),
            "by_code": dict(Counter(f"{f['status']} {f['error_code']}" for f in refused))}
        return out


def after_kills(failures: list[dict], kills: list[dict]) -> list[dict]:
    """Each failure with the last kill before it ended (worker, signal, seconds since)."""
    out = []
    for f in failures:
        last = max((k for k in kills if k["at_s"] <= f["at_s"]), key=lambda k: k["at_s"],
                   default=None)
        out.append({**f, "last_kill": None if last is None else {
            "worker_id": last["worker_id"], "signal": last["signal"],
            "seconds_before": round(f["at_s"] - last["at_s"], 2)}})
    return out


# -- the gateway's migration figures ----------------------------------------------------------
def scrape(metrics_url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith((MIGRATED, MIGRATIONS_FAILED, MIGRATION_GAP)):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def migrations(before: str, after: str) -> dict:
    """What the gateway counted between two scrapes: choices resumed by role and cause,
    resumes that failed by reason, and the gap a resumed choice saw."""
    b, a = _samples(before), _samples(after)
    delta = {k: v - b.get(k, 0.0) for k, v in a.items()}
    migrated = {f"{dict(k[1])['from_role']}/{dict(k[1])['cause']}": int(v)
                for k, v in delta.items() if k[0] == MIGRATED and v}
    failed = {dict(k[1])["reason"]: int(v) for k, v in delta.items()
              if k[0] == MIGRATIONS_FAILED and v}
    count = delta.get((MIGRATION_GAP + "_count", ()), 0.0)
    total = delta.get((MIGRATION_GAP + "_sum", ()), 0.0)
    buckets = sorted((float(dict(k[1])["le"]), v) for k, v in delta.items()
                     if k[0] == MIGRATION_GAP + "_bucket")

    def upper(q: float) -> float | str | None:  # the bucket bound the q-quantile is under
        le = next((le for le, n in buckets if count and n >= q * count), None)
        return "+Inf" if le == float("inf") else le

    return {"migrated_total": sum(migrated.values()), "migrated": migrated,
            "failed_total": sum(failed.values()), "failed": failed,
            "gap_s": {"count": int(count), "mean": round(total / count, 3) if count else None,
                      "p50_le": upper(0.5), "p99_le": upper(0.99)}}
