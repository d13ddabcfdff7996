"""`pdmesh loadtest`: long-prompt load generator with latency, goodput, rejection and
integrity accounting, plots, and a side-by-side comparison of two servers.

Exit status: 0 ok; 1 a correctness failure (an over-long prompt produced output, an
integrity mismatch, or greedy outputs that differ between the two compared servers);
2 bad arguments or target unreachable; 130 interrupted (partial results saved).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import threading
from pathlib import Path

from pdmesh.loadtest import report, tokens
from pdmesh.loadtest.client import BASE_URL_HELP, api_base, context_length_of, server_root
from pdmesh.loadtest.dataset import sharegpt_requests
from pdmesh.loadtest.metrics import parse_goodput, parse_metric_names, parse_percentiles
from pdmesh.loadtest.runner import ARRIVALS
from pdmesh.loadtest.target import Target, TargetRun, discover, run_target
from pdmesh.loadtest.workload import (
    LENGTH_DISTS,
    LengthDist,
    RequestSpec,
    WorkloadSpec,
    build_requests,
    shared_prefix,
)
from pdmesh.services.runtime.config import env_value

# vllm bench serve's spellings of the endpoint, mapped to ours.
ENDPOINT_ALIASES = {"completions": "completions", "chat": "chat",
                    "/v1/completions": "completions", "/v1/chat/completions": "chat"}
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}

EXIT_OK, EXIT_CORRECTNESS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _add_length_args(parser: argparse.ArgumentParser, name: str, default: int) -> None:
    parser.add_argument(f"--{name}-len-dist", choices=LENGTH_DISTS, default="fixed")
    parser.add_argument(f"--{name}-len", type=int, default=default,
                        help="fixed value / normal mean / uniform centre (tokens)")
    parser.add_argument(f"--{name}-len-min", type=int, default=None)
    parser.add_argument(f"--{name}-len-max", type=int, default=None)
    parser.add_argument(f"--{name}-len-std", type=float, default=None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdmesh loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", type=api_base, default="http://127.0.0.1:8000/v1",
                   help=BASE_URL_HELP)
    p.add_argument("--metrics-url", default="",
                   help="a pdmesh gateway's /metrics, for the TTFT by phase (default: the "
                        "--base-url host, port + 100, where `pdmesh up` serves them)")
    p.add_argument("--api-key", default=None,
                   help="default: $PDMESH_API_KEY, then $OPENAI_API_KEY")
    p.add_argument("--api-keys", default=None, help="comma-separated keys, one per tenant")
    p.add_argument("--tenants", type=int, default=None,
                   help="number of tenants (default: number of --api-keys, else 1)")
    p.add_argument("--model", default=None, help="default: the first model of GET /models")
    p.add_argument("--endpoint", choices=tuple(ENDPOINT_ALIASES), default=None,
                   help="completions (default) or chat; vLLM's /v1/... spellings too")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="as vllm bench serve: openai / vllm (completions), openai-chat (chat)")
    p.add_argument("--tokenizer", default="auto",
                   help="how prompt tokens are counted: auto (the server's /tokenize, else "
                   "1 token per byte), bytes, or a pdmesh model spec (tiny, smollm2, a .gguf "
                   "path, a checkpoint directory)")
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None,
                   help="a local ShareGPT-format JSON file (with --dataset-name sharegpt)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens of every dataset request (default: the reference "
                   "completion's length)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report percentiles for (vllm bench serve spelling)")
    p.add_argument("--metric-percentiles", default="90,99",
                   help="comma-separated percentiles, e.g. 25,50,99.9")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help='send "ignore_eos": true')
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds; no request is issued after it")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests get after issuing ends")
    p.add_argument("--cancel-grace", type=float, default=2.0,
                   help="seconds in-flight requests get after Ctrl-C / SIGTERM")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--output-dir", default="out/loadtest")
    _add_length_args(p, "input", 1024)
    _add_length_args(p, "output", 128)
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--shared-prefix-share", type=float, default=0.0,
                   help="fraction of requests that start with the shared prefix")
    p.add_argument("--over-capacity-fraction", type=float, default=0.0,
                   help="fraction of prompts longer than --context-length (expect 400)")
    p.add_argument("--context-length", type=int, default=None,
                   help="target context in tokens (default: from GET /models)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 e2el:3000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--integrity", action="store_true",
                   help="run each prompt alone too (greedy) and compare every loaded reply")
    p.add_argument("--integrity-phase", choices=("before", "after"), default="before")
    p.add_argument("--label", default=None, help="name of the target in tables and plots")
    p.add_argument("--compare-base-url", type=api_base, default=None,
                   help="run the same workload against this server too and compare "
                        "(http://host:port or http://host:port/v1)")
    p.add_argument("--compare-api-keys", default=None, help="default: the same keys")
    p.add_argument("--compare-model", default=None, help="default: the same model")
    p.add_argument("--compare-label", default="colocated")
    p.add_argument("--compare-metrics-url", default="",
                   help="the compared server's /metrics (default: as --metrics-url)")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None)
    progress.add_argument("--no-progress", action="store_false", dest="progress")
    return p


def _length_dist(args: argparse.Namespace, name: str) -> LengthDist:
    kind = getattr(args, f"{name}_len_dist")
    mean = getattr(args, f"{name}_len")
    lo, hi = getattr(args, f"{name}_len_min"), getattr(args, f"{name}_len_max")
    std = getattr(args, f"{name}_len_std")
    if kind == "uniform":
        lo = lo if lo is not None else max(1, mean // 2)
        hi = hi if hi is not None else max(lo, mean * 3 // 2)
    lo = lo if lo is not None else 1
    hi = hi if hi is not None else 1 << 30
    std = std if std is not None else (mean / 4 if kind == "normal" else 0.0)
    return LengthDist(kind, mean, lo, hi, std)


def split_list(raw: str) -> list[str]:
    """`"a, b,,c"` -> `["a", "b", "c"]` (comma lists of keys and names)."""
    return [item.strip() for item in raw.split(",") if item.strip()]


def _keys(raw: str | None, fallback: str | None) -> tuple[str | None, ...]:
    if raw:
        return tuple(split_list(raw))
    return (fallback,)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_stop_handlers(stop: asyncio.Event, notice: str = "") -> None:
    """Ctrl-C / SIGTERM set `stop` (the tool then stops issuing, cancels what is in flight
    and saves partial results). With a `notice` (the tool's name) the first signal says so
    on stderr and removes the handlers, so a second Ctrl-C interrupts hard; without one the
    handlers stay until `remove_stop_handlers()`. Only the main thread can install them."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if notice:
            print(f"\n{notice}: {signal.Signals(signum).name}, stopping; saving partial "
                  f"results", file=sys.stderr)
        stop.set()
        if notice:
            remove_stop_handlers()

    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):
            return


