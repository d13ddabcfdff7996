"""`pdmesh bench llamacpp`: pdmesh side by side with llama.cpp's `llama-server` on the same GGUF.

llama.cpp is the peer the engine is judged against, never a dependency: the bench builds
`llama-server` at run time from the llama.cpp source vendored in the `llama-cpp-python`
sdist on PyPI (`pip download --no-deps --no-binary :all: llama-cpp-python`; CMake, CPU only,
`GGML_NATIVE`, no curl, Release, the `llama-server` target alone, under `nice -n 19`) and
keeps the binary in `$PDMESH_CACHE_DIR/llamacpp/<sdist version>/llama-server` (default
`~/.cache/pdmesh`), so later runs reuse it without the network. A build takes about ten
minutes on two cores; `--build-only` does just that, `--no-build` refuses to build (a clear
error when no binary is cached), `--llama-server PATH` uses a binary of your own.

One run starts `llama-server` on the model's GGUF (`smollm2`: the SmolLM2-135M-Instruct Q4_1
file `checkpoint.resolve` fetches; flags `--llama-args`, default `-t 2 -c 16384 -np 4 -kvu`:
two threads, four slots sharing one 16k-token KV pool, as pdmesh's workers share theirs)
and pdmesh's default mesh on the same model (`pdmesh up`: admission, one prefill and one
decode worker, the KV over tcp; with `--colocated` also a colocated mesh). One client, the
load tester's own (`loadtest.client.exchange`: streamed `/v1/completions`, SSE), sends
both the same requests: the prompt as token ids (the same count on both sides, checked
against each server's `usage.prompt_tokens`), greedy, `ignore_eos` so each reply is exactly
`max_tokens` long (checked against `usage.completion_tokens`). Per workload
(`--workloads`, default `1024/64@1,256/64@4,4096/32@1`: prompt tokens / output tokens @
concurrency) each run draws fresh random prompts (no prefix-cache hit on either side) and
the servers take turns, each going first in turn, one run's requests all in flight at
once. Per run and server: TTFT (send to first text chunk, median over the run's requests),
ITL (gaps between text chunks, median over the run's gaps), TPOT ((E2E - TTFT) / (tokens -
1), median) and output throughput (output tokens of the run / its wall time). The report,
one flat JSON object (the last stdout line with `--json`):

- `<metric>_<workload>_<server>`: the median over runs, for metric `ttft_s`, `itl_s`,
  `tpot_s`, `output_tok_s` and server `pdmesh`, `llamacpp` (and `colocated`);
- `<metric>_ratio_<workload>`: pdmesh / llamacpp of those medians (`..._colocated`: the
  colocated mesh's). Above 1 is slower for the times, faster for `output_tok_s`;
- `prompt_tokens_<workload>_<server>`, `chunks_per_token_<workload>_<server>` (text
  chunks / output tokens, the lowest run's: below 1, some chunks carried several tokens and
  the ITL counts their gaps only), `runs_<workload>` (runs done), `error_<workload>`
  for a workload that failed (exit status 1), `skipped` (workloads the budget left out);
- the machine's load average at the start and the end, the binary, its version line, the
  llama.cpp flags it ran with, the GGUF; `llama_restarted` when llama-server was killed by a
  signal before it was ready and runs with `--no-repack` added (`start_llama_server`: a VM
  that reports AMX yet faults on its tile instructions).

Bounded: every request has a client timeout, no run starts after `--budget-s`, the build has
its own timeout; the servers are stopped (llama-server's process group killed, `pdmesh up`
interrupted) however the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pdmesh.loadtest.bench import print_report
from pdmesh.loadtest.bench.disagg import API_KEY, MODEL_CONTEXT, TOKEN_RANGE, started
from pdmesh.loadtest.client import ClientConfig, Reply, exchange
from pdmesh.services.engine import checkpoint
from pdmesh.services.ops.launcher import free_port

SDIST = "llama-cpp-python"
SERVER = "llama-server"
DEFAULT_LLAMA_ARGS = "-t 2 -c 16384 -np 4 -kvu"
NO_REPACK = "--no-repack"
DEFAULT_WORKLOADS = "1024/64@1,256/64@4,4096/32@1"
METRICS = ("ttft_s", "itl_s", "tpot_s", "output_tok_s")
REFERENCE = "llamacpp"
PDMESH = "pdmesh"
COLOCATED = "colocated"
READY_TIMEOUT_S = 180.0
WARMUP_TIMEOUT_S = 120.0
REQUEST_GRACE_S = 300.0  # past the budget, a started run still gets this long
PIP_TIMEOUT_S = 900.0
STOP_WAIT_S = 15.0
# CPU only, no network at build or run time, the server target alone, linked statically so
# the one binary is all the cache keeps.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DGGML_CUDA=OFF")


class Missing(Exception):
    """No llama-server to run, and the bench was told not to build one."""


class Crashed(RuntimeError):
    """llama-server was killed by a signal before it was ready."""


# -- building llama-server -----------------------------------------------------------------------
def llamacpp_cache() -> Path:
    return checkpoint.cache_dir() / "llamacpp"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", version))


def cached_servers(cache: Path | None = None) -> list[tuple[str, Path]]:
    """(sdist version, binary) of every llama-server built so far, newest version last."""
    cache = cache or llamacpp_cache()
    found = [(d.name, d / SERVER) for d in cache.glob("*") if d.is_dir()
             and (d / SERVER).is_file() and os.access(d / SERVER, os.X_OK)]
    return sorted(found, key=lambda item: _version_key(item[0]))


def _nice() -> list[str]:
    return ["nice", "-n", "19"] if shutil.which("nice") else []


def _run_logged(cmd: list[str], log: Path, timeout_s: float, what: str) -> None:
    with open(log, "ab") as out:
        out.write(("$ " + shlex.join(cmd) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except BaseException:  # timeout, Ctrl-C: nothing of the build outlives it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{what} failed (exit {code}); log {log}:\n" + "\n".join(tail))


def download_sdist(version: str | None, cache: Path) -> Path:
    """The llama-cpp-python sdist (the given version, else PyPI's newest), kept in
    `cache/sdist`."""
    sdists = cache / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    if version:
        kept = sdists / f"llama_cpp_python-{version}.tar.gz"
        if kept.is_file():
            return kept
    spec = f"{SDIST}=={version}" if version else SDIST
    with tempfile.TemporaryDirectory(prefix="pip-", dir=cache) as tmp:
        print(f"bench llamacpp: pip download {spec} (source)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", spec, "-d", tmp], check=True, stdout=subprocess.DEVNULL,
                       timeout=PIP_TIMEOUT_S)
        got = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not got:
            raise RuntimeError(f"pip download {spec} produced no sdist")
        return Path(shutil.move(str(got[0]), sdists / got[0].name))


def sdist_version(sdist: Path) -> str:
    return sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")


def _extract_llama_cpp(sdist: Path, into: Path) -> Path:
    """Unpack the sdist's vendor/llama.cpp only; its directory."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        if not members:
            raise RuntimeError(f"{sdist.name} has no vendor/llama.cpp")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, members=members, **kwargs)
    found = list(into.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise RuntimeError(f"{sdist.name}: vendor/llama.cpp has no CMakeLists.txt")
    return found[0].parent


def build_llama_server(version: str | None = None, jobs: int = 2,
                       timeout_s: float = 3600.0) -> tuple[str, Path]:
    """(sdist version, binary): llama-server built from the sdist's vendored llama.cpp
    (once per version; a lock makes a concurrent build wait for this one)."""
    cache = llamacpp_cache()
    sdist = download_sdist(version, cache)
    version = sdist_version(sdist)
    work = cache / version
    target = work / SERVER
    work.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            return version, target
        src, build, log = work / "src", work / "build", work / "build.log"
        found = list(src.glob("*/vendor/llama.cpp/CMakeLists.txt"))
        llama_cpp = found[0].parent if found else _extract_llama_cpp(sdist, src)
        print(f"bench llamacpp: building {SERVER} {version} (CPU, -j{jobs}, nice 19; about "
              f"10 min on 2 cores; log {log})", file=sys.stderr, flush=True)
        started_at = time.monotonic()
        _run_logged([*_nice(), "cmake", "-S", str(llama_cpp), "-B", str(build), *CMAKE_FLAGS],
                    log, timeout_s, "cmake configure")
        left = timeout_s - (time.monotonic() - started_at)
        _run_logged([*_nice(), "cmake", "--build", str(build), "--config", "Release",
                     "--target", SERVER, f"-j{jobs}"], log, max(left, 1.0), "cmake build")
        built = build / "bin" / SERVER
        if not built.is_file():
            raise RuntimeError(f"the build left no {built}")
        staged = work / f"{SERVER}.{os.getpid()}.part"
        shutil.copy2(built, staged)
        staged.replace(target)
        print(f"bench llamacpp: built {target} in {time.monotonic() - started_at:.0f}s",
              file=sys.stderr, flush=True)
        shutil.rmtree(src, ignore_errors=True)  # the binary is linked statically
        shutil.rmtree(build, ignore_errors=True)
    return version, target


def find_llama_server(explicit: str | None, version: str | None, build: bool, jobs: int,
                      timeout_s: float) -> tuple[str, Path]:
    """(version, binary) to run: `explicit`, else the cached build (of `version`, else the
    newest), else a fresh build unless `build` is False (then Missing)."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise Missing(f"--llama-server {explicit}: no executable file there")
        return "external", path
    cached = [(v, p) for v, p in cached_servers() if version in (None, v)]
    if cached:
        return cached[-1]
    if not build:
        wanted = f" {version}" if version else ""
        raise Missing(f"no {SERVER}{wanted} built in {llamacpp_cache()} and --no-build "
                      "given: run without --no-build to build it (about 10 min on 2 cores; "
                      "or `--build-only`), or pass --llama-server PATH")
    return build_llama_server(version, jobs, timeout_s)


def server_version(binary: Path) -> str:
    """llama-server's own version line (`--version`), or '' when it does not say."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln]
    return lines[0].strip() if lines else ""


# -- llama-server as a child ---------------------------------------------------------------------
@dataclass
class LlamaServer:
    proc: subprocess.Popen[bytes]
    port: int
    log: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    reader: threading.Thread | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.root + "/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False


@contextlib.contextmanager
def llama_server_started(binary: Path, gguf: Path, args: Sequence[str],
                         ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[LlamaServer]:
    """llama-server on a free loopback port, until its /health says the model is loaded;
    its process group is killed on the way out."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = LlamaServer(proc, port)

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            server.log.append(raw.decode(errors="replace").rstrip())

    server.reader = threading.Thread(target=pump, daemon=True)
    server.reader.start()
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not server.healthy():
            if proc.poll() is not None or time.monotonic() > deadline:
                if proc.returncode is not None:  # its last words: the reader runs to EOF
                    server.reader.join(5)
                tail = "\n".join(list(server.log)[-20:])
                if proc.returncode is not None and proc.returncode < 0:
                    raise Crashed(f"{SERVER} was killed by signal {-proc.returncode} before "
                                  f"it was ready ({shlex.join(cmd)}):\n{tail}")
                raise RuntimeError(f"{SERVER} did not start ({shlex.join(cmd)}):\n{tail}")
            time.sleep(0.25)
        yield server
    finally:
        _stop_group(proc)
        server.reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()


def start_llama_server(stack: contextlib.ExitStack, binary: Path, gguf: Path,
                       args: Sequence[str]) -> tuple[LlamaServer, list[str], str]:
    """llama-server entered on `stack`: the server, the flags it runs with, and why they
    differ from `args` ('' when they do not).

    llama.cpp's CPU backend puts weights in layouts of its own where the CPU offers them
    (repacked blocks, AMX tiles); a virtual machine can report a feature whose instructions
    then fault (AMX under some hypervisors: SIGSEGV on the first matmul of the warm-up).
    Killed by a signal before it was ready, llama-server is started once more with
    `--no-repack`, which leaves those layouts out."""
    try:
        return stack.enter_context(llama_server_started(binary, gguf, args)), list(args), ""
    except Crashed as exc:
        if NO_REPACK in args or "-nr" in args:
            raise
        why = str(exc).splitlines()[0].rstrip(":")
        print(f"pdmesh bench llamacpp: {why}; starting it again with {NO_REPACK}",
              file=sys.stderr, flush=True)
        again = [*args, NO_REPACK]
        return stack.enter_context(llama_server_started(binary, gguf, again)), again, why


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# -- workloads and the client --------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    max_tokens: int
    concurrency: int

    @property
    def label(self) -> str:
        n = self.prompt_tokens
        size = f"{n // 1024}k" if n % 1024 == 0 else str(n)
        return f"{size}_{self.max_tokens}_c{self.concurrency}"


def parse_workloads(text: str) -> list[Workload]:
    """`1024/64@1,256/64@4`: prompt tokens / output tokens @ concurrency. ValueError."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"(\d+)/(\d+)@(\d+)", item)
        if not match:
            raise ValueError(f"workload {item!r}: expected PROMPT/OUT@CONCURRENCY, e.g. "
                             "1024/64@1")
        wl = Workload(*(int(g) for g in match.groups()))
        if wl.prompt_tokens < 1 or wl.max_tokens < 2 or wl.concurrency < 1:
            raise ValueError(f"workload {item!r}: prompt >= 1, output >= 2 (an ITL needs two "
                             "tokens), concurrency >= 1")
        out.append(wl)
    if len({wl.label for wl in out}) != len(out):
        raise ValueError("workloads repeat")
    return out


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server the client sends to."""

    label: str
    base_url: str  # ends in /v1
    model: str
    api_key: str | None = None


@dataclass(frozen=True)
class RunFigures:
    ttft_s: float
    itl_s: float
    tpot_s: float
    output_tok_s: float
    prompt_tokens: int | None
    chunks_per_token: float  # text chunks / tokens: 1.0 when every token is its own chunk


def _check(label: str, reply: Reply, prompt_len: int, max_tokens: int) -> None:
    if reply.transport_error or reply.status != 200 or reply.stream_error or not reply.done:
        raise RuntimeError(f"{label}: request failed (status {reply.status}, "
                           f"{reply.transport_error or 'no transport error'}): "
                           f"{reply.error[:300] or 'stream ended early'}")
    made = reply.completion_tokens if reply.completion_tokens is not None else reply.chunks
    if made != max_tokens:
        raise RuntimeError(f"{label}: generated {made} tokens, not {max_tokens} (ignore_eos)")
    if reply.prompt_tokens is not None and reply.prompt_tokens != prompt_len:
        raise RuntimeError(f"{label}: counted {reply.prompt_tokens} prompt tokens, sent "
                           f"{prompt_len}")
    if reply.chunks < 2:
        raise RuntimeError(f"{label}: {reply.chunks} text chunk(s): no inter-token gap")


async def one_run(session: aiohttp.ClientSession, endpoint: Endpoint,
                  prompts: list[list[int]], max_tokens: int, timeout_s: float) -> RunFigures:
    """All of `prompts` sent at once to `endpoint`, streamed; the run's figures."""
    cfg = ClientConfig(endpoint.base_url, endpoint.model, stream=True, temperature=0.0,
                       ignore_eos=True, request_timeout_s=timeout_s)
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    start = time.perf_counter()
    replies = await asyncio.gather(*(exchange(session, cfg, p, max_tokens, headers,
                                              stop_at_error=True) for p in prompts))
    wall = time.perf_counter() - start
    for reply, prompt in zip(replies, prompts, strict=True):
        _check(endpoint.label, reply, len(prompt), max_tokens)
    tokens = [r.completion_tokens or r.chunks for r in replies]
    return RunFigures(
        ttft_s=statistics.median(r.ttft_s for r in replies),
        itl_s=statistics.median(gap for r in replies for gap in r.itls_s),
        tpot_s=statistics.median((r.e2e_s - r.ttft_s) / (n - 1)
                                 for r, n in zip(replies, tokens, strict=True)),
        output_tok_s=sum(tokens) / wall,
        prompt_tokens=replies[0].prompt_tokens,
        chunks_per_token=sum(r.chunks for r in replies) / sum(tokens))


def summarize(workload: Workload, figures: dict[str, list[RunFigures]],
              report: dict[str, object]) -> None:
    """Medians over runs per server, and each other server's / llamacpp's."""
    key = workload.label
    medians = {label: {m: statistics.median(getattr(r, m) for r in runs) for m in METRICS}
               for label, runs in figures.items()}
    for label, runs in figures.items():
        for metric, value in medians[label].items():
            report[f"{metric}_{key}_{label}"] = value
        report[f"prompt_tokens_{key}_{label}"] = runs[0].prompt_tokens
        report[f"chunks_per_token_{key}_{label}"] = min(r.chunks_per_token for r in runs)
    report[f"runs_{key}"] = min(len(runs) for runs in figures.values())
    ref = medians.get(REFERENCE)
    for label in [label for label in medians if ref and label != REFERENCE]:
        assert ref is not None
        suffix = "" if label == PDMESH else f"_{label}"
        for metric in METRICS:
            report[f"{metric}_ratio_{key}{suffix}"] = (
                medians[label][metric] / ref[metric] if ref[metric] > 0 else None)


async def bench(endpoints: Sequence[Endpoint], workloads: Sequence[Workload], runs: int,
                token_range: tuple[int, int], budget_end: float, report: dict[str, object],
                skipped: list[str], seed: int = 0) -> None:
    """Each workload `runs` times, the endpoints taking turns (each first in turn), fresh
    random token-id prompts each run, the same to every endpoint; figures into `report`."""
    rng = random.Random(f"bench-llamacpp-{seed}")
    low, high = token_range
    # A fresh connection per request: a pooled one that the server closed while idle
    # (cpp-httplib's keep-alive timeout is 5 s) would fail the next request sent on it.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)
                                     ) as session:
        for endpoint in endpoints:  # first calls pay for lazy set-up: not measured
            await one_run(session, endpoint, [[rng.randint(low, high) for _ in range(32)]],
                          4, WARMUP_TIMEOUT_S)
        for wl in workloads:
            if time.monotonic() > budget_end:
                skipped.append(wl.label)
                continue
            figures: dict[str, list[RunFigures]] = {e.label: [] for e in endpoints}
            try:
                for run in range(runs):
                    if run and time.monotonic() > budget_end:
                        break
                    prompts = [[rng.randint(low, high) for _ in range(wl.prompt_tokens)]
                               for _ in range(wl.concurrency)]
                    k = run % len(endpoints)
                    for endpoint in [*endpoints[k:], *endpoints[:k]]:
                        timeout_s = max(budget_end - time.monotonic(), 0.0) + REQUEST_GRACE_S
                        figures[endpoint.label].append(await one_run(
                            session, endpoint, prompts, wl.max_tokens, timeout_s))
            except RuntimeError as exc:  # this workload failed; the next may not
                print(f"pdmesh bench llamacpp: {wl.label}: {exc}", file=sys.stderr, flush=True)
                report[f"error_{wl.label}"] = str(exc).splitlines()[0][:500]
                continue
            summarize(wl, figures, report)
            print("bench llamacpp: " + wl.label + ": " + ", ".join(
                f"{label} TTFT {statistics.median(f.ttft_s for f in runs_):.3f}s ITL "
                f"{statistics.median(f.itl_s for f in runs_) * 1000:.1f}ms"
                for label, runs_ in figures.items()), file=sys.stderr, flush=True)


# -- the command ---------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pdmesh bench llamacpp",
        description="pdmesh vs llama.cpp's llama-server on the same GGUF, same client and "
                    "workloads, the servers taking turns: TTFT, ITL, TPOT, output "
                    "throughput and their ratios.")
    add = parser.add_argument
    add("--model", default="smollm2", help="a GGUF model spec both serve (default smollm2)")
    add("--workloads", default=DEFAULT_WORKLOADS,
        help="comma-separated PROMPT/OUT@CONCURRENCY in tokens (default %(default)s)")
    add("--runs", type=int, default=3, help="runs per workload and server; medians reported")
    add("--budget-s", type=float, default=1200.0,
        help="no run starts after this many seconds (default %(default)s)")
    add("--llama-args", default=DEFAULT_LLAMA_ARGS,
        help="llama-server flags besides model, host and port (default %(default)r)")
    add("--colocated", action="store_true",
        help="also run a colocated pdmesh (`pdmesh up --colocated`) in the turns")
    add("--llama-server", default=None, help="a llama-server binary to use (no build)")
    add("--llama-cpp-python-version", default=None,
        help="the llama-cpp-python sdist to build from (default: cached, else PyPI's newest)")
    add("--no-build", action="store_true", help="fail when no llama-server is cached")
    add("--build-only", action="store_true", help="build (or find) llama-server, print it")
    add("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    add("--build-timeout-s", type=float, default=3600.0)
    add("--seed", type=int, default=0, help="seed of the random prompts")
    add("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        args.workload_list = parse_workloads(args.workloads)
        args.llama_arg_list = shlex.split(args.llama_args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.runs < 1 or args.budget_s <= 0 or args.build_jobs < 1:
        parser.error("--runs >= 1, --budget-s > 0, --build-jobs >= 1")
    if args.model == "tiny":
        parser.error("--model: llama.cpp needs a GGUF (smollm2 or a .gguf file); tiny has none")
    return args


def _on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(143)  # unwinds the with-blocks: every server is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        version, binary = find_llama_server(args.llama_server, args.llama_cpp_python_version,
                                            not args.no_build, args.build_jobs,
                                            args.build_timeout_s)
    except Missing as exc:
        print(f"pdmesh bench llamacpp: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"pdmesh bench llamacpp: could not build {SERVER}: {exc}", file=sys.stderr)
        return 1
    if args.build_only:
        print(binary)
        return 0
    source = checkpoint.resolve(args.model)
    if source.kind != "gguf" or source.path is None:
        print(f"pdmesh bench llamacpp: --model {args.model} is not a GGUF", file=sys.stderr)
        return 2
    context = MODEL_CONTEXT.get(args.model, max(wl.prompt_tokens + wl.max_tokens
                                                 for wl in args.workload_list))
    too_long = [wl.label for wl in args.workload_list
                if wl.prompt_tokens + wl.max_tokens > context]
    if too_long:
        print(f"pdmesh bench llamacpp: workloads {', '.join(too_long)} exceed the "
              f"{context}-token context", file=sys.stderr)
        return 2
    started_at = time.monotonic()
    report: dict[str, object] = {
        "load_avg_1m_start": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "model": args.model, "gguf": str(source.path), "llama_server": str(binary),
        "llama_cpp_python_version": version, "llama_server_version": server_version(binary),
        "llama_args": args.llama_args, "workloads": args.workloads, "runs": args.runs}
    skipped: list[str] = []
    try:
        with contextlib.ExitStack() as stack:
            llama, llama_args, restarted = start_llama_server(stack, binary, source.path,
                                                              args.llama_arg_list)
            report["llama_args"] = shlex.join(llama_args)
            if restarted:
                report["llama_restarted"] = restarted[:500]
            endpoints = [Endpoint(REFERENCE, llama.root + "/v1", source.name)]
            mesh = stack.enter_context(started(PDMESH, args.model, context, False))
            endpoints.insert(0, Endpoint(PDMESH, mesh.root + "/v1", source.name, API_KEY))
            if args.colocated:
                colo = stack.enter_context(started(COLOCATED, args.model, context, True))
                endpoints.append(Endpoint(COLOCATED, colo.root + "/v1", source.name, API_KEY))
            report["servers_ready_s"] = time.monotonic() - started_at
            asyncio.run(bench(endpoints, args.workload_list, args.runs,
                              TOKEN_RANGE.get(args.model, (200, 1000)),
                              started_at + args.budget_s, report, skipped, args.seed))
    except RuntimeError as exc:  # a server that did not start, a warm-up that failed
        print(f"pdmesh bench llamacpp: {exc}", file=sys.stderr, flush=True)
        report["error"] = str(exc).splitlines()[0][:500]
    report.update(load_avg_1m_end=os.getloadavg()[0], skipped=skipped,
                  wall_s=time.monotonic() - started_at)
    print_report(report, args.json, 4)
    return 1 if any(key.startswith("error") for key in report) else 0


if __name__ == "__main__":
    sys.exit(main())
