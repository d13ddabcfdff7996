"""`pdmesh bench fairness`: what a flooding tenant does to a light tenant's time to first token.

One run writes a tenants file with two tenants, `heavy` and `light`, each allowed
`kv_share` (default 0.5) of the mesh's decode KV tokens (and `max_concurrent` requests in
flight, with `--max-concurrent`), starts one mesh of the tiny model on it (`pdmesh up
--tenants FILE`, a small `--kv-tokens` pool, admission's queue time `--queue-timeout-s`)
and runs three phases, a fresh random token-id prompt per request (no prefix-cache hit):

- `alone`: the light tenant sends one short streamed request (`--light-prompt-tokens`,
  `--light-max-tokens`) every `--light-interval-s`, `--light-requests` of them;
- `in_share`: the same light load while the heavy tenant keeps as many long requests in
  flight as its kv_share holds (the load the limits allow it: what a flood may at most
  cost the light tenant once its excess is refused);
- `contended`: the heavy tenant floods the mesh with long requests (`--heavy-prompt-tokens`
  + `--heavy-max-tokens` of KV each) from `--flood-factor` x as many senders as its
  kv_share holds, each sender sending again as soon as its last answer came (after
  `--heavy-pause-s` when it was refused), while the light tenant repeats the `alone` load
  exactly, `--heavy-lead-s` after the flood began; the flood stops when the light load ends.

The light tenant's TTFT is the client's: from sending the request to the first SSE chunk
that carries a choice. The report (the last stdout line with `--json`):

- `light_p99_ttft_s_alone`, `light_p99_ttft_s_in_share`, `light_p99_ttft_s_contended`,
  the ratios `light_p99_ttft_ratio` (contended / alone, target <= 1.5) and
  `light_p99_ttft_ratio_vs_in_share` (contended / in_share, target <= 1.5: what the flood
  beyond the heavy tenant's share costs), and the p50s. On a machine whose few cores every
  process shares, the in-share load alone slows the light tenant's prefill (CPU, not
  queueing): compare the two ratios;
- `light_requests`, `light_429` (with `light_429_codes`), `light_errors` (any other
  outcome than a 200 stream or a 429: another status, a timeout, an error event in the
  stream);
- `heavy_requests`, `heavy_ok`, `heavy_429`, `heavy_429_codes` (the error `code` of each
  429's body -> count), `heavy_429_retry_after` (429s that carried `Retry-After`),
  `heavy_429_unnamed` (code and message of the first 429s naming no tenant limit),
  `heavy_errors`, `heavy_cancelled` (still in flight when the flood was stopped);
- `targets_met`: both ratios within target, no light request refused or failed, the heavy
  tenant refused at least once and each of its 429s naming the limit it hit (a code
  `tenant_...`, or `mesh_saturated`: the mesh itself full), with `targets` (each of those);
- the parameters, the machine's load average at the start and the end, `wall_s`, and an
  `error` when the run could not complete (exit status 1; unmet targets exit 0 unless
  `--require-targets`).

Bounded: every phase stops issuing requests once `--budget-s` is spent, every request has a
client timeout, and the mesh's process group is stopped however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdmesh.loadtest.bench import print_report
from pdmesh.loadtest.client import SSEParser
from pdmesh.services.ops.launcher import free_port

MODEL = "tiny"
TOKEN_RANGE = (3, 250)  # plain ids of tiny's vocabulary
HEAVY_KEY, LIGHT_KEY = "sk-bench-heavy", "sk-bench-light"
TARGET_TTFT_RATIO = 1.5
READY_TIMEOUT_S = 300.0
START_TRIES = 3  # `pdmesh up` picks free ports for its services; another process may win one
LIGHT_TIMEOUT_S = 60.0
HEAVY_TIMEOUT_S = 120.0
WARMUP_TIMEOUT_S = 120.0
GRACE_S = 30.0  # past the budget, a started request still gets this long
DRAIN_S = 15.0  # heavy requests still in flight when the light load ended get this long
# Liveness has its own tests: no limit may cut a long prefill on a busy machine.
BENCH_ENV = {"PDMESH_TRANSFER_DEADLINE_S": "1800", "PDMESH_PREFILL_STALL_S": "1800",
             "PDMESH_REQUEST_TIMEOUT_S": "1800"}


@dataclass(frozen=True)
class Params:
    kv_tokens: int = 16384
    kv_share: float = 0.5
    max_concurrent: int = 0  # 0: not set in the tenants file
    queue_timeout_s: float = 2.0
    light_requests: int = 40
    light_interval_s: float = 0.25
    light_prompt_tokens: int = 64
    light_max_tokens: int = 16
    heavy_prompt_tokens: int = 2000
    heavy_max_tokens: int = 64
    flood_factor: int = 10
    heavy_lead_s: float = 1.0
    heavy_pause_s: float = 0.05
    budget_s: float = 180.0
    seed: int = 0

    @property
    def heavy_fits(self) -> int:
        """Heavy requests the tenant's kv_share holds at once (one is always allowed)."""
        return max(1, math.floor(self.kv_tokens * self.kv_share
                                 / (self.heavy_prompt_tokens + self.heavy_max_tokens)))

    @property
    def heavy_concurrency(self) -> int:
        return self.flood_factor * self.heavy_fits

    @property
    def max_context(self) -> int:
        return max(self.heavy_prompt_tokens + self.heavy_max_tokens,
                   self.light_prompt_tokens + self.light_max_tokens) + 64


