"""One target server: warm-up, integrity references, the measured load, its figures."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import sys
from collections.abc import Awaitable
from dataclasses import dataclass

import aiohttp

from pdmesh.loadtest import integrity, phases
from pdmesh.loadtest.client import (
    ClientConfig,
    RequestResult,
    default_metrics_url,
    model_info,
    send_request,
)
from pdmesh.loadtest.metrics import LATENCY_METRICS, PERCENTILES, compute_metrics, parse_goodput
from pdmesh.loadtest.progress import ProgressBar
from pdmesh.loadtest.runner import LoadShape, SendFn, run_load
from pdmesh.loadtest.workload import RequestSpec, WorkloadSpec, build_warmup_requests

PHASE_SETTLE_S = 0.5  # after the load, before the last /metrics scrape


@dataclass(frozen=True)
class Target:
    label: str
    base_url: str
    api_keys: tuple[str | None, ...]
    model: str | None
    metrics_url: str = ""  # its gateway's /metrics (empty: default_metrics_url(base_url))

    @property
    def metrics(self) -> str:
        return self.metrics_url or default_metrics_url(self.base_url)


@dataclass
class TargetRun:
    result: dict
    mismatches: list[dict] | None


def client_config(args: argparse.Namespace, target: Target, model: str) -> ClientConfig:
    return ClientConfig(base_url=target.base_url, model=model, endpoint=args.endpoint,
                        stream=not args.no_stream,
                        temperature=0.0 if args.integrity else args.temperature,
                        ignore_eos=args.ignore_eos, request_timeout_s=args.request_timeout)


async def run_target(args: argparse.Namespace, target: Target, model: str,
                     spec: WorkloadSpec, requests: list[RequestSpec], stop: asyncio.Event,
                     show_progress: bool) -> TargetRun:
    """Warm-up, optional integrity references, the measured load; figures of one server."""
    shape = LoadShape(request_rate=args.request_rate, arrival=args.arrival,
                      burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      duration_s=args.duration, drain_timeout_s=args.drain_timeout,
                      cancel_grace_s=args.cancel_grace, seed=args.seed)
    cfg = client_config(args, target, model)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        def send(req: RequestSpec) -> Awaitable[RequestResult]:
            key = target.api_keys[req.tenant % len(target.api_keys)]
            return send_request(session, cfg, req, key)

        if args.warmup_requests and not stop.is_set():
            warm = build_warmup_requests(spec, args.warmup_requests)
            bar = ProgressBar(len(warm), f"{target.label} warmup", show_progress)
            warm_shape = LoadShape(max_concurrency=args.max_concurrency or 4,
                                   drain_timeout_s=args.drain_timeout,
                                   cancel_grace_s=args.cancel_grace)
            await run_load(warm, send, warm_shape,
                           stop, bar.on_event)
            bar.close()
        references: dict = {}
        if args.integrity and args.integrity_phase == "before":
            references = await _references(requests, send, stop, target, show_progress)
        before = await phases.scrape(session, target.metrics)  # a pdmesh gateway's phases
        bar = ProgressBar(len(requests), target.label, show_progress)
        outcome = await run_load(requests, send, shape, stop, bar.on_event)
        bar.close()
        if before is not None:
            # Prefill's timing of the last requests may trail their last token.
            await asyncio.sleep(PHASE_SETTLE_S)
        ttft_breakdown = phases.breakdown(before, await phases.scrape(session, target.metrics)
                                          if before is not None else None)
        if args.integrity and args.integrity_phase == "after":
            references = await _references(requests, send, stop, target, show_progress)

    slos = parse_goodput(args.goodput)
    result = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if args.endpoint == "chat" else "openai",
        "label": target.label,
        "base_url": target.base_url,
        "model_id": model,
        "tokenizer_id": getattr(args, "tokenizer_id", "bytes (1 token per byte, assumed)"),
        "num_prompts": len(requests),
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "arrival": args.arrival,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "stream": not args.no_stream,
        "context_length": spec.context_length,
        "num_tenants": spec.num_tenants,
        "warmup_requests": args.warmup_requests,
        "issued": outcome.issued,
        "not_issued": outcome.not_issued,
        "interrupted": outcome.interrupted,
        "deadline_reached": outcome.deadline_reached,
        **compute_metrics(outcome.results, outcome.duration_s, slos,
                          getattr(args, "percentile_metrics", LATENCY_METRICS),
                          getattr(args, "metric_percentiles", PERCENTILES)),
        "ttft_breakdown": ttft_breakdown,
    }
    mismatches = None
    if args.integrity:
        summary, mismatches = integrity.check_integrity(requests, outcome.results, references)
        result.update(summary)
    return TargetRun(result, mismatches)


async def _references(requests: list[RequestSpec], send: SendFn, stop: asyncio.Event,
                      target: Target, show_progress: bool) -> dict:
    distinct = {integrity.prompt_key(r) for r in requests if not r.expect_reject}
    bar = ProgressBar(len(distinct), f"{target.label} integrity refs", show_progress)
    refs = await integrity.run_references(requests, send, stop,
                                          lambda res: bar.on_event("done", res))
    bar.close()
    return refs


async def discover(target: Target) -> dict:
    try:
        return await model_info(target.base_url, target.api_keys[0])
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        print(f"loadtest: GET {target.base_url}/models failed: {exc}", file=sys.stderr)
        return {}
