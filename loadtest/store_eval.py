"""The KV tier-3 store candidates, Redis and Mooncake Store, measured the same way on loopback.

For each store: put and get bandwidth of 1, 4, 16 and 64 MiB objects (`--count` of each,
one object held at a time, so the store never holds more than the largest), the latency of
a GET of a 1 MiB object (a tier-3 block of the tiny model; `--latency-gets` of them, p50 and
p99), and the store's own processes at idle (resident memory, CPU over `--idle-s` seconds)
and after the load. The client is a separate process from the store for both: redis-py
against a `redis-server`; for Mooncake a client with no segment of its own against a
`mooncake_master` (with its HTTP metadata server) and a holder process that mounts the
store's memory, over the TCP transport. Prints one JSON object.

The Redis part runs where `import redis` works (the project's venv), the Mooncake part where
`import mooncake.store` works; `--mooncake-python` runs the Mooncake part in another
interpreter (a throwaway venv with `mooncake-transfer-engine-non-cuda`, whose binaries also
need Debian's `libibverbs1`). A part that cannot run reports why instead of figures.

    .venv/bin/python loadtest/store_eval.py --mooncake-python /tmp/mcvenv/bin/python

Standalone on purpose (standard library plus the store's client): the Mooncake venv has no
pdmesh. Figures: docs/benchmarks.md, "Tier-3 store".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

MIB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 20.0
REDIS_MAXMEMORY = "512mb"
MOONCAKE_SEGMENT_BYTES = 512 * MIB  # the holder's share of the store: room for the 64 MiB
MOONCAKE_LEASE_MS = 100  # a read object is leased (not removable) this long; default 10 s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {START_TIMEOUT_S:g} s")


@contextlib.contextmanager
def started(argv: list[str], log: Path, **kwargs) -> Iterator[subprocess.Popen[bytes]]:
    """A store process, its output in `log`; terminated (then killed) on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# -- what the store's processes use -----------------------------------------------------------
def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    # Fields after the command's closing parenthesis: utime and stime are 14 and 15 of stat.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def usage(pids: list[int], idle_s: float) -> dict[str, float]:
    """Resident memory now and the CPU the processes take over `idle_s` of nothing asked."""
    before = sum(cpu_s(p) for p in pids)
    time.sleep(idle_s)
    busy_s = sum(cpu_s(p) for p in pids) - before
    return {"rss_mib": round(sum(rss_mib(p) for p in pids), 1),
            "cpu_percent": round(100 * busy_s / idle_s, 2)}


# -- the one workload both stores run ---------------------------------------------------------
Put = Callable[[str, bytes], None]
Get = Callable[[str], bytes]
Remove = Callable[[str], None]


def run_workload(put: Put, get: Get, remove: Remove, sizes_mib: list[int], count: int,
                 latency_gets: int) -> dict[str, object]:
    """GiB/s of put and get per object size; p50/p99 ms of a 1 MiB GET."""
    bandwidth = {}
    for size_mib in sizes_mib:
        payload = os.urandom(size_mib * MIB)
        put_s = get_s = 0.0
        for i in range(count):
            key = f"store-eval:{size_mib}:{i}"
            t0 = time.perf_counter()
            put(key, payload)
            t1 = time.perf_counter()
            value = get(key)
            t2 = time.perf_counter()
            assert value == payload, f"{key}: {len(value)} bytes back, not the {size_mib} MiB put"
            remove(key)  # one object held at a time
            put_s += t1 - t0
            get_s += t2 - t1
        total_gib = size_mib * count / 1024
        bandwidth[f"{size_mib}MiB"] = {"put_gib_s": round(total_gib / put_s, 3),
                                       "get_gib_s": round(total_gib / get_s, 3)}
    key, payload = "store-eval:latency", os.urandom(MIB)
    put(key, payload)
    get_ms = []
    for _ in range(latency_gets):
        t0 = time.perf_counter()
        value = get(key)
        get_ms.append((time.perf_counter() - t0) * 1000)
        assert len(value) == MIB
    remove(key)
    get_ms.sort()
    return {"bandwidth": bandwidth,
            "get_1mib_ms": {"p50": round(statistics.median(get_ms), 3),
                            "p99": round(get_ms[min(len(get_ms) - 1,
                                                    int(0.99 * len(get_ms)))], 3),
                            "n": latency_gets}}


# -- Redis ------------------------------------------------------------------------------------
def eval_redis(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    try:
        import redis
    except ImportError as exc:
        return {"ran": False, "reason": f"import redis: {exc}"}
    binary = shutil.which("redis-server")
    if binary is None:
        return {"ran": False, "reason": "redis-server is not installed (apt-get install "
                                        "redis-server)"}
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10).stdout.split()[2].removeprefix("v=")
    port = free_port()
    # As compose runs it (maxmemory, allkeys-lru), without persistence (tier 3 is a cache).
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
            "no", "--dir", str(workdir), "--maxmemory", REDIS_MAXMEMORY,
            "--maxmemory-policy", "allkeys-lru"]
    with started(argv, workdir / "redis.log") as proc:
        wait_listening(port, proc, "redis-server")
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
        client.ping()
        idle = usage([proc.pid], args.idle_s)
        figures = run_workload(lambda k, v: client.set(k, v), client.get,
                               lambda k: client.unlink(k), args.sizes_mib, args.count,
                               args.latency_gets)
        after = usage([proc.pid], args.idle_s)
        client.close()
    from redis.utils import HIREDIS_AVAILABLE

    parser = "hiredis" if HIREDIS_AVAILABLE else "python parser"
    return {"ran": True,
            "version": f"redis-server {version}, redis-py {redis.__version__} ({parser})",
            "processes": 1, "ports": 1, **figures, "idle": idle, "after_load": after}


