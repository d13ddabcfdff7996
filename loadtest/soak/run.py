"""`pdmesh soak`: the canary workload against a running mesh, every reply checked.

Runs for `--duration` seconds (and at most `--max-requests` requests) with `--concurrency`
requests in flight: several tenants whose prompts carry tenant-unique canary markers, mixed
prompt lengths, a share of over-capacity prompts (must get HTTP 400
`context_length_exceeded`), a share of client aborts (disconnect after a chunk or two) and,
against a mesh started with `PDMESH_ALLOW_FAULTS=1 PDMESH_FAULTS=request_faults`, a share of
requests carrying `X-Pdmesh-Fault: <name>`. Every served greedy reply must equal the
single-process reference engine's output for its prompt (partial replies: a prefix of it),
and no reply may carry another tenant's marker. With `--nats-url`, the oracle's engine
fingerprint is first compared with the one every worker announces in its heartbeats
(`fingerprints.py`): a mesh that computes other bits than the oracle is not judged.

Prints and saves (JSON in --output-dir) requests served, rejected, aborted, failed, faults
injected and how each ended, and oracle mismatches. The results file is readable by its
owner only (0600) and holds no credential: of the API keys only their number and the first
8 hex characters of each key's SHA-256, URLs without their passwords, and every string
masked by `services/runtime/redact.py` (the keys are registered with it).

Exit status: 0 ok; 1 a correctness failure (oracle mismatch, marker leak, over-capacity
prompt not refused with 400, valid prompt refused); 2 bad arguments, target unreachable, or
an oracle that cannot judge the target (another model or engine fingerprint); 130
interrupted (partial figures saved).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp

from pdmesh.loadtest.cli import (
    EXIT_CORRECTNESS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    install_stop_handlers,
    remove_stop_handlers,
    split_list,
)
from pdmesh.loadtest.client import (
    BASE_URL_HELP,
    ClientConfig,
    Reply,
    api_base,
    context_length_of,
    exchange,
    model_info,
)
from pdmesh.loadtest.report import format_block, format_row
from pdmesh.loadtest.soak.fingerprints import check_fingerprints, oracle_fingerprint, refusal
from pdmesh.loadtest.soak.pool import check_pools
from pdmesh.loadtest.soak.verdict import Tally, judge
from pdmesh.loadtest.soak.workload import (
    DEFAULT_FAULTS,
    RequestPlan,
    SoakWorkload,
    make_tenants,
    plan_request,
)
from pdmesh.services.engine.oracle import Expected, Oracle
from pdmesh.services.faults import ALL as FAULT_NAMES
from pdmesh.services.faults import FAULT_HEADER
from pdmesh.services.runtime import redact

DEV_KEYS = "sk-dev-alice,sk-dev-bob,sk-dev-carol"
NAME_WIDTH = 46  # the summary's first column


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdmesh soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", type=api_base, default="http://127.0.0.1:8000/v1",
                   help=BASE_URL_HELP)
    p.add_argument("--api-keys", default=DEV_KEYS, help="comma list, one tenant per key")
    p.add_argument("--model", default=None, help="model name to send (default: GET /models)")
    p.add_argument("--oracle-model", default="tiny",
                   help="model the reference engine loads; must be what the mesh serves")
    p.add_argument("--oracle-threads", type=int, default=1,
                   help="torch threads for the oracle in this process (0: torch default)")
    p.add_argument("--oracle-timeout", type=float, default=120.0,
                   help="seconds to wait for one oracle answer (then: unchecked)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of issuing requests")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-len", type=int, default=64, help="shortest valid prompt (tokens)")
    p.add_argument("--max-len", type=int, default=1024, help="longest valid prompt (tokens)")
    p.add_argument("--min-tokens", type=int, default=8, help="smallest max_tokens")
    p.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens")
    p.add_argument("--over-capacity-fraction", type=float, default=0.1)
    p.add_argument("--abort-fraction", type=float, default=0.1)
    p.add_argument("--fault-fraction", type=float, default=0.15)
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help="comma list of X-Pdmesh-Fault names (services/faults.py)")
    p.add_argument("--repeat-fraction", type=float, default=0.2,
                   help="share of valid prompts that repeat an earlier one of the tenant")
    p.add_argument("--chat-fraction", type=float, default=0.25,
                   help="share sent to /chat/completions (the rest: /completions)")
    p.add_argument("--non-stream-fraction", type=float, default=0.2,
                   help="share of non-abort requests sent with stream=false")
    p.add_argument("--context-length", type=int, default=None,
                   help="served context; default: GET /models max_model_len")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="after --duration, in-flight requests get this long")
    p.add_argument("--output-dir", default="soak-results")
    p.add_argument("--label", default="", help="file name stem (default soak-<date>)")
    p.add_argument("--nats-url", default="",
                   help="the mesh's NATS: before the run, check that the workers announce the "
                        "oracle's engine fingerprint; after it, that every KV lease came back "
                        "and every pool passes its integrity check (the mesh must be idle)")
    p.add_argument("--pool-settle", type=float, default=10.0,
                   help="seconds to wait for the leases to come back")
    p.add_argument("--fail-on-errors", action="store_true",
                   help="also exit 1 when a request without fault failed (5xx, 429, ...)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def workload_from_args(args: argparse.Namespace, context_length: int) -> SoakWorkload:
    tenants = tuple(make_tenants(split_list(args.api_keys), args.seed))
    return SoakWorkload(
        tenants=tenants, context_length=context_length,
        seed=args.seed, min_len=args.min_len, max_len=args.max_len,
        min_tokens=args.min_tokens, max_tokens=args.max_tokens,
        over_capacity_fraction=args.over_capacity_fraction, abort_fraction=args.abort_fraction,
        fault_fraction=args.fault_fraction, faults=tuple(split_list(args.faults)),
        repeat_fraction=args.repeat_fraction, chat_fraction=args.chat_fraction,
        non_stream_fraction=args.non_stream_fraction)


# -- one request ----------------------------------------------------------------------------
async def send_plan(session: aiohttp.ClientSession, base_url: str, model: str,
                    plan: RequestPlan, timeout_s: float) -> Reply:
    """Send one planned request; never raises for server or network errors."""
    headers = {"Authorization": f"Bearer {plan.tenant.api_key}"}
    if plan.fault:
        headers[FAULT_HEADER] = plan.fault
    cfg = ClientConfig(base_url, model, endpoint=plan.endpoint, stream=plan.stream,
                       temperature=0.0, request_timeout_s=timeout_s)
    return await exchange(session, cfg, plan.prompt, plan.max_tokens, headers,
                          abort_after_chunks=plan.abort_after_chunks)


# -- the run ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, workload: SoakWorkload, oracle: Oracle,
                 model: str, stop: asyncio.Event) -> None:
        self.args, self.wl, self.oracle, self.model, self.stop = args, workload, oracle, model, stop
        self.tally = Tally(workload.tenants)
        self.next_index = 0
        self.in_flight = 0
        self.stopped_by = "duration"
        self.t0 = 0.0

    async def _one(self, session: aiohttp.ClientSession, plan: RequestPlan) -> None:
        expected_task = None
        if plan.needs_oracle:
            # The oracle computes (in its thread) while the mesh answers.
            expected_task = asyncio.ensure_future(self.oracle.wait(
                self.oracle.submit(plan.prompt, plan.max_tokens, plan.endpoint),
                self.args.oracle_timeout))
        try:
            reply = await send_plan(session, self.args.base_url, self.model, plan,
                                    self.args.request_timeout)
            expected: Expected | None = await expected_task if expected_task else None
        except asyncio.CancelledError:
            if expected_task:
                expected_task.cancel()
            reply = Reply(transport_error="cancelled", error="cancelled at the drain deadline")
            self.tally.add(plan, reply, None, judge(plan, reply, None, self.wl.tenants))
            raise
        self.tally.add(plan, reply, expected, judge(plan, reply, expected, self.wl.tenants))

    async def _worker(self, session: aiohttp.ClientSession, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            if loop.time() >= deadline:
                return
            if self.next_index >= self.args.max_requests:
                self.stopped_by = "max_requests"
                return
            plan = plan_request(self.wl, self.next_index)
            self.next_index += 1
            self.in_flight += 1
            try:
                await self._one(session, plan)
            finally:
                self.in_flight -= 1

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(10)
            s = self.tally.summary()
            print(f"soak: {time.monotonic() - self.t0:6.0f}s issued {s['issued']} served "
                  f"{s['served']} rejected {s['rejected']} aborted {s['aborted']} failed "
                  f"{s['failed']} faults {s['faults_injected']} mismatches "
                  f"{s['oracle_mismatches']} leaks {s['marker_leaks']}", file=sys.stderr,
                  flush=True)

    async def run(self) -> float:
        loop = asyncio.get_running_loop()
        self.t0 = time.monotonic()
        deadline = loop.time() + self.args.duration
        connector = aiohttp.TCPConnector(limit=0)
        progress = None if self.args.quiet else asyncio.ensure_future(self._progress())
        async with aiohttp.ClientSession(connector=connector) as session:
            workers = [asyncio.ensure_future(self._worker(session, deadline))
                       for _ in range(self.args.concurrency)]
            stop_wait = asyncio.ensure_future(self.stop.wait())
            # Issuing ends at the deadline; in-flight requests get --drain-timeout more.
            hard_deadline = self.args.duration + self.args.drain_timeout
            pending = set(workers)
            while pending:
                remaining = self.t0 + hard_deadline - time.monotonic()
                if remaining <= 0:
                    break
                done, pending = await asyncio.wait(pending | {stop_wait}, timeout=remaining,
                                                   return_when=asyncio.FIRST_COMPLETED)
                pending.discard(stop_wait)
                if stop_wait in done:
                    self.stopped_by = "signal"
                    # a short grace, then cancel
                    if pending:
                        await asyncio.wait(pending, timeout=2.0)
                    break
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            stop_wait.cancel()
        if progress:
            progress.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await progress
        return time.monotonic() - self.t0


def format_summary(result: dict) -> str:
    rows = [
        ("Requests issued", result["issued"]),
        ("Served (200, complete)", result["served"]),
        ("Rejected (400 context_length_exceeded)", result["rejected"]),
        ("  over-capacity prompts sent", result["over_capacity"]),
        ("Aborted by the client", result["aborted"]),
        ("Failed (errors)", result["failed"]),
        ("  of which without a fault", result["unexpected_errors"]),
        ("  of which throttled (429)", result["throttled"]),
        ("Faults injected", result["faults_injected"]),
        ("Oracle checked (full replies)", result["oracle_checked"]),
        ("Oracle checked (partial replies)", result["oracle_prefix_checked"]),
        ("Oracle unchecked", result["oracle_unchecked"]),
        ("Oracle mismatches (must be 0)", result["oracle_mismatches"]),
        ("Cross-tenant marker leaks (must be 0)", result["marker_leaks"]),
        ("Missed rejections (must be 0)", result["missed_rejections"]),
        ("Misreported rejections (must be 0)", result["misreported_rejections"]),
        ("Unexpected rejections (must be 0)", result["unexpected_rejections"]),
        ("Elapsed (s)", f"{result['elapsed_s']:.1f}"),
        ("Served e2e p50 / p99 (ms)", (f"{result['latency_ms']['served_e2e']['p50']:.0f} / "
                                       f"{result['latency_ms']['served_e2e']['p99']:.0f}")),
    ]
    lines = format_block(" pdmesh soak ", rows, NAME_WIDTH)
    if result["faults"]:
        lines.append("Faults (name: injected / how they ended)")
        for name, ends in result["faults"].items():
            rest = ", ".join(f"{k} {v}" for k, v in ends.items() if k != "injected")
            lines.append(f"  {name:<22}{ends.get('injected', 0):>4}  {rest}")
    pool = result.get("pool_check") or {}
    if pool.get("checked"):
        lines.append(format_row("Pool check: leases left / integrity failures",
                                f"{pool['leaked_leases']} / {pool['integrity_failures']}",
                                NAME_WIDTH))
    if result["errors_by_code"]:
        lines.append("Errors by code: " + json.dumps(result["errors_by_code"]))
    lines.append("RESULT: OK" if result["ok"] else "RESULT: FAILED " + ", ".join(
        result["failures"]))
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)


# -- the results file ------------------------------------------------------------------------
KEY_DIGEST_CHARS = 8  # what the results keep of each API key: its SHA-256's first hex chars


def key_digests(keys: list[str]) -> list[str]:
    """The first KEY_DIGEST_CHARS hex characters of each key's SHA-256."""
    return [hashlib.sha256(k.encode()).hexdigest()[:KEY_DIGEST_CHARS] for k in keys]


