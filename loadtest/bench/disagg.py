"""`pdmesh bench disagg`: what disaggregation costs a long prompt's time to first token.

One run starts a mesh (`pdmesh up`: prefill and decode apart, the KV sent over the
transport) and a colocated mesh (`pdmesh up --colocated`: one process, no transfer) of the
same model side by side, then sends each the same prompts at concurrency 1, alternating
which goes first, a fresh random prompt per run (no prefix-cache hit). Per model and prompt
length it reports:

- `ttft_ratio_<model>_<len>`: median TTFT on the mesh / median TTFT colocated (target
  <= 1.05). TTFT is the gateway's own (`pdmesh:time_to_first_token_seconds`, read as the
  difference of two scrapes of its metrics port around each request), the same code on
  both sides;
- `exposed_transfer_share_<model>_<len>`: the KV transfer left after the prefill ended /
  the whole transfer, over the mesh's runs (the gateway's PhaseTiming histograms; target
  <= 0.25 for prompts of 4 chunks or more); null when the prefill reports no timing;
- `ttft_ratio_best_<model>_<len>`: the same of the fastest run on each side (less swayed
  by other load on a shared machine);
- `cpu_ratio_<model>_<len>`: median CPU time (user + system, every process of the mesh,
  from /proc) a request took on the mesh / the same colocated: the work the mesh adds,
  which other load on the machine moves much less than wall-clock TTFT (counted in 10 ms
  ticks: telling for requests of a second of CPU or more); with
  `cpu_s_<model>_<len>_{mesh,colocated}`;
- with `--tracing`, a third mesh like the first with request tracing on
  (`--otlp-traces-endpoint`, exporting to an OTLP/HTTP sink in this process) takes its
  turns too: `tracing_ttft_ratio_<model>_<len>` (its median TTFT / the untraced mesh's) and
  `tracing_cpu_ratio_<model>_<len>` are what tracing costs, `otlp_exports` and
  `otlp_export_bytes` what it sent;
- the medians themselves (`ttft_s_<model>_<len>_{mesh,colocated}`), the runs done, the
  machine's load average at the start and the end, what the budget left out, and an
  `error_<model>_<len>` for a length that failed (the exit status is then 1).

Bounded: lengths run shortest first and a length is skipped when `--budget-s` is spent
(each is measured whole or not at all). The meshes run with generous liveness limits: this
measures speed; liveness has its own tests. The last stdout line is one JSON object
(`--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdmesh.loadtest import phases
from pdmesh.loadtest.bench import print_report
from pdmesh.services.ops.launcher import free_port

LENGTHS = {"tiny": (1024, 4096, 16384, 32768), "smollm2": (1024, 4096, 8192)}
TOKEN_RANGE = {"tiny": (3, 250), "smollm2": (200, 40000)}  # plain ids of each vocabulary
MODEL_CONTEXT = {"smollm2": 8192}  # a model's own limit (tiny takes any --max-context)
MAX_TOKENS = 1  # TTFT only
API_KEY = "sk-dev-alice"
READY_TIMEOUT_S = 300.0
WARMUP_TIMEOUT_S = 120.0
REQUEST_GRACE_S = 300.0  # past the budget, a started request still gets this long
# Speed, not liveness, is measured here: no limit may cut a long prefill on a busy machine.
BENCH_ENV = {"PDMESH_TRANSFER_DEADLINE_S": "1800", "PDMESH_PREFILL_STALL_S": "1800",
             "PDMESH_REQUEST_TIMEOUT_S": "1800", "PDMESH_QUEUE_TIMEOUT_S": "60"}
TTFT_SUM = f"{phases.TTFT}_sum"
TRANSFER_SUM, TRANSFER_COUNT = f"{phases.TRANSFER}_sum", f"{phases.TRANSFER}_count"
EXPOSED_SUM = "pdmesh:request_kv_transfer_exposed_time_seconds_sum"


@dataclass
class Server:
    """One `pdmesh up` child, as a client sees it."""

    label: str
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int  # the gateway's metrics (never on its API port)
    log: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by `pdmesh up` and every process under
        it (Linux /proc; 0.0 where it cannot be read)."""
        total, todo = 0.0, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                todo += [int(c) for c in
                         open(f"/proc/{pid}/task/{pid}/children").read().split()]
            except (OSError, ValueError, IndexError):
                continue  # a process that ended, or no /proc here
        return total

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=30) as resp:
            return phases.parse(resp.read().decode())

    def complete(self, prompt: list[int], model: str, timeout_s: float) -> float:
        """One request; returns the gateway's TTFT for it (seconds)."""
        before = self.metrics()
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0}).encode()
        req = urllib.request.Request(self.root + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                resp.read()
        except TimeoutError:
            raise RuntimeError(f"{self.label}: no answer within {timeout_s:.0f}s") from None
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{self.label}: HTTP {exc.code}: "
                               f"{exc.read()[:300].decode(errors='replace')}") from None
        after = self.metrics()
        return after.get(TTFT_SUM, 0.0) - before.get(TTFT_SUM, 0.0)

    def wait_for_timing(self, transfers_before: float, timeout_s: float = 2.5) -> None:
        """Prefill's PhaseTiming may trail the response a little (it follows decode's ack)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.metrics().get(TRANSFER_COUNT, 0.0) > transfers_before:
                return
            time.sleep(0.05)


START_TRIES = 3  # `pdmesh up` picks free ports for its services; another process may win one


@contextlib.contextmanager
def started(label: str, model: str, context: int, colocated: bool,
            extra: tuple[str, ...] = ()) -> Iterator[Server]:
    for attempt in range(START_TRIES):
        server = _start(label, model, context, colocated, extra)
        try:
            _wait_ready(server)
        except RuntimeError:
            _stop(server)
            if attempt == START_TRIES - 1:
                raise
            continue
        try:
            yield server
        finally:
            _stop(server)
        return


def _start(label: str, model: str, context: int, colocated: bool,
           extra: tuple[str, ...] = ()) -> Server:
    port, metrics_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdmesh.services.ops.cli", "up", "--model", model,
           "--gateway-port", str(port), "--metrics-port", str(metrics_port),
           "--max-context", str(context),
           "--kv-tokens", str(context + 256), *(["--colocated"] if colocated else []),
           *extra]
    env = {**os.environ, "PDMESH_ALLOW_DEV_CREDENTIALS": "1", "PDMESH_LOG_LEVEL": "WARNING",
           "PYTHONUNBUFFERED": "1", **BENCH_ENV}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = Server(label, proc, port, metrics_port)

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            server.log.append(line)
            if "mesh ready: " in line:
                server.ready.set()

    server.reader = threading.Thread(target=pump, daemon=True)
    server.reader.start()
    return server


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not server.ready.wait(0.2):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{server.label}: pdmesh up did not start:\n"
                               + "\n".join(server.log[-30:]))


def _stop(server: Server) -> None:
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if server.reader is not None:
        server.reader.join(5)
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class OtlpSink:
    """An OTLP/HTTP receiver that takes every export (200) and counts it: where the traced
    mesh's spans go."""

    server: http.server.ThreadingHTTPServer
    exports: int = 0
    bytes: int = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