@dataclass
class Outcome:
    """One request as the client saw it."""

    status: int | None = None  # None: no response (timeout, connection)
    ttft_s: float | None = None  # streamed: to the first chunk carrying a choice
    code: str | None = None  # the error body's `code`
    message: str = ""  # the error body's `message`
    retry_after: bool = False
    stream_error: bool = False
    transport_error: str = ""
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return (self.status == 200 and not self.stream_error and not self.transport_error
                and not self.cancelled)


def tenants_toml(kv_share: float, max_concurrent: int = 0) -> str:
    """The benchmark's tenants file: `heavy` and `light`, each with its own limits."""
    limits = f"kv_share = {kv_share!r}\n"
    if max_concurrent:
        limits += f"max_concurrent = {max_concurrent}\n"
    return "".join(f'[[tenant]]\nid = "{tid}"\napi_keys = ["{key}"]\n{limits}\n'
                   for tid, key in (("heavy", HEAVY_KEY), ("light", LIGHT_KEY)))


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0..100), linear between the closest ranks (numpy's default);
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_summary(outcomes: Sequence[Outcome]) -> dict[str, float | int | None]:
    """p50 / p99 / max TTFT of the successful streamed requests, and how many."""
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    return {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99),
            "max": max(ttfts) if ttfts else None, "count": len(ttfts)}


def _counts(outcomes: Sequence[Outcome]) -> tuple[int, int, int]:
    """(ok, 429, other) of `outcomes`, cancelled ones left out."""
    done = [o for o in outcomes if not o.cancelled]
    ok = sum(o.ok for o in done)
    refused = sum(o.status == 429 for o in done)
    return ok, refused, len(done) - ok - refused


def _ratio(over: object, under: object) -> float | None:
    return (over / under if isinstance(under, float) and under > 0
            and isinstance(over, float) else None)


