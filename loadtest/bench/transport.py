"""`pdmesh bench transport [--json] [--kinds tcp,ucx] [--repeat N] [--layout L]`.

For payloads of 1, 16 and 64 MiB (1 MiB pages, checksums on) it measures each transport
beside a raw baseline of the same bytes in the same run and the same process layout: plain
non-blocking socket send/recv for tcp, a bare ucxx `send`/`recv` for ucx. Prints GB/s and
the ratio; with --json the last stdout line is one JSON object: per transport and size
`transport_gbps`, `raw_gbps`, `ratio`, and for ucx also `perftest_gbps`, the native
`ucx_perftest -t tag_bw` (shipped in the libucx wheel) for a message of the same size, run
by the bench with the same `UCX_TLS` (null when the binary is not found), plus
`vs_perftest` (transport_gbps / perftest_gbps), for ucx `perftest_errh_gbps` (the same
with `-e`: endpoints with peer error handling, as ucxx always creates them; UCX then has
no shared-memory lane between processes and moves tag messages over tcp/lo, while plain
`tag_bw` uses zero-copy CMA) and `vs_perftest_errh`, and the machine's load average. Frames are
authenticated as in production (HMAC-SHA256 per header under a per-reservation key):
`mac_us_per_frame` is what one frame's MAC costs (sign + verify, measured in this run)
and each row's `mac_share` that cost over its whole transfer time.

Kinds: any kind `make_transport` builds (`--kinds tcp,ucx,nixl`; one that cannot be built
here is skipped with a note on stderr). The raw baseline is a bare ucxx send/recv for the
kinds that move bytes over UCX (ucx, nixl) when ucxx is importable, else a plain socket.
UCX runs with ucxx's Python futures (`UCXPY_ENABLE_PYTHON_FUTURE=1` unless set otherwise,
as services run: one event loop per process); without them every request `wait()` polls
the event loop. In the process layout each row also has the CPU time per MiB of each side
(`tx_cpu_us_per_mib`, `rx_cpu_us_per_mib`, and `raw_` ones; medians over the runs, all
threads of the process): less sensitive to other load than GB/s, and
`cpu_bound_ratio` = max(raw tx, raw rx) / max(tx, rx) is the ratio a machine with a free
core per side would show.

Layouts: `process` (default) receives in a child process
(`pdmesh.loadtest.bench.transport_peer`), as decode receives from prefill, so sender and
receiver work in parallel and each side pays one checksum pass; both the transport and the
raw baseline are timed until the receiver acknowledged. Every kind's peer lives for the
whole run and at each size the kinds take turns, round by round (`--repeat` rounds), so
that all kinds are measured over the same stretch of time. `loop` runs both sides in one
event loop (everything serialised), kind after kind. Rows of kinds other than tcp carry
`vs_tcp` (their GB/s over tcp's at the same size) when tcp was benched too.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import os
import secrets
import socket
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from types import ModuleType

import numpy as np

from pdmesh.transports import (
    ExpectedTransfer,
    TransferPlan,
    make_transport,
    stop_ucx_notifier,
)
from pdmesh.transports.framing import Kind, decode_header, encode_header, mac_ok

SIZES_MIB = (1, 16, 64)
UCX_KINDS = ("ucx", "nixl")  # transports over UCX: compared with native ucx_perftest
PAGE_BYTES = 1 << 20
PAGE_TOKENS = 16
# Liveness is not what is measured: a first UCX connect on a loaded machine (all transports
# probed when UCX_TLS is unset) can take longer than the production progress timeout.
PROGRESS_S = 5.0
# Frames are MACed as in production: each transfer has its own random data key, which
# admission would hand to both workers.
DATA_KEY_BYTES = 32


def data_key() -> bytes:
    return secrets.token_bytes(DATA_KEY_BYTES)


async def _transport_once(payload: np.ndarray, dst: np.ndarray, pair) -> float:
    receiver, sender, address = pair
    n = payload.shape[0]
    rid = uuid.uuid4().hex
    ids = tuple(range(n))
    key = data_key()
    fut = receiver.expect(ExpectedTransfer(rid, 1, ids, [memoryview(p) for p in dst],
                                           PAGE_BYTES, PAGE_TOKENS, n * PAGE_TOKENS, 60.0,
                                           key=key))
    started = time.perf_counter()
    await sender.send(address, TransferPlan(rid, 1, ids, n * PAGE_TOKENS, PAGE_TOKENS,
                                            PAGE_BYTES, 0, 60.0, key=key),
                      [memoryview(p) for p in payload])
    await fut
    return time.perf_counter() - started


async def _raw_tcp_once(payload: np.ndarray, dst: np.ndarray) -> float:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))  # loopback, no transport framing
    listener.setblocking(False)
    client = socket.socket()
    client.setblocking(False)
    await loop.sock_connect(client, listener.getsockname())
    server, _ = await loop.sock_accept(listener)
    server.setblocking(False)
    view = memoryview(dst).cast("B")

    async def recv_all() -> None:
        pos = 0
        while pos < view.nbytes:
            pos += await loop.sock_recv_into(server, view[pos:])

    started = time.perf_counter()
    await asyncio.gather(loop.sock_sendall(client, memoryview(payload).cast("B")), recv_all())
    seconds = time.perf_counter() - started
    for s in (client, server, listener):
        s.close()
    return seconds


async def _raw_send(ep, tx, payload: np.ndarray) -> None:
    """A bare ucxx send of `payload` on link `ep`, on endpoint `tx` where the transport
    would use one (error mode "none", `sending_endpoint`): the same lanes as the transport."""
    if tx is None:
        await ep.send(payload.reshape(-1))
    else:
        await tx.send(payload.reshape(-1), tag=ep._tags["msg_send"], force_tag=True)


async def _raw_ucx_once(payload: np.ndarray, dst: np.ndarray, ucx) -> float:
    from pdmesh.transports.ucx import announce_worker, data_error_mode, sending_endpoint
    done: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connect(ep) -> None:
        await announce_worker(ep, 10.0)
        await ep.recv(dst.reshape(-1))
        done.set_result(None)
        await ep.close()

    listener = ucx.create_listener(on_connect, port=0)
    ep = await ucx.create_endpoint("127.0.0.1", listener.port)
    tx = await sending_endpoint(ep, data_error_mode(), 10.0)
    started = time.perf_counter()
    await _raw_send(ep, tx, payload)
    await done
    seconds = time.perf_counter() - started
    if tx is not None:
        tx.abort()
    await ep.close()
    listener.close()
    return seconds


class _Peer:
    """The receiving child process and its one-line command protocol."""

    def __init__(self, proc: asyncio.subprocess.Process, info: dict) -> None:
        self.proc, self.address, self.raw_port = proc, info["address"], info["raw_port"]

    @classmethod
    async def start(cls, kind: str, raw: str) -> _Peer:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdmesh.loadtest.bench.transport_peer", kind, raw,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        while not (line := await proc.stdout.readline()).startswith(b"{"):
            if not line:
                raise RuntimeError("bench peer exited before listening")
        return cls(proc, json.loads(line))

    async def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        if (await self.proc.stdout.readline()).strip() != b"ready":
            raise RuntimeError(f"bench peer did not take {line!r}")

    async def cpu(self) -> float:
        """The peer's CPU time so far (seconds, all its threads)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"cpu\n")
        await self.proc.stdin.drain()
        return float((await self.proc.stdout.readline()).split()[1])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"quit\n")
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def _peer_transport_once(peer: _Peer, sender, payload: np.ndarray) -> float:
    n = payload.shape[0]
    rid = uuid.uuid4().hex
    key = data_key()
    await peer.command(f"expect {rid} {n} {key.hex()}")
    started = time.perf_counter()
    await sender.send(peer.address, TransferPlan(rid, 1, tuple(range(n)), n * PAGE_TOKENS,
                                                 PAGE_TOKENS, PAGE_BYTES, 0, 60.0, key=key),
                      [memoryview(p) for p in payload])
    return time.perf_counter() - started


