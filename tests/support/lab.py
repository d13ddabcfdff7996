"""The multi-host lab: four namespaces on one switch, a 4-node NATS cluster, the mesh.

    control  (h1): NATS node 1, admission, gateway (the API on :8000)
    prefill  (h2): NATS node 2, prefill-0, prefill-1
    decode   (h3): NATS node 3, decode-0, decode-1
    decode2  (h4): NATS node 4, decode-2 (a second decode host: when h3 is cut off, the
                   requests on this one must not notice)

Every service is started as `pdmesh serve <role>` with the environment of
`compose/multihost/*.yml` (NATS: the local node, the others learned from the cluster; HTTP
and data plane on 0.0.0.0, the host's own address advertised to peers), inside its host's
namespace; the NATS nodes form one cluster over routes. Only the KV data plane, NATS routes and the
client's HTTP cross the switch. The test process talks to the mesh from the control host
(`Lab.threads`).

NATS runs as the role files run it: `pdmesh secrets --hosts` writes the lab's secrets (role
users, the keys, a dev CA and server certificate, the node config: client TLS, routes with
mutual TLS and a route password); services connect with `tls://`, their role's user and
`PDMESH_NATS_TLS_CA`, and each gets only its role's key file (`Lab.role_keys`); the test's
own clients (meshstats, `pdmesh check`) use the `tools` user and trust the dev CA through
`SSL_CERT_FILE` (nats-py's default TLS context).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdmesh.services.ops import certs, natsauth
from pdmesh.services.ops.launcher import nats_server_binary
from pdmesh.services.protocol import messages as m
from tests.model import tracecheck
from tests.support import meshstats
from tests.support.meshproc import http_json
from tests.support.netns import Host, NetnsThreads, Switch, command_in

REPO = Path(__file__).resolve().parents[2]
NATS_PORT, NATS_MONITOR, NATS_ROUTE_PORT = 4222, 8222, 6222
GATEWAY_PORT = 8000
KV_TOKENS = 16384  # per worker: scenario 3 puts several 3,000-token streams on one
# A ceiling only (liveness is by progress): a loaded 2-core CI box runs three NATS nodes,
# seven services and the test, and six concurrent prompts may queue in prefill for seconds.
TRANSFER_DEADLINE_S = 60.0
# --transfer-progress-s (the services' default): a peer that makes no progress this long is lost.
TRANSFER_PROGRESS_S = 5.0
WORKER_TTL_S = 3.0
HOSTS = ("control", "prefill", "decode", "decode2")
# (host, role, worker id, HTTP port); admission first, the gateway last (topology's order).
SERVICES = (
    ("control", "admission", "admission", 8101),
    ("prefill", "prefill", "prefill-0", 8102),
    ("prefill", "prefill", "prefill-1", 8112),
    ("decode", "decode", "decode-0", 8103),
    ("decode", "decode", "decode-1", 8113),
    ("decode2", "decode", "decode-2", 8103),
    ("control", "gateway", "gateway", GATEWAY_PORT),
)
READY_TIMEOUT_S = 120.0


def _http_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class Proc:
    """One OS process inside a host's namespace, its output in a log file."""

    name: str
    host: Host
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(command_in(self.host.name, self.argv), env=self.env,
                                         cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash), and reap it."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace_s: float = 10) -> None:
        """SIGTERM (services drain), SIGKILL after `grace_s`."""
        if not self.alive():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"[{self.name}] {line}" for line in text[-lines:])