def build_report(alone: Sequence[Outcome], contended: Sequence[Outcome],
                 heavy: Sequence[Outcome], in_share: Sequence[Outcome] | None = None
                 ) -> dict[str, object]:
    """The figures of one run and whether they meet the targets (`in_share`: the light
    load beside the heavy tenant's in-share load; None: not measured, no such target)."""
    solo, busy = ttft_summary(alone), ttft_summary(contended)
    p99_alone, p99_busy = solo["p99"], busy["p99"]
    ratio = _ratio(p99_busy, p99_alone)
    shared = ttft_summary(in_share or [])
    vs_share = _ratio(p99_busy, shared["p99"])
    light = [*alone, *(in_share or []), *contended]
    _, light_429, light_errors = _counts(light)
    heavy_ok, heavy_429, heavy_errors = _counts(heavy)
    refusals = [o for o in heavy if o.status == 429 and not o.cancelled]
    codes = Counter(str(o.code) for o in refusals)
    light_codes = Counter(str(o.code) for o in light if o.status == 429)
    unnamed = [o for o in refusals if not ((o.code or "").startswith("tenant_")
                                           or o.code == "mesh_saturated")]
    targets = {
        "light_p99_ttft_ratio": ratio is not None and ratio <= TARGET_TTFT_RATIO,
        **({} if in_share is None else {"light_p99_ttft_ratio_vs_in_share": (
            vs_share is not None and vs_share <= TARGET_TTFT_RATIO)}),
        "light_no_429": light_429 == 0,
        "light_no_errors": light_errors == 0 and bool(light),
        "heavy_refused": heavy_429 > 0,
        "heavy_429_name_limit": not unnamed,
    }
    return {
        "light_p99_ttft_s_alone": p99_alone, "light_p99_ttft_s_contended": p99_busy,
        "light_p99_ttft_ratio": ratio,
        "light_p99_ttft_s_in_share": shared["p99"], "light_p50_ttft_s_in_share": shared["p50"],
        "light_p99_ttft_ratio_vs_in_share": vs_share,
        "light_p50_ttft_s_alone": solo["p50"], "light_p50_ttft_s_contended": busy["p50"],
        "light_max_ttft_s_alone": solo["max"], "light_max_ttft_s_contended": busy["max"],
        "light_requests": len(light), "light_requests_alone": len(alone),
        "light_requests_contended": len(contended),
        "light_ok": solo["count"] + busy["count"], "light_429": light_429,
        "light_429_codes": dict(sorted(light_codes.items())), "light_errors": light_errors,
        "light_statuses": _statuses(light),
        "heavy_requests": sum(not o.cancelled for o in heavy), "heavy_ok": heavy_ok,
        "heavy_429": heavy_429, "heavy_429_codes": dict(sorted(codes.items())),
        "heavy_429_retry_after": sum(o.retry_after for o in refusals),
        "heavy_429_unnamed": [f"{o.code}: {o.message}" for o in unnamed[:3]],
        "heavy_errors": heavy_errors, "heavy_cancelled": sum(o.cancelled for o in heavy),
        "heavy_statuses": _statuses(heavy),
        "targets_met": all(targets.values()), "targets": targets,
        "target_light_p99_ttft_ratio": TARGET_TTFT_RATIO,
    }