@contextlib.contextmanager
def otlp_sink() -> Iterator[OtlpSink]:
    holder: list[OtlpSink] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            size = len(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            holder[0].exports += 1
            holder[0].bytes += size
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_args: object) -> None:
            pass

    sink = OtlpSink(http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    holder.append(sink)
    thread = threading.Thread(target=sink.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield sink
    finally:
        sink.server.shutdown()
        sink.server.server_close()


def _label(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def bench_model(model: str, lengths: list[int], runs: int, budget_end: float,
                report: dict[str, object], skipped: list[str],
                sink: OtlpSink | None = None) -> None:
    context = MODEL_CONTEXT.get(model, max(lengths) + MAX_TOKENS)
    rng = random.Random(f"disagg-{model}")
    low, high = TOKEN_RANGE.get(model, (200, 1000))
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(started("mesh", model, context, False))
        colo = stack.enter_context(started("colocated", model, context, True))
        servers = [mesh, colo]
        if sink is not None:  # the same mesh with tracing on, exporting to the sink
            servers.append(stack.enter_context(started(
                "traced", model, context, False, ("--otlp-traces-endpoint", sink.endpoint))))
        _bench_lengths(model, lengths, runs, budget_end, report, skipped, servers, context,
                       rng, (low, high))


def _bench_lengths(model: str, lengths: list[int], runs: int, budget_end: float,
                   report: dict[str, object], skipped: list[str], servers: list[Server],
                   context: int, rng: random.Random, token_range: tuple[int, int]) -> None:
    mesh, colo = servers[0], servers[1]
    low, high = token_range
    for server in servers:  # first calls pay for lazy set-up: not measured
        server.complete([rng.randint(low, high) for _ in range(64)], model, WARMUP_TIMEOUT_S)
    for length in sorted(lengths):
        key = f"{model}_{_label(length)}"
        if time.monotonic() > budget_end:
            skipped.append(key)
            continue
        prompt_len = min(length, context - MAX_TOKENS)  # smollm2's 8k: the whole context
        ttfts: dict[str, list[float]] = {s.label: [] for s in servers}
        cpus: dict[str, list[float]] = {s.label: [] for s in servers}
        before = mesh.metrics()
        try:
            for run in range(runs):
                prompt = [rng.randint(low, high) for _ in range(prompt_len)]
                k = run % len(servers)  # each goes first in turn
                for server in servers[k:] + servers[:k]:
                    transfers = server.metrics().get(TRANSFER_COUNT, 0.0)
                    # A request may overrun the budget, never the budget by far.
                    timeout_s = max(budget_end - time.monotonic(), 0.0) + REQUEST_GRACE_S
                    cpu = server.cpu_s()
                    ttfts[server.label].append(server.complete(prompt, model, timeout_s))
                    if server is not colo:
                        server.wait_for_timing(transfers)
                    cpus[server.label].append(server.cpu_s() - cpu)
        except RuntimeError as exc:  # this length failed; the next may not
            print(f"pdmesh bench disagg: {key}: {exc}", file=sys.stderr, flush=True)
            report[f"error_{key}"] = str(exc).splitlines()[0][:500]
            continue
        after = mesh.metrics()
        mesh_s, colo_s = (statistics.median(ttfts[k]) for k in ("mesh", "colocated"))
        transfer = after.get(TRANSFER_SUM, 0.0) - before.get(TRANSFER_SUM, 0.0)
        exposed = after.get(EXPOSED_SUM, 0.0) - before.get(EXPOSED_SUM, 0.0)
        report[f"ttft_ratio_{key}"] = mesh_s / colo_s if colo_s > 0 else None
        # Of the fastest runs: less swayed by other load on a shared machine.
        best_colo = min(ttfts["colocated"])
        report[f"ttft_ratio_best_{key}"] = (min(ttfts["mesh"]) / best_colo
                                            if best_colo > 0 else None)
        report[f"exposed_transfer_share_{key}"] = exposed / transfer if transfer > 0 \
            else None
        mesh_cpu, colo_cpu = (statistics.median(cpus[k]) for k in ("mesh", "colocated"))
        report[f"cpu_ratio_{key}"] = mesh_cpu / colo_cpu if colo_cpu > 0 else None
        report[f"cpu_s_{key}_mesh"] = mesh_cpu
        report[f"cpu_s_{key}_colocated"] = colo_cpu
        report[f"ttft_s_{key}_mesh"] = mesh_s
        report[f"ttft_s_{key}_colocated"] = colo_s
        report[f"prompt_tokens_{key}"] = prompt_len
        report[f"runs_{key}"] = runs
        if len(servers) > 2:
            traced_s = statistics.median(ttfts["traced"])
            traced_cpu = statistics.median(cpus["traced"])
            report[f"ttft_s_{key}_traced"] = traced_s
            report[f"cpu_s_{key}_traced"] = traced_cpu
            report[f"tracing_ttft_ratio_{key}"] = traced_s / mesh_s if mesh_s > 0 else None
            report[f"tracing_cpu_ratio_{key}"] = (traced_cpu / mesh_cpu if mesh_cpu > 0
                                                  else None)
        print(f"disagg: {key}: mesh {mesh_s:.3f}s colocated {colo_s:.3f}s, CPU "
              f"{mesh_cpu:.2f} / {colo_cpu:.2f} s (runs {runs})", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench disagg",
        description="Mesh vs --colocated time to first token at concurrency 1, by prompt "
                    "length, and the share of the KV transfer left after the prefill.")
    parser.add_argument("--models", default="tiny,smollm2",
                        help="comma-separated: tiny (1k/4k/16k/32k, long context), smollm2 "
                             "(1k/4k/8k); default %(default)s")
    parser.add_argument("--lengths", default="",
                        help="comma-separated prompt lengths in tokens for every model "
                             "(default: each model's own list)")
    parser.add_argument("--runs", type=int, default=3,
                        help="requests per length and side; the median is reported")
    parser.add_argument("--budget-s", type=float, default=900.0,
                        help="no new length starts after this many seconds (default "
                             "%(default)s)")
    parser.add_argument("--tracing", action="store_true",
                        help="also run the mesh with request tracing on (exporting to an "
                             "OTLP/HTTP sink here) and report what tracing costs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    models = [name for name in args.models.split(",") if name]
    unknown = [name for name in models if name not in LENGTHS]
    if unknown or not models or args.runs < 1 or args.budget_s <= 0:
        parser.error(f"--models from {', '.join(LENGTHS)}; --runs >= 1; --budget-s > 0"
                     + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    try:
        custom = [int(v) for v in args.lengths.split(",") if v]
    except ValueError:
        parser.error("--lengths: comma-separated integers")
    if any(n < 16 for n in custom):
        parser.error("--lengths: at least 16 tokens each")
    started_at = time.monotonic()
    report: dict[str, object] = {"load_avg_1m_start": os.getloadavg()[0],
                                 "cpu_count": os.cpu_count()}
    skipped: list[str] = []
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(otlp_sink()) if args.tracing else None
        for model in models:
            lengths = custom or list(LENGTHS[model])
            if time.monotonic() > started_at + args.budget_s:
                skipped += [f"{model}_{_label(n)}" for n in lengths]
                continue
            try:
                bench_model(model, lengths, args.runs, started_at + args.budget_s, report,
                            skipped, sink)
            except RuntimeError as exc:  # a mesh that did not start, a request that failed
                print(f"pdmesh bench disagg: {model}: {exc}", file=sys.stderr)
                report[f"error_{model}"] = str(exc).splitlines()[0]
        if sink is not None:
            report.update(otlp_exports=sink.exports, otlp_export_bytes=sink.bytes)
    report.update(load_avg_1m_end=os.getloadavg()[0], skipped=skipped,
                  wall_s=time.monotonic() - started_at, target_ttft_ratio=1.05,
                  target_exposed_transfer_share=0.25)
    print_report(report, args.json, 3)
    return 1 if any(key.startswith("error_") for key in report) else 0


if __name__ == "__main__":
    sys.exit(main())