def public_config(args: argparse.Namespace) -> dict:
    """The run's arguments as the results file keeps them: `api_keys` becomes the number of
    keys and their digests' prefixes; the rest as given (`scrub` masks URL passwords)."""
    out = dict(vars(args))
    keys = split_list(args.api_keys)
    out["api_keys"] = {"count": len(keys), "sha256_prefixes": key_digests(keys)}
    return out


def scrub(value: object) -> object:
    """`value` (JSON data) with every string, keys included, passed through `redact`."""
    if isinstance(value, str):
        return redact.redact(value)
    if isinstance(value, dict):
        return {scrub(k): scrub(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(v) for v in value]
    return value


def write_results(path: Path, payload: object) -> None:
    """Write `payload` as JSON, scrubbed, readable by its owner only (0600 whatever the
    umask), atomically (tmp + rename): an interrupted run never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # whoever made it chose its mode; this one is made here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(json.dumps(scrub(payload), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


async def _amain(args: argparse.Namespace) -> int:
    keys = split_list(args.api_keys)
    if not keys:
        print("pdmesh soak: --api-keys is empty", file=sys.stderr)
        return EXIT_USAGE
    for key in keys:  # no output of this run repeats one
        redact.register(key)
    try:
        info = await model_info(args.base_url, keys[0])
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        print(redact.redact(f"pdmesh soak: GET {args.base_url}/models failed: {exc}"),
              file=sys.stderr)
        return EXIT_USAGE
    model = args.model or str(info.get("id") or args.oracle_model)
    context_length = args.context_length or context_length_of(info)
    if not context_length:
        print("pdmesh soak: the target announces no max_model_len; pass --context-length",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        workload = workload_from_args(args, context_length)
    except ValueError as exc:
        print(f"pdmesh soak: {exc}", file=sys.stderr)
        return EXIT_USAGE
    oracle = Oracle(args.oracle_model, args.oracle_threads)
    if context_length > oracle.max_context:
        print(f"pdmesh soak: served context {context_length} > the oracle model's "
              f"{oracle.max_context}: is the mesh serving {args.oracle_model!r}?",
              file=sys.stderr)
        return EXIT_USAGE
    builds: dict = {"checked": False, "error": "no --nats-url given"}
    if args.nats_url:
        builds = await check_fingerprints(args.nats_url,
                                          oracle_fingerprint(oracle, args.oracle_model))
        refused = refusal(builds)
        if refused:
            oracle.close()
            print(f"pdmesh soak: refusing to judge: {refused}", file=sys.stderr)
            return EXIT_USAGE
        if builds["unannounced"] and not args.quiet:
            print(f"soak: not checked against the oracle's engine fingerprint (none "
                  f"announced): {', '.join(builds['unannounced'])}", file=sys.stderr)
    stop = asyncio.Event()
    install_stop_handlers(stop)
    soak = Soak(args, workload, oracle, model, stop)
    if not args.quiet:
        print(redact.redact(f"soak: {args.base_url} model {model} context {context_length}, "
                            f"{len(workload.tenants)} tenants, concurrency "
                            f"{args.concurrency}, {args.duration:g}s"),
              file=sys.stderr, flush=True)
    try:
        elapsed = await soak.run()
    finally:
        oracle.close()
        remove_stop_handlers()
    summary = soak.tally.summary()
    pool: dict = {"checked": False, "error": "no --nats-url given"}
    if args.nats_url and soak.stopped_by != "signal":
        pool = await check_pools(args.nats_url, args.pool_settle)
        if pool["error"]:
            print(redact.redact(f"pdmesh soak: pool check skipped: {pool['error']}"),
                  file=sys.stderr)
        for key in ("leaked_leases", "integrity_failures"):
            if pool.get(key):
                summary["failures"].append(f"{key}={pool[key]}")
                summary["ok"] = False
    summary["pool_check"] = pool
    if args.fail_on_errors and summary["unexpected_errors"]:
        summary["failures"].append(f"unexpected_errors={summary['unexpected_errors']}")
        summary["ok"] = False
    date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {
        "date": date, "base_url": args.base_url, "model": model,
        "context_length": context_length, "seed": args.seed,
        "concurrency": args.concurrency, "duration_s": args.duration,
        "elapsed_s": elapsed, "stopped_by": soak.stopped_by,
        "tenants": {t.name: t.marker_id for t in workload.tenants},
        "oracle_computed": oracle.computed, "oracle_cache_hits": oracle.cache_hits,
        "fingerprints": builds,
        **summary,
        "config": public_config(args),
        "workload": {k: v for k, v in asdict(workload).items() if k != "tenants"},
    }
    print(redact.redact(format_summary(result)))
    out = Path(args.output_dir) / f"{args.label or 'soak-' + date}.json"
    write_results(out, result)
    print(f"soak: results saved to {out}", file=sys.stderr)
    if soak.stopped_by == "signal":
        return EXIT_INTERRUPTED
    return EXIT_OK if result["ok"] else EXIT_CORRECTNESS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("duration", "request_timeout", "drain_timeout", "oracle_timeout"):
        if not getattr(args, name) > 0:
            print(f"pdmesh soak: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return EXIT_USAGE
    if args.concurrency < 1 or args.max_requests < 1:
        print("pdmesh soak: --concurrency and --max-requests must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    unknown = [name for name in split_list(args.faults) if name not in FAULT_NAMES]
    if unknown:
        print(f"pdmesh soak: unknown fault names: {', '.join(unknown)}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_amain(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