def _statuses(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """HTTP status (or what ended the request instead) -> count."""
    seen = Counter("cancelled" if o.cancelled else o.transport_error or str(o.status)
                   for o in outcomes)
    return dict(sorted(seen.items()))


async def send(session: aiohttp.ClientSession, url: str, key: str, prompt: list[int],
               max_tokens: int, stream: bool, timeout_s: float) -> Outcome:
    """One completion; never raises for server or network errors (CancelledError aside)."""
    out = Outcome()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.retry_after = "Retry-After" in resp.headers
                out.code, out.message = error_fields(await resp.text())
            elif stream:
                parser = SSEParser()
                async for raw in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in parser.feed(raw):
                        if data.strip() == "[DONE]":
                            continue
                        payload = json.loads(data)
                        if "error" in payload:
                            out.stream_error = True
                            out.code, out.message = error_fields(data)
                        elif payload.get("choices") and out.ttft_s is None:
                            out.ttft_s = now - start
            else:
                payload = await resp.json(content_type=None)
                if "error" in payload:
                    out.stream_error = True
                    out.code, out.message = error_fields(json.dumps(payload))
    except TimeoutError:
        out.transport_error = "timeout"
    except aiohttp.ClientError:
        out.transport_error = "connection"
    except (ValueError, UnicodeDecodeError, AttributeError):
        out.transport_error = "protocol"
    return out


def error_fields(text: str) -> tuple[str | None, str]:
    """(`error.code`, `error.message`) of an OpenAI-style error body (None and the text's
    start when it is none)."""
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return None, text[:300]
    if not isinstance(err, dict):
        return None, text[:300]
    code = err.get("code")
    return None if code is None else str(code), str(err.get("message", ""))[:300]


class Load:
    """The two tenants' requests against one gateway, bounded by `deadline` (monotonic)."""

    def __init__(self, root: str, params: Params, deadline: float) -> None:
        self.url = root + "/v1/completions"
        self.p = params
        self.deadline = deadline
        self.rng = random.Random(f"fairness-{params.seed}")

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randint(*TOKEN_RANGE) for _ in range(length)]

    def timeout(self, ceiling: float) -> float:
        """A request's client timeout: `ceiling`, and past the budget by GRACE_S at most."""
        return max(min(ceiling, self.deadline + GRACE_S - time.monotonic()), 1.0)

    async def warm_up(self, session: aiohttp.ClientSession) -> None:
        """First calls pay for lazy set-up (both tenants, both shapes): not measured."""
        for key, length, max_tokens in ((LIGHT_KEY, self.p.light_prompt_tokens,
                                         self.p.light_max_tokens),
                                        (HEAVY_KEY, self.p.heavy_prompt_tokens,
                                         self.p.heavy_max_tokens)):
            out = await send(session, self.url, key, self.prompt(length), max_tokens, True,
                             self.timeout(WARMUP_TIMEOUT_S))
            if not out.ok:
                raise RuntimeError(f"warm-up request failed: status {out.status} "
                                   f"{out.code or out.transport_error}")

    async def light(self, session: aiohttp.ClientSession) -> list[Outcome]:
        """The light load: one short streamed request every light_interval_s (open loop)."""
        start = time.monotonic()
        tasks: list[asyncio.Task[Outcome]] = []
        for i in range(self.p.light_requests):
            due = start + i * self.p.light_interval_s
            if due > self.deadline:
                break
            await asyncio.sleep(max(due - time.monotonic(), 0.0))
            tasks.append(asyncio.create_task(send(
                session, self.url, LIGHT_KEY, self.prompt(self.p.light_prompt_tokens),
                self.p.light_max_tokens, True, self.timeout(LIGHT_TIMEOUT_S))))
        return list(await asyncio.gather(*tasks))

    async def contended(self, session: aiohttp.ClientSession, senders_n: int | None = None
                        ) -> tuple[list[Outcome], list[Outcome]]:
        """The light load again, under the heavy tenant's load from `senders_n` senders
        (default: the flood's): (light, heavy)."""
        stop = asyncio.Event()
        heavy: list[Outcome] = []
        senders = [asyncio.create_task(self._flood(session, stop, heavy))
                   for _ in range(senders_n or self.p.heavy_concurrency)]
        try:
            await asyncio.sleep(min(self.p.heavy_lead_s,
                                    max(self.deadline - time.monotonic(), 0.0)))
            light = await self.light(session)
        finally:
            stop.set()
            drain = max(min(DRAIN_S, self.deadline - time.monotonic()), 0.5)
            _, pending = await asyncio.wait(senders, timeout=drain)
            for task in pending:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
        return light, heavy

    async def _flood(self, session: aiohttp.ClientSession, stop: asyncio.Event,
                     outcomes: list[Outcome]) -> None:
        limit = 10_000  # requests per sender, beside the time bound
        for _ in range(limit):
            if stop.is_set() or time.monotonic() > self.deadline:
                return
            slot = len(outcomes)
            outcomes.append(Outcome(cancelled=True))  # until its answer comes
            result = await send(session, self.url, HEAVY_KEY,
                                self.prompt(self.p.heavy_prompt_tokens),
                                self.p.heavy_max_tokens, False, self.timeout(HEAVY_TIMEOUT_S))
            outcomes[slot] = result
            if not result.ok and not stop.is_set():
                await asyncio.sleep(self.p.heavy_pause_s)