async def _peer_raw_once(peer: _Peer, payload: np.ndarray, ucx) -> float:
    """One raw transfer to the peer: bare ucxx when `ucx` is given, else a plain socket."""
    await peer.command(f"raw {payload.nbytes}")
    if ucx is not None:
        from pdmesh.transports.ucx import data_error_mode, sending_endpoint
        ep = await ucx.create_endpoint("127.0.0.1", peer.raw_port)
        tx = await sending_endpoint(ep, data_error_mode(), 10.0)
        ack = np.empty(1, np.uint8)
        started = time.perf_counter()
        await _raw_send(ep, tx, payload)
        await ep.recv(ack)
        seconds = time.perf_counter() - started
        if tx is not None:
            tx.abort()
        await ep.close()
        return seconds
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.sock_connect(sock, ("127.0.0.1", peer.raw_port))
    started = time.perf_counter()
    await loop.sock_sendall(sock, memoryview(payload).cast("B"))
    await loop.sock_recv(sock, 1)
    seconds = time.perf_counter() - started
    sock.close()
    return seconds


def _perftest_binary() -> tuple[str, str] | None:
    """(path of ucx_perftest, its library folder) from the libucx wheel, if installed."""
    try:
        import libucx
    except ImportError:
        return None
    root = os.path.dirname(libucx.__file__)
    binary = os.path.join(root, "bin", "ucx_perftest")
    return (binary, os.path.join(root, "lib")) if os.access(binary, os.X_OK) else None


