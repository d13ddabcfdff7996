"""`pdmesh bench serving`: what a served token costs beyond the engine step that makes it.

One run starts a mesh (`pdmesh up`: one prefill and one decode worker) and a colocated mesh
(`pdmesh up --colocated`) of the same model, and loads the same model in this process with
an engine of its own. Then, in turns (each turn: the in-process engine first, then each
mesh, the order of the meshes alternating), it measures:

- the in-process decode step at batch 1 (`Engine.decode_step` over a paged lease holding
  a `--prompt-len` prompt, for `--max-tokens` steps: the contexts a served request decodes
  at), and with the greedy pick of the sampler the mesh runs (`step_ms`, `step_sample_ms`),
  on as many threads as the meshes' decode steps (`PDMESH_DECODE_TORCH_THREADS`, else
  `PDMESH_TORCH_THREADS`, else `pdmesh up`'s default, the cores less one: `torch_threads`);
- the CPU time of those steps (`step_cpu_ms`: this process, every thread, per step);
- one streamed completion per mesh at concurrency 1 (`--prompt-len` random prompt tokens,
  `--max-tokens` output tokens, greedy, `ignore_eos`): the gaps between its SSE chunks as
  this client reads them (`itl_ms_<mesh>`: median over every gap of every run; the first
  chunk is time to first token, not a gap).

It reports `itl_over_step_<mesh>` (served ITL / in-process step: what the serving path
adds, 1.0 = none; target <= 1.2), `cpu_over_step_<mesh>` (`cpu_ms_per_token_<mesh>`, the CPU
time of every process of the mesh per output token, from /proc: a `--max-tokens` request's
less a 1-token request's on another prompt of the same length, over the tokens between;
/ `step_cpu_ms`: the CPU the serving path adds, which a loaded machine moves much less than
the wall-clock ITL), the medians, each mesh's gateway ITL histogram mean
(`gateway_itl_ms_<mesh>`), the runs done, the machine's load average at the start and end
and the core count. The step is timed while the meshes are idle, in the same turns as the
requests, so the machine's load falls on both alike; on a loaded machine take the median
of a few runs. Bounded: `--runs` turns, none started after `--budget-s`. The last stdout
line is one JSON object (`--json`); the exit status is 1 when a mesh failed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import statistics
import sys
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.loadtest.bench import print_report
from pdmesh.loadtest.bench.disagg import API_KEY, TOKEN_RANGE, Server, started
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.runner import DecodeSlot, Engine, make_pool
from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.ops.cli import up_decode_threads

ITL = "pdmesh:inter_token_latency_seconds"
REQUEST_TIMEOUT_S = 300.0
TARGET = 1.2


def stream_gaps(server: Server, model: str, prompt: list[int], max_tokens: int,
                timeout_s: float) -> list[float]:
    """One streamed completion; the seconds between its SSE data chunks (after the
    first), read as they arrive."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json",
                              "Authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{server.label}: HTTP {resp.status}: "
                               f"{resp.read()[:300].decode(errors='replace')}")
        times: list[float] = []
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                if line.startswith(b"data: [DONE]"):
                    break
                if b'"error"' in line[:20]:
                    raise RuntimeError(f"{server.label}: {line[:300].decode(errors='replace')}")
                times.append(time.perf_counter())
    finally:
        conn.close()
    return [b - a for a, b in zip(times, times[1:], strict=False)]


class InProcess:
    """The model on an engine of this process: batch-1 decode steps over a prompt's KV."""

    def __init__(self, model: str, prompt_len: int, max_tokens: int) -> None:
        # The threads the meshes' decode steps run on (`pdmesh up` gets the same
        # environment): the step they are measured against is the same step.
        threads = next((int(v) for v in (os.environ.get(name, "").strip()
                                         for name in ("PDMESH_DECODE_TORCH_THREADS",
                                                      "PDMESH_TORCH_THREADS"))
                        if v.isdigit() and int(v) > 0), up_decode_threads())
        torch.set_num_threads(threads)
        self.loaded = load_model(model)
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        pages = (prompt_len + max_tokens + 16) // 16 + 2
        self.pool = make_pool(self.loaded, num_pages=pages, page_tokens=16)
        self.engine = Engine(self.loaded, self.pool)

    def steps(self, prompt: list[int]) -> tuple[list[float], list[float], float]:
        """Seconds of each decode step, of each step with its greedy pick, and the CPU
        seconds (this process, every thread) of one step with its pick, on average."""
        pool, engine = self.pool, self.engine
        lease = pool.allocate("bench-serving", self.prompt_len + self.max_tokens + 1)
        try:
            greedy = Sampler(SamplingParams(max_tokens=self.max_tokens))  # the mesh's pick
            token = greedy.sample(engine.prefill(lease, prompt))
            step_s, sampled_s = [], []
            cpu = time.process_time()
            for i in range(self.max_tokens - 1):
                started_at = time.perf_counter()
                logits = engine.decode_step([DecodeSlot(lease, token, self.prompt_len + i)])
                stepped_at = time.perf_counter()
                token = greedy.sample(logits[0])
                step_s.append(stepped_at - started_at)
                sampled_s.append(time.perf_counter() - started_at)
            return step_s, sampled_s, (time.process_time() - cpu) / len(step_s)
        finally:
            pool.release(lease, "bench")


