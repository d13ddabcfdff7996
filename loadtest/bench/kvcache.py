"""`pdmesh bench kvcache`: multi-turn conversations over working sets larger than one pool.

The workload of a long-document chat: each conversation is a `--doc-tokens` document; each
turn appends a `--question-tokens` question to the transcript, streams a `--answer-tokens`
answer (`/v1/completions`, greedy, `ignore_eos`) and appends those answer tokens (ids drawn
from the conversation's seed: generated tokens reach the cache only as part of the next
prompt, so their values do not matter to it). Conversations take turns round robin, the
pattern plain LRU loses on as soon as the set exceeds the pool (the pool now evicts S3-FIFO).

For each `--ratios` entry r, a fresh mesh (`pdmesh up`, one prefill and one decode worker,
`--kv-tokens` pool) serves round(r * kv_tokens / doc_tokens) conversations for `--turns`
turns. Measured at the client: TTFT (request sent to first SSE chunk), and from the final
usage chunk the prompt tokens served from cache (`prompt_tokens_details.cached_tokens`,
every tier). Turn 1 of each conversation is cold; later turns are warm. Per ratio it
reports the median cold and warm TTFT, `warm_over_cold`, `warm_cached_share` (cached /
prompt tokens of warm turns), hits and loaded bytes per tier and each tier's load bandwidth
(from the prefill worker's metrics, `pdmesh:kv_tier_*`).

`--tiers` picks what sits under the pool: `host` (tier 1), `disk` (tier 2, a temporary
directory), `remote` (tier 3, a redis-server this bench starts on a free loopback port),
comma-separated, or `none` (the pool's prefix cache alone: the baseline). `--restart`:
after the first round of turns, the prefill worker is killed (SIGKILL) and `pdmesh up`
restarts it: its pool and host tier are gone, disk and the store are not; the report's
`after_restart` is the first warm round after it. Bounded: nothing new starts after
`--budget-s`. With `--json` the last stdout line is one JSON object. Figures, never
pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pdmesh.loadtest.bench import print_report
from pdmesh.loadtest.bench.disagg import API_KEY, TOKEN_RANGE, Server, started
from pdmesh.services.ops.launcher import free_port

TIERS = ("host", "disk", "remote")
REQUEST_TIMEOUT_S = 600.0


def stream_turn(server: Server, model: str, prompt: list[int],
                max_tokens: int) -> tuple[float, int, int]:
    """(ttft_s, prompt_tokens, cached_tokens) of one streamed completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(server.root + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {API_KEY}"})
    sent = time.perf_counter()
    ttft, usage = 0.0, {}
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if not ttft and chunk.get("choices"):
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft, int(usage.get("prompt_tokens", len(prompt))), int(cached)


def prefill_metrics(server: Server) -> dict[str, float]:
    """The prefill worker's `pdmesh:kv_tier_*` series, summed by tier (`name{tier}`)."""
    port = server_prefill_port(server)
    if port is None:
        return {}
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    for line in text.splitlines():
        if not line.startswith("pdmesh:kv_tier_"):
            continue
        name, _, value = line.rpartition(" ")
        metric, _, labels = name.partition("{")
        tier = ""
        for part in labels.rstrip("}").split(","):
            key, _, val = part.partition("=")
            if key == "tier":
                tier = val.strip('"')
        key = f"{metric.removeprefix('pdmesh:kv_tier_')}:{tier}" if tier else metric
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _prefill_pid(server: Server) -> int | None:
    """The prefill worker's process under `pdmesh up` (None: not running)."""
    for pid in _children(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prefill" in cmd and b"serve" in cmd:
            return pid
    return None


def server_prefill_port(server: Server) -> int | None:
    """The prefill worker's HTTP port, from its environment."""
    pid = _prefill_pid(server)
    port = _environ(pid).get("PDMESH_HTTP_PORT") if pid is not None else None
    return int(port) if port else None


def _children(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (OSError, ValueError):
            continue
        found += kids
        todo += kids
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2]
                for item in raw.split(b"\0") if b"=" in item)


def kill_prefill(server: Server) -> bool:
    pid = _prefill_pid(server)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return pid is not None


@contextlib.contextmanager
def redis_store() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("--tiers remote needs redis-server (apt-get install redis-server)")
    port, work = free_port(), tempfile.mkdtemp(prefix="pdmesh-kvbench-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", work, "--maxmemory", "4gb",
                             "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        import socket

        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def run_ratio(args: argparse.Namespace, ratio: float, budget_end: float,
              tier_flags: tuple[str, ...]) -> dict[str, object]:
    low, high = TOKEN_RANGE.get(args.model, (200, 1000))
    conversations = max(1, round(ratio * args.kv_tokens / args.doc_tokens))
    context = args.doc_tokens + args.turns * (args.question_tokens + args.answer_tokens) + 64
    rngs = [random.Random(args.seed * 1000 + c) for c in range(conversations)]
    transcripts = [[rng.randint(low, high) for _ in range(args.doc_tokens)] for rng in rngs]
    cold, warm, warm_prompt, warm_cached, after_restart = [], [], 0, 0, []
    restarted = False
    extra = ("--kv-tokens", str(args.kv_tokens), "--restart", "always", *tier_flags)
    with started(f"kvcache-{ratio:g}", args.model, context, False, extra) as server:
        before = prefill_metrics(server)
        turns_done = 0
        for turn in range(args.turns):
            if time.monotonic() > budget_end:
                break
            if args.restart and turn == 1 and not restarted:
                restarted = kill_prefill(server)
                time.sleep(1.0)
                _wait_prefill(server)
            for c in range(conversations):
                if time.monotonic() > budget_end:
                    break
                rng = rngs[c]
                transcripts[c] += [rng.randint(low, high) for _ in range(args.question_tokens)]
                ttft, prompt_tokens, cached = stream_turn(server, args.model, transcripts[c],
                                                          args.answer_tokens)
                transcripts[c] += [rng.randint(low, high) for _ in range(args.answer_tokens)]
                if turn == 0:
                    cold.append(ttft)
                else:
                    warm.append(ttft)
                    warm_prompt += prompt_tokens
                    warm_cached += cached
                    if restarted and turn == 1:
                        after_restart.append(ttft)
            turns_done = turn + 1
        after = prefill_metrics(server)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result: dict[str, object] = {
        "conversations": conversations, "turns": turns_done,
        "working_set_tokens": conversations * args.doc_tokens,
        "cold_ttft_s": _median(cold), "warm_ttft_s": _median(warm),
        "warm_over_cold": (_median(warm) / _median(cold)) if cold and warm else None,
        "warm_cached_share": warm_cached / warm_prompt if warm_prompt else None,
        "requests": len(cold) + len(warm)}
    if args.restart:
        result["after_restart_ttft_s"] = _median(after_restart)
        result["after_restart_over_cold"] = (_median(after_restart) / _median(cold)
                                             if cold and after_restart else None)
    for tier in TIERS:
        loaded = delta.get(f"loaded_bytes_total:{tier}", 0.0)
        hits = delta.get(f"hits_total:{tier}", 0.0)
        if hits or loaded:
            result[f"{tier}_hits"] = hits
            result[f"{tier}_loaded_mib"] = loaded / 2**20
    seconds = delta.get("pdmesh:kv_tier_load_seconds_sum", 0.0)
    if seconds:
        total = sum(delta.get(f"loaded_bytes_total:{t}", 0.0) for t in TIERS)
        result["load_gib_per_s"] = total / seconds / 2**30
    return result


def _wait_prefill(server: Server, timeout_s: float = 120.0) -> None:
    """Until the restarted prefill worker answers /ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        port = server_prefill_port(server)
        if port is not None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                    time.sleep(2.0)  # admission hears its heartbeat again
                    return
            except OSError:
                pass
        time.sleep(0.25)
    raise RuntimeError("the prefill worker did not come back after the restart")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench kvcache")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--kv-tokens", type=int, default=8192, help="one pool, in tokens")
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--question-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--ratios", default="0.5,4,8",
                        help="working sets, in pools (comma-separated)")
    parser.add_argument("--tiers", default="host,disk,remote",
                        help="host, disk, remote (comma-separated) or none")
    parser.add_argument("--host-tokens", type=int, default=0,
                        help="tier 1's size in tokens (0: the worker's default)")
    parser.add_argument("--restart", action="store_true",
                        help="kill and restart the prefill worker after the first round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=900.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    tiers = [t for t in args.tiers.split(",") if t and t != "none"]
    if any(t not in TIERS for t in tiers):
        parser.error(f"--tiers: each of {', '.join(TIERS)}, or none")
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r]
    except ValueError:
        parser.error("--ratios: numbers, comma-separated")
    if not ratios or min(ratios) <= 0 or args.turns < 2 or args.doc_tokens < 1:
        parser.error("--ratios must be > 0, --turns >= 2, --doc-tokens >= 1")
    report: dict[str, object] = {"bench": "kvcache", "model": args.model,
                                 "kv_tokens": args.kv_tokens, "doc_tokens": args.doc_tokens,
                                 "tiers": tiers or ["none"], "restart": args.restart,
                                 "load_avg_start": os.getloadavg()[0]}
    budget_end = time.monotonic() + args.budget_s
    for ratio in ratios:
        if time.monotonic() > budget_end:
            report[f"x{ratio:g}"] = "skipped: budget"
            continue
        with contextlib.ExitStack() as stack:  # each mesh its own, empty tiers
            host = (args.host_tokens or 131072) if "host" in tiers else 0
            flags = ["--kv-host-tokens", str(host)]
            if "disk" in tiers:
                flags += ["--kv-disk-dir", stack.enter_context(
                    tempfile.TemporaryDirectory(prefix="pdmesh-kvbench-disk-"))]
            if "remote" in tiers:
                flags += ["--kv-remote-url", stack.enter_context(redis_store())]
            report[f"x{ratio:g}"] = run_ratio(args, ratio, budget_end, tuple(flags))
        print(f"x{ratio:g}: {json.dumps(report[f'x{ratio:g}'])}", file=sys.stderr, flush=True)
    report["load_avg_end"] = os.getloadavg()[0]
    print_report(report, args.json, 3)
    return 0
