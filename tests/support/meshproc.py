"""Test helpers that run the real thing: nats-server and `pdmesh up` as OS processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.services.ops.launcher import free_port, nats_server_binary
from pdmesh.services.protocol import tickets
from tests.model import tracecheck

REPO = Path(__file__).resolve().parents[2]
DEV_KEYS = {"alice": "sk-dev-alice", "bob": "sk-dev-bob", "carol": "sk-dev-carol"}


class NatsServer:
    """A real nats-server on a free loopback port; can be stopped and restarted."""

    def __init__(self, port: int | None = None, config: Path | None = None) -> None:
        self.port = port or free_port()
        self.config = config  # a nats-server config file (authorization, TLS), if any
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        config = ["--config", str(self.config)] if self.config else []
        self.proc = subprocess.Popen([nats_server_binary(), *config, "-a", "127.0.0.1", "-p",
                                      str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                import socket
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def http_json(url: str, method: str, body: object | None = None, *, key: str | None = None,
              timeout: float = 60, raw: bytes | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """One HTTP call with a JSON body (or `raw` bytes); (status, parsed JSON reply)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        payload = exc.read()
        try:
            return exc.code, json.loads(payload)
        except ValueError:
            return exc.code, {"raw": payload.decode(errors="replace")}


@dataclass
class Mesh:
    """A running `pdmesh up` (each service its own process), as a client sees it."""

    proc: subprocess.Popen[bytes]
    gateway_port: int
    nats_url: str = ""  # with the `tools` identity's credentials when NATS requires them
    nats_plain_url: str = ""  # without credentials (an outsider's view)
    run_dir: Path | None = None  # `pdmesh up`'s credentials of this run (embedded NATS)
    model: str = "tiny"
    max_context: int = 0
    log: list[str] = field(default_factory=list)
    signing_key: str = ""  # admission's, given to `pdmesh up` (run_mesh makes fresh ones)
    salt_key: str = ""  # the gateway's cache-salt key
    metrics_url: str = ""  # the gateway's /metrics (its own port, as `pdmesh up` prints it)

    @property
    def verify_key(self) -> str:
        """The workers' verify key (the public key of `signing_key`)."""
        return tickets.verify_key_of(self.signing_key)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    @property
    def api_keys(self) -> list[str]:
        return list(DEV_KEYS.values())

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                             text=True, check=False).stdout
        return [int(p) for p in out.split()]

    def http(self, method: str, path: str, body: object | None = None,
             key: str | None = "sk-dev-alice", timeout: float = 60,
             raw: bytes | None = None, headers: dict[str, str] | None = None
             ) -> tuple[int, dict]:
        return http_json(f"http://127.0.0.1:{self.gateway_port}{path}", method, body,
                         key=key, timeout=timeout, raw=raw, headers=headers)

    def nats_url_for(self, name: str) -> str:
        """The NATS URL with the credentials of process `name` (e.g. `admission`,
        `gateway`, `decode`), or the plain URL when NATS runs without authentication."""
        if self.run_dir is None:
            return self.nats_plain_url
        return (self.run_dir / f"{name}.url").read_text().strip()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)


def mesh_env(**overrides: str) -> dict[str, str]:
    # Test meshes run with the dev tenants, as `make up` does; `run_mesh` gives each its own
    # fresh keys (the launcher hands each role only its own).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PDMESH_LOG_LEVEL": "WARNING",
           "PDMESH_ALLOW_DEV_CREDENTIALS": "1"}
    env.update(overrides)
    return env


@contextlib.contextmanager
def run_mesh(*args: str, env: dict[str, str] | None = None,
             ready_timeout: float = 120) -> Iterator[Mesh]:
    """Run `pdmesh up <args>` (tiny model) and yield once the gateway is ready.

    Every mesh writes its protocol trace (a fresh directory, unless `env` names one) and,
    when the test body passed, the trace is checked against the model's transition rules
    at teardown (tests/model/tracecheck.py): a step the model does not allow fails the
    test, and the directory is kept for reading."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdmesh.services.ops.cli", "up", "--model", "tiny",
           "--gateway-port", str(port), *args]
    env = dict(env or mesh_env())
    trace_dir = env.get("PDMESH_PROTOCOL_TRACE_DIR") or tempfile.mkdtemp(prefix="pdmesh-trace-")
    own_trace = "PDMESH_PROTOCOL_TRACE_DIR" not in env
    env["PDMESH_PROTOCOL_TRACE_DIR"] = trace_dir
    env.setdefault("PDMESH_SIGNING_KEY", tickets.generate_signing_key())
    env.setdefault("PDMESH_SALT_KEY", secrets.token_hex(32))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    mesh = Mesh(proc=proc, gateway_port=port, signing_key=env["PDMESH_SIGNING_KEY"],
                salt_key=env["PDMESH_SALT_KEY"])
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            mesh.log.append(line)
            metrics = re.search(r"gateway metrics .*: (http://\S+/metrics)$", line)
            if metrics:
                mesh.metrics_url = metrics.group(1)
            creds = re.search(r"tools identity: .*\$\(cat (\S+)\)", line)
            if creds:
                mesh.run_dir = Path(creds.group(1)).parent
            found = re.search(r"mesh ready: .* \(NATS (nats://[^)]+)\)", line)
            if found:
                mesh.nats_plain_url = found.group(1)
                mesh.nats_url = (mesh.nats_url_for("tools") if mesh.run_dir
                                 else mesh.nats_plain_url)
                ready.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    deadline = time.monotonic() + ready_timeout
    while not ready.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("pdmesh up failed to start:\n" + "\n".join(mesh.log[-60:]))
    passed = False
    try:
        status, models = mesh.http("GET", "/v1/models")
        if status == 200 and models.get("data"):
            mesh.max_context = int(models["data"][0].get("max_model_len") or 0)
        yield mesh
        passed = True
    finally:
        try:
            mesh.stop()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
    if passed:
        check_trace(Path(trace_dir), remove=own_trace)


@contextlib.contextmanager
def smollm2_mesh(quantized_decode: str) -> Iterator[Mesh]:
    """SmolLM2 on the disaggregated mesh, its decode on the GGUF's blocks
    (`PDMESH_QUANTIZED_DECODE=on`) or on the fp32 reference path (`off`)."""
    env = mesh_env(PDMESH_QUANTIZED_DECODE=quantized_decode)
    with run_mesh("--model", "smollm2", "--kv-tokens", "8192", env=env,
                  ready_timeout=300) as mesh:
        yield mesh


def check_trace(trace_dir: Path, remove: bool = False) -> None:
    """Fail on any step of the protocol trace in `trace_dir` that the model does not allow
    (tests/model/tracecheck.py); with `remove`, delete a trace that passed."""
    if not any(trace_dir.glob("*.jsonl")):
        raise AssertionError(f"no protocol trace was written to {trace_dir}")
    violations = tracecheck.check_dir(trace_dir)
    if violations:
        shown = "\n".join(str(v) for v in violations[:20])
        raise AssertionError(f"protocol trace {trace_dir}: {len(violations)} steps the model "
                             f"does not allow:\n{shown}")
    if remove:
        shutil.rmtree(trace_dir, ignore_errors=True)
