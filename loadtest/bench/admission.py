"""`pdmesh bench admission`: how fast admission says no, with no worker involved.

Starts a real nats-server on a free loopback port and a real `AdmissionService` in this
process, publishes synthetic heartbeats for one prefill and one decode worker (there is no
real worker: a rejection must never reach one, invariant I1), then sends over-capacity
`SubmitRequest`s over NATS request/reply and measures:

  * admission decisions per second for rejections, with bounded concurrency;
  * rejection latency at concurrency 1: the client round trip, the service's own timer
    (the value it observes into `pdmesh:admission_decision_seconds`, captured exactly), and
    the quantiles read back from that histogram on the service's `/metrics`
    (bucket-interpolated, as Prometheus' histogram_quantile would).

It also listens on every decode reserve and prefill dispatch subject: any message there, or
any admitted reply, ticket or dispatch, is an I1 violation and makes the exit code 1.
Target: a rejection answered in under 2 ms median. Bounded (~15 s). With --json the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import nats
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.services.admission.service import AdmissionService
from pdmesh.services.ops.launcher import free_port, nats_server_binary
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth, tickets
from pdmesh.services.runtime.config import resolve
from pdmesh.services.runtime.service import counter_total

TARGET_MEDIAN_MS = 2.0
TARGET_MEDIAN_S = TARGET_MEDIAN_MS / 1000.0
PREFILL_ID = "bench-prefill"
DECODE_ID = "bench-decode"
# Synthetic live figures: decode pool 4096 tokens, prefill pool 2048 tokens, both clamped
# below a configured 16384-token context (the incident's shape).
CONFIGURED_CONTEXT = 16384
DECODE_POOL = 4096
PREFILL_POOL = 2048
PAGE_TOKENS = 16


@dataclass(frozen=True)
class Case:
    name: str
    prompt_len: int
    max_tokens: int
    expect: m.Code


# Every case is rejected by a static limit: nothing is ever reserved or dispatched.
CASES = (
    Case("context_length_exceeded", DECODE_POOL + 904, 64, m.Code.CONTEXT_LENGTH_EXCEEDED),
    Case("prompt_exceeds_prefill_pool", PREFILL_POOL + 952, 32,
         m.Code.PROMPT_EXCEEDS_PREFILL_POOL),
    Case("max_tokens_over_context", 1000, DECODE_POOL, m.Code.CONTEXT_LENGTH_EXCEEDED),
)
NO_WORKERS = Case("no_workers", 100, 16, m.Code.NO_WORKERS)


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {"n": len(ms), "median_ms": _r(percentile(ms, 50)), "p90_ms": _r(percentile(ms, 90)),
            "p99_ms": _r(percentile(ms, 99)), "max_ms": _r(max(ms) if ms else math.nan)}


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style quantile (q in 0..1) from cumulative (le, count) buckets."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return buckets[-1][0]


def parse_histogram(text: str, name: str, labels: dict[str, str]) -> list[tuple[float, float]]:
    """Cumulative (le, count) buckets of histogram `name` with `labels` from /metrics text."""
    out = []
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == f"{name}_bucket" and all(s.labels.get(k) == v
                                                   for k, v in labels.items()):
                out.append((float(s.labels["le"]), float(s.value)))
    return sorted(out)


def diff_buckets(after: list[tuple[float, float]],
                 before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    prev = dict(before)
    return [(le, count - prev.get(le, 0.0)) for le, count in after]


# ---------------------------------------------------------------------------------------
# The bench
# ---------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    concurrency: int
    sent: int = 0
    elapsed_s: float = 0.0
    client_s: list[float] = field(default_factory=list)
    server_s: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    errors: int = 0

    def report(self) -> dict[str, Any]:
        rate = self.sent / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return {"concurrency": self.concurrency, "requests": self.sent,
                "elapsed_s": round(self.elapsed_s, 3), "decisions_per_s": round(rate, 1),
                "client_rtt": summary_ms(self.client_s), "server": summary_ms(self.server_s),
                "reasons": dict(self.reasons), "errors": self.errors,
                "unexpected": self.unexpected[:5]}


def heartbeat(role: m.Role, worker_id: str, pool: int) -> m.Heartbeat:
    return m.Heartbeat(worker_id=worker_id, role=role, model="bench-synthetic",
                       data_address="tcp://127.0.0.1:9", pool_capacity_tokens=pool,
                       available_tokens=pool, page_tokens=PAGE_TOKENS,
                       configured_context=CONFIGURED_CONTEXT, served_context=pool,
                       capacity_mismatch=True, sent_at=time.time())


class Bench:
    def __init__(self, nats_url: str, args: argparse.Namespace) -> None:
        self.url = nats_url
        self.args = args
        self.server_samples: list[float] | None = None  # where the service's timer goes
        self.worker_messages = 0  # reserve/dispatch messages seen: must stay 0 (I1)
        self.svc: Any = None
        self.nc: Any = None
        self.prompts = {c.name: list(range(1, c.prompt_len + 1)) for c in (*CASES, NO_WORKERS)}

    def _capture_server_timer(self) -> None:
        """Record each value the service observes for outcome=rejected (exact, no buckets)."""
        child = self.svc.decision_seconds.labels("rejected")
        original: Callable[..., None] = child.observe

        def observe(amount: float, *a: Any, **kw: Any) -> None:
            if self.server_samples is not None:
                self.server_samples.append(amount)
            original(amount, *a, **kw)

        child.observe = observe

    async def start(self) -> None:
        cfg = resolve("admission", {
            "nats_url": self.url, "http_port": 0, "worker_id": "admission-bench",
            "signing_key": tickets.generate_signing_key(), "queue_timeout_s": 0.5,
            "reserve_timeout_s": 0.5, "worker_ttl_s": 3.0, "log_level": "WARNING"}, env={})
        self.svc = AdmissionService(cfg)
        await self.svc.start()
        self._capture_server_timer()
        self.nc = await nats.connect(self.url, name="bench-client")

        async def worker_heard(msg: Any) -> None:
            self.worker_messages += 1
            if msg.reply:  # answer a stray reserve so nothing waits for a timeout
                await msg.respond(m.encode(m.ReserveRefused(request_id="", outcome=m.Outcome(
                    code=m.Code.RESERVE_FAILED, detail="bench: no worker here"))))

        await self.nc.subscribe(f"{m.PREFIX}.decode.*.reserve", cb=worker_heard)
        await self.nc.subscribe(f"{m.PREFIX}.prefill.*.dispatch", cb=worker_heard)
        await self.nc.flush()

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.svc is not None:
            await self.svc.rt.drain("bench done")

    async def heartbeats(self) -> None:
        while True:
            await self.nc.publish(m.heartbeat_subject("prefill", PREFILL_ID),
                                  m.encode(heartbeat(m.Role.PREFILL, PREFILL_ID, PREFILL_POOL)))
            await self.nc.publish(m.heartbeat_subject("decode", DECODE_ID),
                                  m.encode(heartbeat(m.Role.DECODE, DECODE_ID, DECODE_POOL)))
            await asyncio.sleep(0.5)

    async def wait_registered(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ids = {b.worker_id for b in self.svc.registry.heartbeats()}
            if {PREFILL_ID, DECODE_ID} <= ids:
                return
            await asyncio.sleep(0.02)
        raise RuntimeError("admission never registered the synthetic workers")

    async def run_phase(self, name: str, cases: tuple[Case, ...], concurrency: int,
                        duration_s: float, max_requests: int) -> Phase:
        phase = Phase(name, concurrency)
        self.server_samples = phase.server_s
        dec = m.Decoder(m.SubmitReply)
        counter = iter(range(10**9))
        stop_at = time.perf_counter() + duration_s

        async def one_client() -> None:
            while time.perf_counter() < stop_at and phase.sent < max_requests:
                i = next(counter)
                case = cases[i % len(cases)]
                req = m.SubmitRequest(request_id=f"bench-{name}-{i}", tenant="bench",
                                      cache_salt="bench", prompt_ids=self.prompts[case.name],
                                      max_tokens=case.max_tokens,
                                      stream_key=streamauth.new_key())
                payload = m.encode(req)
                phase.sent += 1
                t0 = time.perf_counter()
                try:
                    msg = await self.nc.request(m.SUBMIT_SUBJECT, payload, timeout=5)
                except Exception:  # noqa: BLE001 - counted; a bench keeps going
                    phase.errors += 1
                    continue
                phase.client_s.append(time.perf_counter() - t0)
                reply = dec.decode(m.SUBMIT_SUBJECT, msg.data)
                if not isinstance(reply, m.Rejected):
                    phase.unexpected.append(f"{req.request_id}: admitted")
                    continue
                key = reply.outcome.label
                phase.reasons[key] = phase.reasons.get(key, 0) + 1
                if reply.outcome.code is not case.expect:
                    phase.unexpected.append(f"{req.request_id}: {key}, expected "
                                            f"{case.expect.label}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        phase.elapsed_s = time.perf_counter() - t0
        self.server_samples = None
        return phase

    async def scrape(self) -> str:
        url = f"http://127.0.0.1:{self.svc.rt.http_port}/metrics"
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            return await resp.text()

    def counters(self) -> dict[str, float]:
        svc = self.svc
        return {"tickets_issued": counter_total(svc.tickets_issued),
                "reservations": counter_total(svc.reservations),
                "dispatches": counter_total(svc.dispatches),
                "worker_messages": float(self.worker_messages)}


async def run(nats_url: str, args: argparse.Namespace) -> dict[str, Any]:
    bench = Bench(nats_url, args)
    beats: asyncio.Task[None] | None = None
    try:
        await bench.start()
        phases: dict[str, Phase] = {}
        # 1. No worker has heartbeated yet: NO_WORKERS, answered at once.
        phases["no_workers"] = await bench.run_phase("no_workers", (NO_WORKERS,), 1,
                                                     args.no_workers_s, 10**9)
        beats = asyncio.get_running_loop().create_task(bench.heartbeats())
        await bench.wait_registered()
        # 2. Warm-up, then throughput with bounded concurrency.
        await bench.run_phase("warmup", CASES, args.concurrency, 0.5, 500)
        phases["throughput"] = await bench.run_phase("throughput", CASES, args.concurrency,
                                                     args.duration_s, 10**9)
        # 3. Latency at concurrency 1, with the service's histogram read back.
        hist = "pdmesh:admission_decision_seconds"
        before = parse_histogram(await bench.scrape(), hist, {"outcome": "rejected"})
        phases["latency"] = await bench.run_phase("latency", CASES, 1, args.latency_s, 10**9)
        after = parse_histogram(await bench.scrape(), hist, {"outcome": "rejected"})
        delta = diff_buckets(after, before)
        histogram = {f"{k}_ms": _r(histogram_quantile(q, delta) * 1000.0)
                     for k, q in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))}
        total = delta[-1][1] if delta else 0.0
        histogram["n"] = int(total)
        # The histogram's finest bucket is 0.5 ms: quantiles below it are interpolated
        # guesses, so also give the share of rejections in the <= 0.5 ms and <= 2 ms buckets.
        for le_s, key in ((0.0005, "share_le_0_5ms"), (TARGET_MEDIAN_S, "share_le_2ms")):
            hit = next((c for le, c in delta if math.isclose(le, le_s)), math.nan)
            histogram[key] = _r(hit / total) if total else None
        counters = bench.counters()
    finally:
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        await bench.close()
    lat = phases["latency"].report()
    thr = phases["throughput"].report()
    unexpected = [u for p in phases.values() for u in p.unexpected]
    violations = (int(counters["tickets_issued"] + counters["reservations"]
                      + counters["dispatches"] + counters["worker_messages"])
                  + len(unexpected))
    server_median = lat["server"]["median_ms"]
    return {
        "bench": "admission",
        "decisions_per_s": thr["decisions_per_s"],
        "concurrency": args.concurrency,
        "rejection_latency_ms": {
            "client_rtt": lat["client_rtt"], "server": lat["server"],
            "histogram": histogram},
        "target_median_ms": TARGET_MEDIAN_MS,
        "target_met": bool(server_median is not None and server_median < TARGET_MEDIAN_MS
                           and (lat["client_rtt"]["median_ms"] or math.inf) < TARGET_MEDIAN_MS),
        "phases": {k: p.report() for k, p in phases.items()},
        "i1": {**counters, "violations": violations},
        "cases": {c.name: {"prompt_len": c.prompt_len, "max_tokens": c.max_tokens,
                           "expect": c.expect.label} for c in (*CASES, NO_WORKERS)},
        "synthetic_workers": {"prefill_pool": PREFILL_POOL, "decode_pool": DECODE_POOL,
                              "configured_context": CONFIGURED_CONTEXT},
    }


def start_nats() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return proc, f"nats://127.0.0.1:{port}"
        time.sleep(0.05)
    stop_nats(proc)
    raise RuntimeError(f"nats-server did not start on 127.0.0.1:{port}")


def stop_nats(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def print_table(r: dict[str, Any]) -> None:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    print(f"pdmesh bench admission: rejections only, no worker involved "
          f"(synthetic prefill pool {PREFILL_POOL}, decode pool {DECODE_POOL} tokens)")
    thr = r["phases"]["throughput"]
    print(f"decisions/s (concurrency {r['concurrency']}): {r['decisions_per_s']:.0f}  "
          f"({thr['requests']} rejections in {thr['elapsed_s']:.1f}s)")
    print(f"{'rejection latency (c=1)':<34} {'median ms':>9} {'p90 ms':>9} {'p99 ms':>9}")
    rows = (("client round trip over NATS", r["rejection_latency_ms"]["client_rtt"]),
            ("server (service timer, exact)", r["rejection_latency_ms"]["server"]),
            ("server (/metrics histogram)", r["rejection_latency_ms"]["histogram"]),
            ("under load: client round trip", thr["client_rtt"]),
            ("under load: server", thr["server"]),
            ("no workers: client round trip", r["phases"]["no_workers"]["client_rtt"]))
    for label, s in rows:
        print(f"{label:<34} {fmt(s['median_ms']):>9} {fmt(s['p90_ms']):>9} "
              f"{fmt(s['p99_ms']):>9}")
    h = r["rejection_latency_ms"]["histogram"]
    if h.get("share_le_0_5ms") is not None:
        print(f"/metrics histogram: {h['share_le_0_5ms']:.1%} of rejections in the <= 0.5 ms "
              f"bucket (its finest), {h['share_le_2ms']:.1%} <= 2 ms")
    i1 = r["i1"]
    print(f"target: median < {TARGET_MEDIAN_MS:g} ms: {'met' if r['target_met'] else 'NOT met'}"
          f"; I1: tickets {i1['tickets_issued']:.0f}, reservations {i1['reservations']:.0f}, "
          f"dispatches {i1['dispatches']:.0f}, worker messages {i1['worker_messages']:.0f} "
          f"-> {'ok' if i1['violations'] == 0 else 'VIOLATED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench admission")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="requests in flight during the throughput phase")
    parser.add_argument("--duration-s", type=float, default=5.0, help="throughput phase")
    parser.add_argument("--latency-s", type=float, default=3.0,
                        help="latency phase (concurrency 1)")
    parser.add_argument("--no-workers-s", type=float, default=1.0,
                        help="NO_WORKERS phase before any heartbeat")
    parser.add_argument("--json", action="store_true", help="last stdout line is JSON")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or min(args.duration_s, args.latency_s, args.no_workers_s) <= 0:
        print("pdmesh bench admission: error: --concurrency >= 1 and durations > 0",
              file=sys.stderr)
        return 2
    # The service logs every rejection at INFO and clamped heartbeats at WARNING; keep the
    # bench's output to its table (production logging cost is not what is measured here).
    logging.getLogger("pdmesh").setLevel(logging.ERROR)
    try:
        proc, url = start_nats()
    except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
        print(f"pdmesh bench admission: error: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run(url, args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line, no traceback
        print(f"pdmesh bench admission: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    finally:
        stop_nats(proc)
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0 if report["i1"]["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