def _gateway_itl(server: Server) -> tuple[float, float]:
    """The gateway's ITL histogram: (sum, count) over its series."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=30) as resp:
        text = resp.read().decode()
    total = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for suffix in total:
                if sample.name == ITL + suffix:
                    total[suffix] += sample.value
    return total["_sum"], total["_count"]


def run(args: argparse.Namespace, report: dict[str, object]) -> None:
    context = args.prompt_len + args.max_tokens + 16
    low, high = TOKEN_RANGE.get(args.model, (200, 1000))
    rng = random.Random(f"serving-{args.model}")
    budget_end = time.monotonic() + args.budget_s
    engine = InProcess(args.model, args.prompt_len, args.max_tokens)
    with contextlib.ExitStack() as stack:
        meshes = [stack.enter_context(started(label, args.model, context, colocated))
                  for label, colocated in (("mesh", False), ("colocated", True))
                  if label in args.meshes]
        for server in meshes:  # first calls pay for lazy set-up: not measured
            stream_gaps(server, args.model, [rng.randint(low, high)
                                             for _ in range(min(64, args.prompt_len))], 2,
                        REQUEST_TIMEOUT_S)
        engine.steps([rng.randint(low, high) for _ in range(args.prompt_len)])
        steps: list[float] = []
        sampled: list[float] = []
        step_cpu: list[float] = []
        token_cpu: dict[str, list[float]] = {s.label: [] for s in meshes}
        gaps: dict[str, list[float]] = {s.label: [] for s in meshes}
        per_run: dict[str, list[float]] = {s.label: [] for s in meshes}
        itl_sum: dict[str, float] = {s.label: 0.0 for s in meshes}
        itl_count: dict[str, float] = {s.label: 0.0 for s in meshes}
        done = 0
        for turn in range(args.runs):
            if time.monotonic() > budget_end:
                break
            prompt = [rng.randint(low, high) for _ in range(args.prompt_len)]
            step_s, sampled_s, cpu_s = engine.steps(prompt)
            steps += step_s
            sampled += sampled_s
            step_cpu.append(cpu_s)
            order = meshes if turn % 2 == 0 else meshes[::-1]
            for server in order:
                # The CPU a token costs the mesh: a request of max_tokens less one of 1
                # token (another prompt of the same length: no prefix-cache hit), per token.
                cpu = server.cpu_s()
                stream_gaps(server, args.model, [rng.randint(low, high)
                                                 for _ in range(args.prompt_len)], 1,
                            REQUEST_TIMEOUT_S)
                prefill_cpu = server.cpu_s() - cpu
                before = _gateway_itl(server)
                cpu = server.cpu_s()
                got = stream_gaps(server, args.model, prompt, args.max_tokens,
                                  REQUEST_TIMEOUT_S)
                token_cpu[server.label].append((server.cpu_s() - cpu - prefill_cpu)
                                               / (args.max_tokens - 1))
                after = _gateway_itl(server)
                gaps[server.label] += got
                per_run[server.label].append(statistics.median(got) if got else 0.0)
                itl_sum[server.label] += after[0] - before[0]
                itl_count[server.label] += after[1] - before[1]
            done += 1
    if not done:
        raise RuntimeError("no turn ran within --budget-s")
    step_ms = 1000 * statistics.median(steps)
    step_cpu_ms = 1000 * statistics.median(step_cpu)
    report.update(model=engine.loaded.name, prompt_tokens=args.prompt_len,
                  output_tokens=args.max_tokens, runs=done,
                  torch_threads=torch.get_num_threads(), step_ms=step_ms,
                  step_sample_ms=1000 * statistics.median(sampled),
                  step_cpu_ms=step_cpu_ms)
    for label, got in gaps.items():
        itl_ms = 1000 * statistics.median(got) if got else None
        report[f"itl_ms_{label}"] = itl_ms
        report[f"itl_over_step_{label}"] = itl_ms / step_ms if itl_ms else None
        report[f"itl_ms_runs_{label}"] = [round(1000 * v, 3) for v in per_run[label]]
        report[f"gateway_itl_ms_{label}"] = (1000 * itl_sum[label] / itl_count[label]
                                             if itl_count[label] else None)
        report[f"chunks_{label}"] = len(got) + done
        cpu_ms = 1000 * statistics.median(token_cpu[label])
        report[f"cpu_ms_per_token_{label}"] = cpu_ms
        report[f"cpu_over_step_{label}"] = cpu_ms / step_cpu_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench serving",
        description="Served inter-token latency at concurrency 1 (mesh and --colocated) "
                    "against the in-process engine step, measured in the same run.")
    parser.add_argument("--model", default="smollm2", help="default %(default)s")
    parser.add_argument("--prompt-len", type=int, default=512,
                        help="prompt tokens (random ids); default %(default)s")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request; default %(default)s")
    parser.add_argument("--runs", type=int, default=5,
                        help="turns (in-process steps, then one request per mesh); "
                             "default %(default)s")
    parser.add_argument("--meshes", default="mesh,colocated",
                        help="comma-separated, of mesh and colocated; default %(default)s")
    parser.add_argument("--budget-s", type=float, default=600.0,
                        help="no turn starts after this many seconds (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.meshes = [name for name in args.meshes.split(",") if name]
    if (args.runs < 1 or args.prompt_len < 16 or args.max_tokens < 3 or args.budget_s <= 0
            or not args.meshes or set(args.meshes) - {"mesh", "colocated"}):
        parser.error("--runs >= 1, --prompt-len >= 16, --max-tokens >= 3, --budget-s > 0, "
                     "--meshes from mesh,colocated")
    started_at = time.monotonic()
    report: dict[str, object] = {"load_avg_1m_start": os.getloadavg()[0],
                                 "cpu_count": os.cpu_count()}
    failed = False
    try:
        run(args, report)
    except RuntimeError as exc:  # a mesh that did not start, a request that failed
        print(f"pdmesh bench serving: {exc}", file=sys.stderr)
        report["error"] = str(exc).splitlines()[0][:500]
        failed = True
    report.update(load_avg_1m_end=os.getloadavg()[0], wall_s=time.monotonic() - started_at,
                  target_itl_over_step=TARGET)
    print_report(report, args.json, 3)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