# -- Mooncake Store ---------------------------------------------------------------------------
HOLDER = """\
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print("setup", rc, flush=True)
if rc == 0:
    sys.stdin.read()  # hold the segment until the evaluation closes stdin
"""


def eval_mooncake(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        return {"ran": False, "reason": f"import mooncake.store: {exc}"}
    from importlib import metadata

    version = next((f"{dist} {metadata.version(dist)}" for dist in
                    ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")
                    if _installed(dist)), "mooncake (version unknown)")
    master_bin = Path(sys.executable).parent / "mooncake_master"
    if not master_bin.exists():
        master_bin = Path(shutil.which("mooncake_master") or "mooncake_master")
    rpc_port, meta_port, metrics_port = free_port(), free_port(), free_port()
    metadata_url = f"http://127.0.0.1:{meta_port}/metadata"
    master_addr = f"127.0.0.1:{rpc_port}"
    master_argv = [str(master_bin), f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
                   "--enable_http_metadata_server=true",
                   "--http_metadata_server_host=127.0.0.1",
                   f"--http_metadata_server_port={meta_port}", f"--metrics_port={metrics_port}",
                   f"--default_kv_lease_ttl={MOONCAKE_LEASE_MS}", "--logtostderr"]
    holder_argv = [sys.executable, "-c", HOLDER, metadata_url, str(MOONCAKE_SEGMENT_BYTES),
                   master_addr]
    with started(master_argv, workdir / "master.log") as master:
        wait_listening(rpc_port, master, "mooncake_master")
        wait_listening(meta_port, master, "mooncake_master's metadata server")
        with started(holder_argv, workdir / "holder.log", stdin=subprocess.PIPE) as holder:
            log = workdir / "holder.log"
            deadline = time.monotonic() + START_TIMEOUT_S
            while "setup " not in log.read_text(errors="replace"):
                if holder.poll() is not None or time.monotonic() > deadline:
                    return {"ran": False, "version": version,
                            "reason": "holder did not set up: " + _tail(log)}
                time.sleep(0.1)
            if "setup 0" not in log.read_text(errors="replace"):
                return {"ran": False, "version": version,
                        "reason": "holder setup failed: " + _tail(log)}
            pids = [master.pid, holder.pid]
            idle = usage(pids, args.idle_s)
            store = MooncakeDistributedStore()
            # No segment of its own (0): every put lands in the holder's memory, over TCP.
            buffer_bytes = 2 * max(args.sizes_mib) * MIB + 16 * MIB
            rc = store.setup("127.0.0.1", metadata_url, 0, buffer_bytes, "tcp", "",
                             master_addr)
            if rc != 0:
                return {"ran": False, "version": version, "reason": f"client setup: rc {rc}"}
            figures = run_workload(lambda k, v: _check(store.put(k, v), "put", k),
                                   store.get, lambda k: _remove(store, k), args.sizes_mib,
                                   args.count, args.latency_gets)
            after = usage(pids, args.idle_s)
            store.close()
            holder.stdin.close()
    return {"ran": True, "version": version, "protocol": "tcp",
            "processes": 2, "ports": 3, **figures, "idle": idle, "after_load": after}


def _installed(dist: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _check(rc: int, op: str, key: str) -> None:
    if rc != 0:
        raise RuntimeError(f"mooncake {op} {key}: rc {rc}")


def _remove(store, key: str) -> None:
    """Remove once the read lease (MOONCAKE_LEASE_MS) has passed: a leased object refuses."""
    deadline = time.monotonic() + 5
    while store.remove(key) != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"mooncake remove {key}: still refused after 5 s")
        time.sleep(MOONCAKE_LEASE_MS / 4000)


def _tail(log: Path, lines: int = 5) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


def _mooncake_elsewhere(args: argparse.Namespace) -> dict[str, object]:
    """The Mooncake part run by another interpreter (its own venv), its JSON read back."""
    argv = [args.mooncake_python, __file__, "--only", "mooncake", "--count", str(args.count),
            "--sizes-mib", ",".join(map(str, args.sizes_mib)), "--latency-gets",
            str(args.latency_gets), "--idle-s", str(args.idle_s)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ran": False, "reason": f"{args.mooncake_python}: {exc}"}
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])["mooncake"]
    except (IndexError, ValueError, KeyError, TypeError):
        return {"ran": False, "exit_code": proc.returncode,
                "reason": " | ".join(proc.stderr.strip().splitlines()[-5:])}
    if proc.returncode != 0:
        # Figures printed, then the interpreter failed on its way out (seen: Mooncake's
        # client tearing down after its master had gone): the figures stand, the exit is
        # reported.
        result["exit_code"] = proc.returncode
        result["exit_stderr"] = " | ".join(proc.stderr.strip().splitlines()[-2:])
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20, help="objects of each size")
    parser.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 4, 16, 64])
    parser.add_argument("--latency-gets", type=int, default=200)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument("--mooncake-python", default="",
                        help="an interpreter that imports mooncake.store (else: this one)")
    parser.add_argument("--only", choices=("redis", "mooncake"), default="")
    args = parser.parse_args(argv)
    out: dict[str, object] = {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0],
                              "count": args.count}
    with tempfile.TemporaryDirectory(prefix="pdmesh-store-eval-") as tmp:
        if args.only in ("", "redis"):
            out["redis"] = eval_redis(args, Path(tmp))
        if args.only in ("", "mooncake"):
            out["mooncake"] = (_mooncake_elsewhere(args) if args.mooncake_python
                               else eval_mooncake(args, Path(tmp)))
    out["load_end"] = os.getloadavg()[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