async def _perftest_gbps(nbytes: int, repeat: int, errh: bool = False) -> float | None:
    """Native UCX tag bandwidth for `nbytes` messages on loopback: an `ucx_perftest`
    server and client, launched here with this process's UCX_TLS (with `errh`, endpoints
    with peer error handling, `-e`). GB/s, or None."""
    found = _perftest_binary()
    if found is None:
        return None
    binary, libdir = found
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(
        p for p in (libdir, os.environ.get("LD_LIBRARY_PATH", "")) if p)}
    iters = str(max(8, repeat * (256 << 20) // nbytes))
    # The server serves one client and exits, whatever became of it: a client that reached
    # it too early (or failed mid-run) ends that server, so each attempt starts a new one.
    for _ in range(3):
        with socket.socket() as probe:  # a free port for perftest's own rendezvous
            probe.bind(("127.0.0.1", 0))
            port = str(probe.getsockname()[1])
        common = ("-p", port, "-f", "-v", *(("-e",) if errh else ()))
        server = await asyncio.create_subprocess_exec(
            binary, *common, env=env, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            for _ in range(50):  # the server needs a moment to listen
                await asyncio.sleep(0.1)
                if server.returncode is not None:
                    break  # it exited: start another
                client = await asyncio.create_subprocess_exec(
                    binary, "127.0.0.1", *common, "-t", "tag_bw", "-s", str(nbytes), "-n",
                    iters, "-w", "4", env=env, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL)
                try:
                    out, _ = await asyncio.wait_for(client.communicate(), 60)
                except TimeoutError:
                    client.kill()
                    await client.wait()
                    break
                # CSV: iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,
                # ...; bandwidth in MB/s as UCX counts them (2**20 bytes).
                rows = [line.split(",") for line in out.decode().splitlines()
                        if line.strip()[:1].isdigit()]
                if client.returncode == 0 and rows:
                    return float(rows[-1][5]) * (1 << 20) / 1e9
        finally:
            if server.returncode is None:
                server.kill()
            await server.wait()
    return None


def _ucx_for(kind: str) -> ModuleType | None:
    """The ucxx module for the raw baseline of a kind that moves bytes over UCX (an
    optional dependency, imported only then); None: the raw baseline is a plain socket."""
    if kind not in UCX_KINDS:
        return None
    from pdmesh.transports.ucx import ucx

    return ucx


def _payload(mib: int) -> np.ndarray:
    n = mib * (1 << 20) // PAGE_BYTES
    return np.random.default_rng(mib).integers(0, 256, (n, PAGE_BYTES), np.uint8)


class _Samples:
    """One kind's runs at one size: the fastest transport and raw seconds so far, and with a
    peer the CPU time of each run on each side (seconds: tx, rx, raw_tx, raw_rx)."""

    def __init__(self, transport_once: Callable[[], Awaitable[float]],
                 raw_once: Callable[[], Awaitable[float]], peer: _Peer | None = None) -> None:
        self.transport_once, self.raw_once, self.peer = transport_once, raw_once, peer
        self.best_t = self.best_raw = float("inf")
        self._cpu: dict[str, list[float]] = {"tx": [], "rx": [], "raw_tx": [], "raw_rx": []}

    async def run(self) -> None:
        """One transport run, then one raw run."""
        self.best_t = min(self.best_t, await self._timed(self.transport_once, ""))
        self.best_raw = min(self.best_raw, await self._timed(self.raw_once, "raw_"))

    def cpu(self) -> dict:
        """Median CPU seconds per run of each side."""
        return {k: statistics.median(v) for k, v in self._cpu.items() if v}

    async def _timed(self, once: Callable[[], Awaitable[float]], prefix: str) -> float:
        if self.peer is None:
            return await once()
        tx, rx = time.process_time(), await self.peer.cpu()
        seconds = await once()
        self._cpu[prefix + "tx"].append(time.process_time() - tx)
        await asyncio.sleep(0.01)  # the peer's last bookkeeping after its reply
        self._cpu[prefix + "rx"].append(await self.peer.cpu() - rx)
        return seconds


async def _best_of(repeat: int, t_end: float, transport_once: Callable[[], Awaitable[float]],
                   raw_once: Callable[[], Awaitable[float]]) -> tuple[float, float]:
    """Fastest transport and raw seconds of `repeat` alternating runs (until `t_end`)."""
    samples = _Samples(transport_once, raw_once)
    for _ in range(repeat):
        if time.monotonic() > t_end and samples.best_t < float("inf"):
            break  # out of budget, but every size gets one measured run
        await samples.run()
    return samples.best_t, samples.best_raw


def mac_cost_us(frames: int = 20000) -> float:
    """Microseconds one frame's authentication adds, both sides together: the sender's
    HMAC over the header body and the receiver's verification (measured in this run)."""
    key = data_key()
    raw = encode_header(Kind.DATA, bytes(16), 1, payload_len=PAGE_BYTES, payload_checksum=1,
                        key=key)
    h = decode_header(raw)
    body = raw[:72]
    started = time.perf_counter()
    for _ in range(frames):
        hmac.digest(key, body, "sha256")
        if not mac_ok(h, key):
            raise AssertionError("MAC does not verify")
    return (time.perf_counter() - started) / frames * 1e6


def _row(kind: str, mib: int, layout: str, nbytes: int, best_t: float,
         best_raw: float, cpu: dict | None = None) -> dict:
    row = {"transport": kind, "mib": mib, "layout": layout,
           "transport_gbps": nbytes / best_t / 1e9, "raw_gbps": nbytes / best_raw / 1e9}
    row["ratio"] = row["transport_gbps"] / row["raw_gbps"]
    if cpu:
        for side, seconds in cpu.items():
            row[f"{side}_cpu_us_per_mib"] = seconds / mib * 1e6
        row["cpu_bound_ratio"] = (max(cpu["raw_tx"], cpu["raw_rx"])
                                  / max(cpu["tx"], cpu["rx"]))
    return row


async def _add_perftest(row: dict, kind: str, nbytes: int, repeat: int) -> None:
    if kind in UCX_KINDS:
        gbps = await _perftest_gbps(nbytes, repeat)
        row["perftest_gbps"] = gbps
        row["vs_perftest"] = row["transport_gbps"] / gbps if gbps else None
    if kind == "ucx":
        gbps = await _perftest_gbps(nbytes, repeat, errh=True)
        row["perftest_errh_gbps"] = gbps
        row["vs_perftest_errh"] = row["transport_gbps"] / gbps if gbps else None


async def _run_process(kinds: list[str], repeat: int, budget_s: float) -> list[dict]:
    """Every kind's receiving peer and sender live for the whole run, and at each size the
    kinds take turns (a transport run and a raw run each per round): the figures of all
    kinds, and the ratios between them (`vs_tcp`), come from the same stretch of time. On a
    shared machine single figures moved 1.5-2x within minutes (transports/README.md);
    kind after kind, a ucx / tcp ratio compared two different stretches."""
    t_end = time.monotonic() + budget_s
    results = []
    sides: list[tuple[str, ModuleType | None, _Peer, object]] = []
    try:
        for kind in kinds:
            ucx = _ucx_for(kind)
            peer = await _Peer.start(kind, "tcp" if ucx is None else "ucx")
            sender = make_transport(kind, progress_timeout_s=PROGRESS_S)
            sides.append((kind, ucx, peer, sender))
            await sender.start()
        for mib in SIZES_MIB:
            payload = _payload(mib)
            samples = []
            for _kind, ucx, peer, sender in sides:
                await _peer_transport_once(peer, sender, payload)  # warm-up (connect, pages)
                await _peer_raw_once(peer, payload, ucx)
                samples.append(_Samples(
                    functools.partial(_peer_transport_once, peer, sender, payload),
                    functools.partial(_peer_raw_once, peer, payload, ucx), peer))
            for round_ in range(repeat):
                if round_ and time.monotonic() > t_end:
                    break  # out of budget, but every size gets one measured round
                for sample in samples:
                    await sample.run()
            for (kind, _, _, _), sample in zip(sides, samples, strict=True):
                results.append(_row(kind, mib, "process", payload.nbytes, sample.best_t,
                                    sample.best_raw, sample.cpu()))
                await _add_perftest(results[-1], kind, payload.nbytes, repeat)
    finally:
        for _, _, peer, sender in sides:
            await sender.close()  # type: ignore[attr-defined]
            await peer.stop()
    return results


def _add_vs_tcp(results: list[dict]) -> None:
    """`vs_tcp` on every other kind's row: its GB/s over tcp's at the same size and layout
    (ucx and nixl are judged against tcp timed in the same run)."""
    tcp = {(r["mib"], r["layout"]): r["transport_gbps"] for r in results
           if r["transport"] == "tcp"}
    for row in results:
        base = tcp.get((row["mib"], row["layout"]))
        if row["transport"] != "tcp" and base:
            row["vs_tcp"] = row["transport_gbps"] / base


async def _run(kinds: list[str], repeat: int, budget_s: float, layout: str) -> dict:
    ucx_error_mode = ""  # the ucx transport's sending endpoints (transports/ucx.py)
    try:
        if "ucx" in kinds and _ucx_for("ucx") is not None:
            from pdmesh.transports.ucx import data_error_mode
            ucx_error_mode = data_error_mode()
        results = (await _run_process(kinds, repeat, budget_s) if layout == "process"
                   else await _run_loop(kinds, repeat, budget_s))
    finally:
        stop_ucx_notifier()
    _add_vs_tcp(results)
    mac_us = mac_cost_us()
    for row in results:  # what authenticating its frames costs, as a share of the transfer
        frames = row["mib"] * (1 << 20) // PAGE_BYTES + 1
        row["mac_share"] = frames * mac_us * 1e-6 / (row["mib"] * (1 << 20)
                                                     / (row["transport_gbps"] * 1e9))
    return {"bench": "transport", "layout": layout, "page_bytes": PAGE_BYTES,
            "checksum": "xxh3_64", "mac": "hmac_sha256_128", "mac_us_per_frame": mac_us,
            "ucx_tls": os.environ.get("UCX_TLS", ""), "ucx_error_mode": ucx_error_mode,
            "ucxpy_progress_mode": os.environ.get("UCXPY_PROGRESS_MODE", "thread"),
            "ucxpy_enable_python_future": os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", ""),
            "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "results": results}


async def _run_loop(kinds: list[str], repeat: int, budget_s: float) -> list[dict]:
    t_end = time.monotonic() + budget_s
    results = []
    for kind in kinds:
        ucx = _ucx_for(kind)
        receiver, sender = (make_transport(kind, progress_timeout_s=PROGRESS_S)
                            for _ in range(2))
        pair = (receiver, sender, await receiver.start())
        await sender.start()
        try:
            for mib in SIZES_MIB:
                payload = _payload(mib)
                dst = np.zeros_like(payload)
                await _transport_once(payload, dst, pair)  # warm-up (connect, pages)
                raw_once = (functools.partial(_raw_ucx_once, payload, dst, ucx)
                            if ucx is not None else functools.partial(_raw_tcp_once, payload, dst))
                best_t, best_raw = await _best_of(
                    repeat, t_end, functools.partial(_transport_once, payload, dst, pair),
                    raw_once)
                assert (dst == payload).all()
                results.append(_row(kind, mib, "loop", payload.nbytes, best_t, best_raw))
                await _add_perftest(results[-1], kind, payload.nbytes, repeat)
        finally:
            await sender.close()
            await receiver.close()
    return results


def _available(kind: str) -> bool:
    """Whether `make_transport` builds this kind here (else a note on stderr)."""
    try:
        make_transport(kind)
    except (RuntimeError, ValueError) as exc:
        print(f"skipping {kind}: {exc}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench transport", description=__doc__)
    parser.add_argument("--json", action="store_true", help="last stdout line is JSON")
    parser.add_argument("--kinds", default="tcp,ucx")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=45.0)
    parser.add_argument("--layout", choices=("process", "loop"), default="process",
                        help="receiver in a child process (default) or in the same loop")
    args = parser.parse_args(argv)
    # Before ucxx is first imported (make_transport imports it lazily; the peer inherits
    # it): requests complete into asyncio futures, as in services (one loop per process).
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    kinds = [k for k in args.kinds.split(",") if k and _available(k)]
    report = asyncio.run(_run(kinds, args.repeat, args.budget_s, args.layout))
    print(f"{'transport':>9} {'MiB':>4} {'GB/s':>7} {'raw GB/s':>9} {'ratio':>6} "
          f"{'perftest':>9}")
    for row in report["results"]:
        perftest = row.get("perftest_gbps")
        print(f"{row['transport']:>9} {row['mib']:>4} {row['transport_gbps']:7.2f} "
              f"{row['raw_gbps']:9.2f} {row['ratio']:6.2f} "
              f"{'' if perftest is None else f'{perftest:9.2f}'}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