def remove_stop_handlers() -> None:
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(sig)


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_handlers(stop, notice="loadtest")
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    default_key = args.api_key or env_value("api_key") or os.environ.get("OPENAI_API_KEY")
    keys = _keys(args.api_keys, default_key)
    primary = Target(args.label or ("mesh" if args.compare_base_url else "target"),
                     args.base_url, keys, args.model, args.metrics_url)
    info = await discover(primary) if not (args.model and args.context_length) else {}
    model = args.model or info.get("id")
    if not model:
        print(f"loadtest: no --model and none found at GET {primary.base_url}/models",
              file=sys.stderr)
        return EXIT_USAGE
    context_length = args.context_length or context_length_of(info)
    spec = WorkloadSpec(
        num_requests=args.num_requests, input_len=_length_dist(args, "input"),
        output_len=_length_dist(args, "output"), seed=args.seed,
        num_tenants=args.tenants or len(keys), shared_prefix_len=args.shared_prefix_len,
        shared_prefix_share=args.shared_prefix_share,
        over_capacity_fraction=args.over_capacity_fraction, context_length=context_length)
    counter = await tokens.make_counter(args.tokenizer, server_root(primary.base_url),
                                        keys[0], model)
    args.tokenizer_id = counter.name
    requests = await _requests(args, spec, counter)
    out_dir = Path(args.output_dir)
    runs = {primary.label: await run_target(args, primary, model, spec, requests, stop,
                                            show_progress)}
    targets = [primary]
    if args.compare_base_url and not stop.is_set():
        other = Target(args.compare_label, args.compare_base_url,
                       _keys(args.compare_api_keys, None) if args.compare_api_keys else keys,
                       args.compare_model or model, args.compare_metrics_url)
        targets.append(other)
        runs[other.label] = await run_target(args, other, other.model or model, spec,
                                             requests, stop, show_progress)
    return _save(args, out_dir, targets, runs, interrupted=stop.is_set())


async def _requests(args: argparse.Namespace, spec: WorkloadSpec,
                    counter: tokens.TokenCounter) -> list[RequestSpec]:
    """The measured requests: from the dataset file, or generated and sized in tokens."""
    if args.dataset_name == "sharegpt":
        return await sharegpt_requests(Path(args.dataset_path), spec.num_requests, spec.seed,
                                       spec.num_tenants, counter, args.sharegpt_output_len,
                                       spec.context_length)
    return await tokens.fit(build_requests(spec), spec, counter, shared_prefix(spec))


def _save(args: argparse.Namespace, out_dir: Path, targets: list[Target],
          runs: dict[str, TargetRun], interrupted: bool) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for i, target in enumerate(targets):
        run_ = runs[target.label]
        suffix = "" if i == 0 else "-compare"
        report.write_json(out_dir / f"results{suffix}.json", run_.result)
        if run_.mismatches is not None:
            report.write_json(out_dir / f"integrity_mismatches{suffix}.json", run_.mismatches)
        print(report.format_summary(run_.result))
        failed |= run_.result["missed_rejections"] > 0
        failed |= run_.result.get("integrity_mismatches", 0) > 0
    report.write_plots({label: r.result for label, r in runs.items()}, out_dir)
    if len(targets) == 2:
        a, b = targets
        comp = report.comparison(a.label, runs[a.label].result, b.label, runs[b.label].result)
        report.write_json(out_dir / "comparison.json", comp)
        greedy = args.integrity or args.temperature == 0
        failed |= greedy and comp["output_mismatches"] > 0
        print(report.format_comparison(comp))
    print(f"loadtest: results in {out_dir}/", file=sys.stderr)
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_CORRECTNESS if failed else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_goodput(args.goodput)
        if args.tenants is not None and args.tenants < 1:
            raise ValueError("--tenants must be >= 1")
        _length_dist(args, "input"), _length_dist(args, "output")
        args.percentile_metrics = parse_metric_names(args.percentile_metrics)
        args.metric_percentiles = parse_percentiles(args.metric_percentiles)
        if args.dataset_name == "sharegpt" and not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
        if args.backend and args.endpoint and BACKENDS[args.backend] != ENDPOINT_ALIASES[
                args.endpoint]:
            raise ValueError(f"--backend {args.backend} and --endpoint {args.endpoint} "
                             "disagree")
        args.endpoint = ENDPOINT_ALIASES[args.endpoint] if args.endpoint else BACKENDS.get(
            args.backend or "openai", "completions")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(run(args))
    except ValueError as exc:  # workload that cannot be built (e.g. no room in context)
        print(f"loadtest: {exc}", file=sys.stderr)
        return EXIT_USAGE