async def run_phases(root: str, params: Params, deadline: float
                     ) -> tuple[list[Outcome], list[Outcome], list[Outcome], list[Outcome]]:
    """(light alone, light in_share, light contended, heavy of the flood) against the
    gateway at `root`."""
    load = Load(root, params, deadline)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        await load.warm_up(session)
        alone = await load.light(session)
        if time.monotonic() > deadline:
            raise RuntimeError("budget spent before the in_share phase")
        in_share, _ = await load.contended(session, params.heavy_fits)
        if time.monotonic() > deadline:
            raise RuntimeError("budget spent before the contended phase")
        contended, heavy = await load.contended(session)
    return alone, in_share, contended, heavy


@dataclass
class Mesh:
    """The `pdmesh up` child (its own process group), as a client sees it."""

    proc: subprocess.Popen[bytes]
    port: int
    log: list[str] = field(default_factory=list)  # its last lines
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _start(params: Params, tenants_file: Path) -> Mesh:
    port = free_port()
    cmd = [sys.executable, "-m", "pdmesh.services.ops.cli", "up", "--model", MODEL,
           "--gateway-port", str(port), "--tenants", str(tenants_file),
           "--allow-dev-credentials", "--max-context", str(params.max_context),
           "--kv-tokens", str(params.kv_tokens)]
    env = {**os.environ, "PDMESH_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1", **BENCH_ENV,
           "PDMESH_QUEUE_TIMEOUT_S": repr(params.queue_timeout_s)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    server = Mesh(proc, port)

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            server.log.append(line)
            del server.log[:-200]
            if "mesh ready: " in line:
                server.ready.set()

    server.reader = threading.Thread(target=pump, daemon=True)
    server.reader.start()
    return server


def _wait_ready(server: Mesh, deadline: float) -> None:
    while not server.ready.wait(0.2):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("pdmesh up did not start:\n" + "\n".join(server.log[-30:]))


def _stop(server: Mesh) -> None:
    """Ctrl-C to `pdmesh up` (it stops every service and nats-server); what is left of its
    process group a minute later is killed."""
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # a service that outlived the launcher
    if server.reader is not None:
        server.reader.join(5)
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def started(params: Params, tenants_file: Path, deadline: float) -> Iterator[Mesh]:
    for attempt in range(START_TRIES):
        server = _start(params, tenants_file)
        try:
            _wait_ready(server, min(time.monotonic() + READY_TIMEOUT_S, deadline))
        except RuntimeError:
            _stop(server)
            if attempt == START_TRIES - 1 or time.monotonic() > deadline:
                raise
            continue
        try:
            yield server
        finally:
            _stop(server)
        return


def run(params: Params) -> dict[str, object]:
    """One whole run: the report, with `error` when it could not complete."""
    started_at = time.monotonic()
    deadline = started_at + params.budget_s
    report: dict[str, object] = {"load_avg_1m_start": os.getloadavg()[0],
                                 "cpu_count": os.cpu_count()}
    try:
        with tempfile.TemporaryDirectory(prefix="pdmesh-fairness-") as tmp:
            tenants_file = Path(tmp) / "tenants.toml"
            tenants_file.write_text(tenants_toml(params.kv_share, params.max_concurrent),
                                    encoding="utf-8")
            with started(params, tenants_file, deadline) as server:
                mesh_ready_s = time.monotonic() - started_at
                try:
                    alone, in_share, contended, heavy = asyncio.run(
                        run_phases(server.root, params, deadline))
                except RuntimeError as exc:
                    raise RuntimeError("\n".join([str(exc), "mesh log:", *server.log[-20:]])
                                       ) from None
        report.update(build_report(alone, contended, heavy, in_share),
                      mesh_ready_s=mesh_ready_s)
    except RuntimeError as exc:  # a mesh that did not start, a warm-up that failed
        print(f"pdmesh bench fairness: {exc}", file=sys.stderr, flush=True)
        report["error"] = str(exc).splitlines()[0][:500]
    report.update(parameters(params), load_avg_1m_end=os.getloadavg()[0],
                  wall_s=time.monotonic() - started_at)
    return report


def parameters(params: Params) -> dict[str, object]:
    return {"model": MODEL, "kv_tokens": params.kv_tokens, "kv_share": params.kv_share,
            "max_concurrent": params.max_concurrent,
            "queue_timeout_s": params.queue_timeout_s,
            "light_interval_s": params.light_interval_s,
            "light_prompt_tokens": params.light_prompt_tokens,
            "light_max_tokens": params.light_max_tokens,
            "heavy_prompt_tokens": params.heavy_prompt_tokens,
            "heavy_max_tokens": params.heavy_max_tokens,
            "heavy_fits": params.heavy_fits, "heavy_concurrency": params.heavy_concurrency,
            "flood_factor": params.flood_factor, "heavy_lead_s": params.heavy_lead_s,
            "budget_s": params.budget_s, "seed": params.seed}


def parse_args(argv: Sequence[str] | None = None) -> tuple[Params, argparse.Namespace]:
    d = Params()
    parser = argparse.ArgumentParser(
        prog="pdmesh bench fairness",
        description="A light tenant's time to first token alone and while a heavy tenant "
                    "floods the mesh past its kv_share, and how the heavy tenant is refused.")
    add = parser.add_argument
    add("--kv-tokens", type=int, default=d.kv_tokens,
        help="decode (and prefill) KV pool in tokens (default %(default)s)")
    add("--kv-share", type=float, default=d.kv_share,
        help="each tenant's kv_share in the tenants file, in (0, 1] (default %(default)s)")
    add("--max-concurrent", type=int, default=d.max_concurrent,
        help="each tenant's max_concurrent in the tenants file (default 0: not set)")
    add("--queue-timeout-s", type=float, default=d.queue_timeout_s,
        help="admission's queue time before a 429 (default %(default)s)")
    add("--light-requests", type=int, default=d.light_requests,
        help="light requests per phase (default %(default)s)")
    add("--light-interval-s", type=float, default=d.light_interval_s,
        help="seconds between light requests (default %(default)s)")
    add("--light-prompt-tokens", type=int, default=d.light_prompt_tokens)
    add("--light-max-tokens", type=int, default=d.light_max_tokens)
    add("--heavy-prompt-tokens", type=int, default=d.heavy_prompt_tokens)
    add("--heavy-max-tokens", type=int, default=d.heavy_max_tokens)
    add("--flood-factor", type=int, default=d.flood_factor,
        help="heavy senders per request its kv_share holds (default %(default)s)")
    add("--heavy-lead-s", type=float, default=d.heavy_lead_s,
        help="the flood's head start over the contended light load (default %(default)s)")
    add("--heavy-pause-s", type=float, default=d.heavy_pause_s,
        help="a heavy sender's pause after a refusal (default %(default)s)")
    add("--budget-s", type=float, default=d.budget_s,
        help="no request starts after this many seconds (default %(default)s)")
    add("--seed", type=int, default=d.seed, help="seed of the random prompts")
    add("--require-targets", action="store_true", help="exit 1 when a target is not met")
    add("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    positive = ("kv_tokens", "light_requests", "light_prompt_tokens", "light_max_tokens",
                "heavy_prompt_tokens", "heavy_max_tokens", "flood_factor", "budget_s",
                "queue_timeout_s", "light_interval_s")
    bad = [name for name in positive if getattr(args, name) <= 0]
    bad += [name for name in ("max_concurrent", "heavy_lead_s", "heavy_pause_s")
            if getattr(args, name) < 0]
    if not 0 < args.kv_share <= 1:
        bad.append("kv_share")
    if bad:
        parser.error("out of range: " + ", ".join("--" + n.replace("_", "-") for n in bad)
                     + " (counts, sizes, times and the budget > 0; --kv-share in (0, 1])")
    params = Params(**{name: getattr(args, name) for name in Params.__dataclass_fields__})
    return params, args


def exit_status(report: Mapping[str, object], require_targets: bool) -> int:
    if "error" in report:
        return 1
    return 1 if require_targets and not report.get("targets_met") else 0


def main(argv: list[str] | None = None) -> int:
    params, args = parse_args(argv)
    report = run(params)
    print_report(report, args.json, 3)
    return exit_status(report, args.require_targets)


if __name__ == "__main__":
    sys.exit(main())