@dataclass
class Lab:
    """The running lab; `start()` builds it, `stop()` removes every trace (idempotent)."""

    transport: str
    switch: Switch = field(init=False)
    threads: NetnsThreads = field(init=False)
    nats: dict[str, Proc] = field(default_factory=dict)
    services: dict[str, Proc] = field(default_factory=dict)
    workdir: Path = field(init=False)  # the processes' logs, removed by stop()
    secrets_dir: Path = field(init=False)  # `pdmesh secrets --hosts` output, in workdir
    _ssl_cert_file: str | None = field(default=None, init=False)
    _ca_env_set: bool = field(default=False, init=False)
    trace_violations: list[tracecheck.Violation] = field(default_factory=list, init=False)
    trace_files: int = field(default=0, init=False)  # processes whose trace was checked

    def __post_init__(self) -> None:
        self.switch = Switch(prefix=f"pdmh{os.getpid()}{self.transport[0]}")

    # -- addresses ----------------------------------------------------------------------
    def addr(self, host: str) -> str:
        return self.switch.hosts[host].address

    @property
    def nats_url(self) -> str:
        """How the test (on the control host) reaches NATS: node 1, as the `tools` user."""
        return self.nats_url_as(natsauth.TOOLS_USER, self.addr("control"))

    def nats_creds(self, user: str) -> dict[str, str]:
        env = (self.secrets_dir / f"nats-{user}.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in env if line)

    def role_keys(self, role: str) -> dict[str, str]:
        """The keys the role's compose service mounts (`signing.env`, `verify.env`,
        `salt.env`, prefill's `kvtier.env` too), and no other role's."""
        env: dict[str, str] = {}
        for name, (_, roles) in natsauth.KEY_FILES.items():
            if role in roles:
                lines = (self.secrets_dir / name).read_text().splitlines()
                env.update(line.split("=", 1) for line in lines if line)
        return env

    def nats_url_as(self, user: str, host: str) -> str:
        creds = self.nats_creds(user)
        return natsauth.Identity(creds["PDMESH_NATS_USER"], creds["PDMESH_NATS_PASSWORD"],
                                 (), ()).url(f"tls://{host}:{NATS_PORT}")

    @property
    def nats_ca(self) -> Path:
        return self.secrets_dir / certs.CA_CERT

    @property
    def gateway_url(self) -> str:
        return f"http://{self.addr('control')}:{GATEWAY_PORT}"

    def host_of(self, worker_id: str) -> str:
        return next(h for h, _, wid, _ in SERVICES if wid == worker_id)

    # -- building -----------------------------------------------------------------------
    def start(self) -> Lab:
        self.workdir = Path(tempfile.mkdtemp(prefix="pdmesh-mh-"))
        self.switch.create()
        for host in HOSTS:
            self.switch.add_host(host)
        self.threads = NetnsThreads(self.switch.hosts["control"].name)
        self.secrets_dir = self.workdir / "secrets"
        natsauth.write_secrets(self.secrets_dir, hosts=[self.addr(h) for h in HOSTS],
                               tls_dir=str(self.secrets_dir))
        # The test's NATS clients (meshstats: nats-py's default TLS context) trust the dev CA.
        self._ssl_cert_file = os.environ.get("SSL_CERT_FILE")
        os.environ["SSL_CERT_FILE"] = str(self.nats_ca)
        self._ca_env_set = True
        for host in HOSTS:
            self.start_nats(host)
        self.wait_cluster()
        for host, role, wid, port in SERVICES:
            self.start_service(host, role, wid, port)
            if role == "admission":  # it must hear the workers' first heartbeats
                self.wait_ready(wid)
        for _, _, wid, _ in SERVICES:
            self.wait_ready(wid)
        return self

    def start_nats(self, host: str) -> Proc:
        # As compose/multihost/*.yml: users, TLS and the cluster (its routes) from the config.
        argv = [nats_server_binary(), "--config", str(self.secrets_dir / "nats-cluster.conf"),
                "--name", f"nats-{host}", "-a", "0.0.0.0",
                "-p", str(NATS_PORT),
                "--client_advertise", f"{self.addr(host)}:{NATS_PORT}"]
        env = {**os.environ, natsauth.MONITOR_ENV: f"{self.addr(host)}:{NATS_MONITOR}"}
        proc = Proc(f"nats-{host}", self.switch.hosts[host], argv, env,
                    self.workdir / f"nats-{host}.log").start()
        self.nats[host] = proc
        return proc

    def service_env(self, host: str, role: str, worker_id: str, http_port: int,
                    **extra: str) -> dict[str, str]:
        """compose/multihost/<role>.yml's environment, plus the test's small pools."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PDMESH_", "UCX_"))}
        env.update({
            "PYTHONUNBUFFERED": "1",
            # The local node only: the cluster tells its clients the other nodes' URLs
            # (connect_urls), which is where they fail over to. A list would be shuffled
            # by nats-py (services/runtime/service.py sets no dont_randomize), landing services on
            # other hosts' nodes.
            "PDMESH_NATS_URL": f"tls://127.0.0.1:{NATS_PORT}",
            "PDMESH_NATS_TLS_CA": str(self.nats_ca),
            "PDMESH_MODEL": "tiny",
            "PDMESH_TRANSPORT": self.transport,
            "PDMESH_LOG_LEVEL": "INFO",
            # /health, /ready, /metrics on the cluster address only (the gateway's API: all).
            "PDMESH_HTTP_HOST": "0.0.0.0" if role == "gateway" else self.addr(host),
            "PDMESH_HTTP_PORT": str(http_port),
            "PDMESH_WORKER_ID": worker_id,
            "PDMESH_KV_TOKENS": str(KV_TOKENS),
            "PDMESH_MAX_CONTEXT": str(KV_TOKENS),  # no clamp: `pdmesh check` exits 0
            "PDMESH_TRANSFER_DEADLINE_S": str(TRANSFER_DEADLINE_S),
            "PDMESH_TRANSFER_PROGRESS_S": str(TRANSFER_PROGRESS_S),
            "PDMESH_WORKER_TTL_S": str(WORKER_TTL_S),
            "PDMESH_TORCH_THREADS": "1",
        })
        env.update(self.nats_creds(role))  # the role's env files (compose: env_file)
        env.update(self.role_keys(role))
        if hasattr(self, "workdir"):  # every process's protocol trace, checked by stop()
            env["PDMESH_PROTOCOL_TRACE_DIR"] = str(self.trace_dir)
        if role in ("prefill", "decode"):
            env["PDMESH_DATA_HOST"] = "0.0.0.0"
            env["PDMESH_ADVERTISE_HOST"] = self.addr(host)
        if role == "gateway":
            env["PDMESH_GATEWAY_PORT"] = str(http_port)
            env["PDMESH_METRICS_HOST"] = self.addr(host)  # per tenant: the cluster only
            env["PDMESH_METRICS_PORT"] = "0"
            # control.yml mounts the tenants secret there; the lab's is the dev key file
            # (the test clients use its keys), which only a start allowing dev credentials
            # accepts (its mesh keys are still the lab's own, from role_keys).
            env["PDMESH_TENANTS_FILE"] = str(REPO / "gateway" / "dev_tenants.toml")
            env["PDMESH_ALLOW_DEV_CREDENTIALS"] = "1"
        if self.transport == "ucx":
            env["UCX_TLS"] = "tcp"
        env.update(extra)
        return env

    def start_service(self, host: str, role: str, worker_id: str, http_port: int,
                      **extra: str) -> Proc:
        argv = [sys.executable, "-m", "pdmesh.services.ops.cli", "serve", role]
        env = self.service_env(host, role, worker_id, http_port, **extra)
        proc = Proc(worker_id, self.switch.hosts[host], argv, env,
                    self.workdir / f"{worker_id}.log").start()
        proc.http_port = http_port  # type: ignore[attr-defined]
        self.services[worker_id] = proc
        return proc

    def wait_ready(self, worker_id: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        proc = self.services[worker_id]
        url = f"http://{proc.host.address}:{proc.http_port}/ready"  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{worker_id} exited before ready:\n{proc.tail()}")
            if self.threads.run(_ready, url):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{worker_id} not ready after {timeout_s:g}s:\n{proc.tail()}")

    def wait_cluster(self, hosts: tuple[str, ...] = HOSTS, timeout_s: float = 30) -> None:
        """Every node in `hosts` has a route to each of the others in `hosts`."""
        deadline = time.monotonic() + timeout_s
        missing: dict[str, set[str]] = {}
        while time.monotonic() < deadline:
            missing = {}
            for host in hosts:
                peers = self.route_peers(host)
                want = {f"nats-{h}" for h in hosts if h != host}
                if not want <= peers:
                    missing[host] = want - peers
            if not missing:
                return
            time.sleep(0.2)
        raise RuntimeError(f"NATS cluster not formed after {timeout_s:g}s: {missing}")

    def route_peers(self, host: str) -> set[str]:
        url = f"http://{self.addr(host)}:{NATS_MONITOR}/routez"
        try:
            routez = self.threads.run(_http_json, url, 2)
        except (urllib.error.URLError, OSError, ValueError):
            return set()
        return {r.get("remote_name", "") for r in routez.get("routes") or []}

    def client_names(self, host: str) -> set[str]:
        """Names of the NATS clients connected to `host`'s node ('<role>:<worker id>')."""
        url = f"http://{self.addr(host)}:{NATS_MONITOR}/connz?limit=1024"
        try:
            connz = self.threads.run(_http_json, url, 2)
        except (urllib.error.URLError, OSError, ValueError):
            return set()
        return {c.get("name", "") for c in connz.get("connections") or []}

    def check(self, host: str) -> tuple[int, dict]:
        """`pdmesh check --json` run on `host` against its own NATS node: exit code, report."""
        argv = [sys.executable, "-m", "pdmesh.services.ops.cli", "check", "--json",
                "--listen-s", "1.5", "--nats-url",
                self.nats_url_as(natsauth.TOOLS_USER, "127.0.0.1")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}
        env["SSL_CERT_FILE"] = str(self.nats_ca)
        done = subprocess.run(command_in(self.switch.hosts[host].name, argv), cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=60,
                              check=False)
        lines = done.stdout.strip().splitlines()
        assert lines and "Traceback" not in done.stderr, done.stdout + done.stderr
        return done.returncode, json.loads(lines[-1])

    @property
    def trace_dir(self) -> Path:
        return self.workdir / "trace"

    def stop(self) -> None:
        """Stop everything and remove the lab; the services' protocol trace is checked
        against the model first (tests/model/tracecheck.py), its violations left in
        `trace_violations` for the fixture to fail on."""
        for proc in reversed(list(self.services.values())):
            proc.stop()
        if hasattr(self, "workdir") and self.trace_dir.is_dir():
            self.trace_violations = tracecheck.check_dir(self.trace_dir)
            self.trace_files = len(list(self.trace_dir.glob("*.jsonl")))
        for proc in self.nats.values():
            proc.stop(5)
        with contextlib.suppress(AttributeError):
            self.threads.close()
        if self._ca_env_set:  # the process's SSL_CERT_FILE as it was before start()
            self._ca_env_set = False
            if self._ssl_cert_file is None:
                os.environ.pop("SSL_CERT_FILE", None)
            else:
                os.environ["SSL_CERT_FILE"] = self._ssl_cert_file
        self.switch.destroy()
        if hasattr(self, "workdir"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def logs(self, lines: int = 30) -> str:
        procs = [*self.nats.values(), *self.services.values()]
        return "\n".join(p.tail(lines) for p in procs)

    # -- talking to the mesh (from the control host) ------------------------------------
    def http(self, method: str, path: str, body: object | None = None,
             key: str = "sk-dev-alice", timeout: float = 60) -> tuple[int, dict]:
        return self.threads.run(_request, f"{self.gateway_url}{path}", method, body, key,
                                timeout)

    def complete(self, prompt: str, max_tokens: int, key: str = "sk-dev-alice",
                 timeout: float = 60, **params: object) -> tuple[int, dict]:
        """A greedy completion; `params` adds body fields (e.g. ignore_eos=True)."""
        return self.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **params}, key=key, timeout=timeout)

    def open_stream(self, prompt: str, max_tokens: int, key: str = "sk-dev-alice",
                    **params: object) -> Stream:
        return self.threads.run(_open_stream, f"{self.gateway_url}/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **params}, key)

    def stats(self, listen_s: float = 1.2) -> dict[str, m.StatsReply]:
        return self.threads.run(meshstats.worker_stats, self.nats_url, listen_s)

    def query(self, worker_ids: list[str]) -> list[m.StatsReply]:
        workers = [(m.Role.PREFILL if w.startswith("prefill") else m.Role.DECODE, w)
                   for w in worker_ids]
        return self.threads.run(meshstats.query_stats, self.nats_url, workers)

    def heartbeats(self, listen_s: float = 1.2) -> dict[str, m.Heartbeat]:
        return self.threads.run(meshstats.heartbeats, self.nats_url, listen_s)

    def assert_pools_clean(self, timeout_s: float = 10) -> None:
        self.threads.run(meshstats.assert_pools_clean, self.nats_url, timeout_s)

    def lease_holder(self, request_id: str, worker_ids: list[str],
                     timeout_s: float = 5) -> str:
        """Which of `worker_ids` holds a live lease for `request_id` (the worker serving it,
        where a worker that refused or had its reserve cancelled has also heard of it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for s in self.query(worker_ids):
                if request_id in s.leased_requests:
                    return s.worker_id
            time.sleep(0.05)
        raise AssertionError(f"none of {worker_ids} holds a lease for {request_id}")


def _request(url: str, method: str, body: object | None, key: str,
             timeout: float) -> tuple[int, dict]:
    return http_json(url, method, body, key=key, timeout=timeout)


@dataclass
class Stream:
    """An open SSE completion: its id, the text so far, and how it ended."""

    resp: Any
    request_id: str
    text: str = ""
    error: dict | None = None
    finish_reason: str | None = None
    ended_at: float = 0.0
    last_text_at: float = 0.0
    max_gap_s: float = 0.0  # the longest wait between two text chunks (a resume's gap)

    def read_event(self) -> dict | None:
        """The next data event (None at [DONE] or the end of the body)."""
        while True:
            line = self.resp.readline()
            if not line:
                return None
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return None
            event = json.loads(data)
            if "error" in event:
                self.error = event["error"]
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    now = time.monotonic()
                    if self.last_text_at:
                        self.max_gap_s = max(self.max_gap_s, now - self.last_text_at)
                    self.last_text_at = now
                self.text += choice.get("text") or ""
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            return event

    def read_tokens(self, n: int) -> None:
        """Read until `n` text chunks arrived (decode is streaming)."""
        chunks = 0
        while chunks < n:
            event = self.read_event()
            assert event is not None and self.error is None, (self.request_id, self.error)
            if any(c.get("text") for c in event.get("choices") or []):
                chunks += 1

    def read_to_end(self) -> Stream:
        try:
            while self.read_event() is not None:
                pass
        finally:
            self.ended_at = time.monotonic()
            self.resp.close()
        return self


def _open_stream(url: str, body: dict, key: str) -> Stream:
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = urllib.request.urlopen(req, timeout=60)
    stream = Stream(resp, "")
    event = stream.read_event()
    assert event is not None, "the stream ended before its first event"
    stream.request_id = event["id"]
    return stream
