"""One frozen configuration per service, validated once at start.

Each setting is declared once, as a row of `services/runtime/settings.py`. From those rows
this module builds every role's config class (a dataclass whose fields are the rows that
name the role, each field's metadata holding its row), the argument parsers of
`pdmesh serve <role>` (the role's rows) and `pdmesh up` (rows marked `up`), and README's
settings table, which a test checks. Precedence: CLI flag > env var > default.

A role's config has attributes for its own settings only: `pdmesh serve gateway` offers no
`--kv-tokens`, and `resolve("gateway", {"kv_tokens": ...})` is refused. The env var of a
setting a role does not use is ignored by that role, since one environment (compose's
shared block, `pdmesh up`'s children) serves every role.

Classes: `NatsConfig` (the NATS rows; also what `pdmesh check` takes) < `ServiceConfig`
(every role) < `AdmissionConfig`, `GatewayConfig`, `WorkerConfig` < `PrefillConfig`,
`DecodeConfig` < `ColocatedConfig` (a colocated worker runs the decode service, so it takes
every decode setting). Derived values are properties of hand-written bases.

Secrets from files: a setting marked `secret` in settings.py may also be given as a file,
its env var with `_FILE` appended naming it (as Docker and compose secrets do); the file's
content, less one trailing newline, is the value. Setting both the env var and its `_FILE`
is refused, naming both; a flag still comes first. Every secret value resolved, and the
password of every NATS URL, is registered with `redact.register`, so no log line or error
text repeats it.

Production mode (`check_dev_credentials` without --allow-dev-credentials) refuses the
built-in dev keys, the bundled dev API keys wherever a tenants file holds them (compared by
SHA-256 digest), and keys that are a pattern rather than random bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import os
import socket
import tomllib
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from pdmesh.kvstore.spec import pages_for
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.redact import register, register_url
from pdmesh.services.runtime.settings import (
    ADMISSION,
    BY_FIELD,
    CHECK,
    COLOCATED,
    DECODE,
    DEFAULT_HTTP_PORTS,
    DEV_KV_TIER_KEY,
    DEV_SALT_KEY,
    DEV_SIGNING_KEY,
    DEV_VERIFY_KEY,
    GATEWAY,
    KEY_FIELDS,
    MISMATCH_POLICIES,
    PREFILL,
    ROLES,
    SCRUB_POLICIES,
    SETTINGS,
    TRANSPORTS,
    WORKERS,
    Setting,
    serve_settings,
    settings_of,
    split_urls,
    up_settings,
)

__all__ = ["ALLOW_DEV_ENV", "CONFIGS", "DEFAULT_HTTP_PORTS", "DEV_API_KEY_SHA256S",
           "DEV_SALT_KEY", "DEV_SIGNING_KEY", "DEV_VERIFY_KEY", "DEV_VALUES", "FILE_SUFFIX",
           "MISMATCH_POLICIES", "ROLES", "SCRUB_POLICIES", "SETTINGS", "TRANSPORTS", "WORKERS",
           "AdmissionConfig", "ArgumentParser", "ColocatedConfig", "DecodeConfig",
           "GatewayConfig", "NatsConfig", "PrefillConfig", "ServiceConfig", "Setting",
           "WorkerConfig", "add_arguments", "check_dev_credentials", "dev_credentials",
           "env_value", "file_env", "in_env", "key_weakness", "markdown_table", "mode_line",
           "replace", "resolve", "resolve_nats", "serve_settings", "settings_of",
           "tenants_with_dev_keys", "up_settings"]


# -- derived values: properties over the generated fields ------------------------------------
class _NatsValues:
    nats_url: str

    @property
    def nats_servers(self) -> list[str]:
        return split_urls(self.nats_url)


class _ServiceValues:
    faults: str

    @property
    def fault_set(self) -> frozenset[str]:
        return frozenset(f.strip() for f in self.faults.split(",") if f.strip())


class _ModelValues:
    served_model_name: str

    @property
    def served_model_names(self) -> list[str]:
        return [n.strip() for n in self.served_model_name.split(",") if n.strip()]


class _WorkerValues:
    kv_tokens: int
    page_tokens: int
    advertise_host: str
    data_host: str

    @property
    def kv_pages(self) -> int:
        return pages_for(self.kv_tokens, self.page_tokens)

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


def _config_class(name: str, roles: tuple[str, ...], *bases: type) -> Any:
    """A frozen dataclass holding the rows used by every role of `roles` that `bases` do
    not hold already; each field's metadata["setting"] is its row."""
    inherited = {f.name for b in bases if dataclasses.is_dataclass(b)
                 for f in dataclasses.fields(b)}
    own = [s for s in SETTINGS if set(roles) <= set(s.roles) and s.field not in inherited]
    spec: list[Any] = [] if inherited else [("role", str)]
    spec += [(s.field, s.kind, dataclasses.field(default=s.default, metadata={"setting": s}))
             for s in own]
    doc = (f"Settings of {', '.join(roles)}: " + ", ".join(s.field for s in own)
           + " (services/runtime/settings.py).")
    return dataclasses.make_dataclass(name, spec, bases=bases, frozen=True, kw_only=True,
                                      namespace={"__doc__": doc, "__module__": __name__})


NatsConfig = _config_class("NatsConfig", (*ROLES, CHECK), _NatsValues)
ServiceConfig = _config_class("ServiceConfig", ROLES, NatsConfig, _ServiceValues)
AdmissionConfig = _config_class("AdmissionConfig", (ADMISSION,), ServiceConfig)
GatewayConfig = _config_class("GatewayConfig", (GATEWAY,), ServiceConfig, _ModelValues)
WorkerConfig = _config_class("WorkerConfig", WORKERS, ServiceConfig, _ModelValues,
                             _WorkerValues)
PrefillConfig = _config_class("PrefillConfig", (PREFILL,), WorkerConfig)
DecodeConfig = _config_class("DecodeConfig", (DECODE,), WorkerConfig)
ColocatedConfig = _config_class("ColocatedConfig", (COLOCATED,), DecodeConfig)
CONFIGS: dict[str, type] = {ADMISSION: AdmissionConfig, PREFILL: PrefillConfig,
                            DECODE: DecodeConfig, COLOCATED: ColocatedConfig,
                            GATEWAY: GatewayConfig, CHECK: NatsConfig}


def config_fields(role: str) -> list[str]:
    """The settings `role`'s config class carries (its fields other than `role`)."""
    return [f.name for f in dataclasses.fields(CONFIGS[role]) if f.name != "role"]


# A class inheriting a field its role does not use (a decode row that forgot colocated)
# would offer a setting nobody reads: refuse to import instead.
for _role in CONFIGS:
    assert sorted(config_fields(_role)) == sorted(s.field for s in settings_of(_role)), _role


# -- parsing ---------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one clear line, like every other start-up error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pdmesh: error: {self.prog}: {message}\n")


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """Add one flag per setting that has one; defaults stay None so env vars can fill them
    later. Choices and checks run in resolve(), so a bad flag and a bad env var read the
    same."""
    for s in settings:
        if s.flag is None:
            continue
        if s.kind is bool:
            parser.add_argument(s.flag, dest=s.field, action="store_true", default=None,
                                help=f"{s.help} [{s.env}=1]")
        else:
            env = f"{s.env} or {file_env(s)}: a file holding it" if s.secret else s.env
            parser.add_argument(s.flag, dest=s.field, default=None, help=f"{s.help} [{env}]")


def _error(s: Setting, value: Any, problem: str, source: str | None = None) -> ConfigError:
    """A ConfigError that names the setting's flag and env var (`source`: the one that
    supplied the value)."""
    names = [n for n in (s.flag, s.env) if n and n != source]
    where = f" ({', '.join(names)})" if names else ""
    return ConfigError(s.field, "(hidden)" if s.secret else value,
                       f"{source} {problem}{where}" if source else f"{problem}{where}")


def _coerce(s: Setting, raw: Any, source: str) -> Any:
    if s.kind is bool:
        return raw is True or raw == "1"  # anything else is "not allowed", never an error
    if s.kind is str:
        value = str(raw)
    else:
        try:
            value = s.kind(raw)
        except (TypeError, ValueError):
            raise _error(s, raw, f"must be {s.kind.__name__}", source) from None
    if s.choices is not None and value not in s.choices:
        raise _error(s, raw, f"must be one of {', '.join(s.choices)}", source)
    return value


# A secret setting's env var with this appended names a file holding its value.
FILE_SUFFIX = "_FILE"


def file_env(s: Setting) -> str | None:
    """The env var naming a file that holds `s`'s value (None: `s` is not secret)."""
    return s.env + FILE_SUFFIX if s.secret else None


def in_env(field: str, env: Mapping[str, str]) -> bool:
    """Whether `env` gives the setting `field`, by its env var or (secret settings) its
    file's env var."""
    s = BY_FIELD[field]
    name = file_env(s)
    return env.get(s.env, "") != "" or (name is not None and env.get(name, "") != "")


def _read_secret_file(s: Setting, name: str, path: str) -> str:
    """The content of the file `name` points at, less one trailing newline."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(s.field, "(hidden)",
                          f"{name}={path}: cannot read it: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(s.field, "(hidden)", f"{name}={path}: not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if text == "":
        raise ConfigError(s.field, "(hidden)", f"{name}={path}: the file is empty")
    return text


def _value(s: Setting, given: Any, env: Mapping[str, str]) -> tuple[Any, str | None]:
    """A setting's value by precedence (flag, env var or the file its `_FILE` env var
    names, default) and the flag or env var it came from (None: the default)."""
    if given is not None:
        return _coerce(s, given, s.flag or s.field), s.flag
    raw = env.get(s.env, "")
    name = file_env(s)
    path = env.get(name, "") if name is not None else ""
    if name is not None and path != "":
        if raw != "":
            raise ConfigError(s.field, "(hidden)", f"{s.env} and {name} are both set; give "
                              "one of them")
        return _coerce(s, _read_secret_file(s, name, path), name), name
    if raw != "":
        return _coerce(s, raw, s.env), s.env
    return s.default, None


def _register_secrets(settings: Iterable[Setting], values: Mapping[str, Any]) -> None:
    """Register every secret value, and the password of each NATS and KV-store URL, to be
    redacted."""
    for s in settings:
        if s.secret and isinstance(values.get(s.field), str):
            register(values[s.field])
    if "nats_url" in values:
        for url in split_urls(values["nats_url"]):
            register_url(url)
    if values.get("kv_remote_url"):
        register_url(values["kv_remote_url"])  # a Redis URL may carry a password


def env_value(field: str, env: Mapping[str, str] | None = None) -> Any:
    """A process-level setting (one no config carries) read from the environment alone."""
    s = BY_FIELD[field]
    value, source = _value(s, None, os.environ if env is None else env)
    if s.check is not None and (problem := s.check(value)):
        raise _error(s, value, problem, source or s.env)
    _register_secrets((s,), {field: value})
    return value


ALLOW_DEV_ENV = BY_FIELD["allow_dev_credentials"].env


def resolve(role: str, args: argparse.Namespace | Mapping[str, Any] | None = None,
            env: Mapping[str, str] | None = None) -> ServiceConfig:
    """Merge CLI args, env and defaults into the validated frozen config of `role` (one of
    ROLES; a `ServiceConfig` subclass). A value in `args` for a setting of other roles only
    is refused; keys that are no setting (other flags of a parser) are ignored."""
    if role not in ROLES:
        raise ConfigError("role", role, f"expected one of {', '.join(ROLES)}")
    return _build(role, args, env)


def resolve_nats(args: argparse.Namespace | Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None) -> NatsConfig:
    """The NATS settings (a `NatsConfig`) of a tool such as `pdmesh check`, parsed from the
    same flags and env vars as a service's."""
    return _build(CHECK, args, env)


def _build(role: str, args: argparse.Namespace | Mapping[str, Any] | None,
           env: Mapping[str, str] | None) -> Any:
    env = os.environ if env is None else env
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    own = settings_of(role)
    for key, value in given.items():
        s = BY_FIELD.get(key)
        if value is not None and s is not None and s.roles and role not in s.roles:
            raise _error(s, value, f"is not a setting of {role} (only of "
                         f"{', '.join(s.roles)})", s.flag)
    values: dict[str, Any] = {"role": role}
    sources: dict[str, str | None] = {}
    for s in own:
        values[s.field], sources[s.field] = _value(s, given.get(s.field), env)
    derived = _role_defaults(role, values)
    _register_secrets(own, values)  # before any check: no error text repeats them
    # What a derived value came from is checked first: a bad --gateway-port is named as such.
    for s in sorted(own, key=lambda s: s.field in derived):
        problem = s.check(values[s.field]) if s.check is not None else None
        if problem:
            raise _error(s, values[s.field], problem, sources[s.field])
    cfg = CONFIGS[role](**values)
    _faults_need_permission(cfg, env)
    return cfg


def _role_defaults(role: str, values: dict[str, Any]) -> set[str]:
    """Fill in the defaults that depend on the role; return the fields filled."""
    filled = set()
    if values.get("http_port") == -1:
        values["http_port"] = (values["gateway_port"] if role == GATEWAY
                               else DEFAULT_HTTP_PORTS[role])
        filled.add("http_port")
    if "worker_id" in values and not values["worker_id"]:
        host = socket.gethostname().split(".")[0].replace("*", "-").replace(">", "-")
        values["worker_id"] = f"{role}-{host}-{os.getpid()}"
        filled.add("worker_id")
    return filled


def _faults_need_permission(cfg: Any, env: Mapping[str, str]) -> None:
    """Fault injection is test-only: --faults needs PDMESH_ALLOW_FAULTS=1 beside it."""
    if getattr(cfg, "faults", "") and not env_value("allow_faults", env):
        raise _error(BY_FIELD["faults"], cfg.faults, "fault injection is test-only; set "
                     f"{BY_FIELD['allow_faults'].env}=1 to allow it")


# -- development credentials -----------------------------------------------------------------
# The built-in dev value of each credential setting, by field.
DEV_VALUES = dict(zip(KEY_FIELDS, (DEV_SIGNING_KEY, DEV_VERIFY_KEY, DEV_SALT_KEY,
                                   DEV_KV_TIER_KEY), strict=True))
# SHA-256 (hex) of each API key of the bundled dev tenants (gateway/dev_tenants.toml; a test
# holds the two to each other): a tenants file holding one of them holds a public key.
DEV_API_KEY_SHA256S = frozenset({
    "c654d38ddccf90ce8e80f52254753cb6b19682349d920e558059f7be2a89c6d3",  # sk-dev-alice
    "f9f237d25bb4e9595bb5fd0899929eb4d46acfc566db330e35f9e9e0c650dd6c",  # sk-dev-bob
    "bbf5ff7d563402beb8bfda84692942230db73591cd5cda35b96cc4b6377eabf0",  # sk-dev-carol
})
# A random 32-byte key has about 30 distinct byte values, and as many distinct steps from one
# byte to the next; a key with fewer than this many of either is a pattern, not a secret.
MIN_DISTINCT_BYTES = 16
KEY_BYTES = 32


def key_weakness(value: str) -> str | None:
    """What makes the hex key `value` unfit for production (None: nothing): under 32
    bytes, or a pattern (one byte repeated, a few bytes cycling, a counting sequence)."""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        return None  # not hex: the setting's own check says so
    if len(raw) < KEY_BYTES:
        return f"{len(raw)} bytes, under {KEY_BYTES}"
    distinct = len(set(raw))
    steps = len({(b - a) % 256 for a, b in itertools.pairwise(raw)})
    if min(distinct, steps) < MIN_DISTINCT_BYTES:
        return (f"a pattern, not random bytes ({distinct} distinct byte values, {steps} "
                f"distinct steps; a random key has about 30)")
    return None


def tenants_with_dev_keys(path: str) -> list[str]:
    """The ids of the tenants in the tenants file `path` that hold a bundled dev API key, in
    the clear (`api_keys`) or as a digest (`api_key_sha256s`). A file that cannot be read or
    parsed holds none here: the gateway refuses it at start, saying why."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return []
    entries = data.get("tenant")
    found = []
    for i, entry in enumerate(entries if isinstance(entries, list) else ()):
        if not isinstance(entry, dict):
            continue
        plain, hashed = entry.get("api_keys", []), entry.get("api_key_sha256s", [])
        digests = {hashlib.sha256(k.encode()).hexdigest()
                   for k in (plain if isinstance(plain, list) else ()) if isinstance(k, str)}
        digests |= {h.lower() for h in (hashed if isinstance(hashed, list) else ())
                    if isinstance(h, str)}
        if digests & DEV_API_KEY_SHA256S:
            found.append(str(entry.get("id") or f"#{i + 1}"))
    return found


def _dev_findings(cfg: ServiceConfig) -> list[tuple[str, str]]:
    """(field, what) for each development credential `cfg` holds: a built-in dev key, a key
    that is a pattern, the bundled dev tenants, or a tenants file holding their keys."""
    found = []
    for f, dev in DEV_VALUES.items():
        value = getattr(cfg, f, None)
        if value is None:
            continue
        if value.lower() == dev:  # by value: the same key in capitals is the same key
            found.append((f, f"the built-in dev {f.replace('_', ' ')} (set {BY_FIELD[f].env})"))
        elif weakness := key_weakness(value):
            found.append((f, f"a weak {f.replace('_', ' ')}: {weakness} (set "
                          f"{BY_FIELD[f].env} to 32 random bytes; `pdmesh secrets` makes "
                          "them)"))
    if cfg.role == GATEWAY and not cfg.tenants_file:
        found.append(("tenants_file",
                      "the bundled dev tenants and API keys (set PDMESH_TENANTS_FILE)"))
    elif cfg.role == GATEWAY and (holders := tenants_with_dev_keys(cfg.tenants_file)):
        found.append(("tenants_file",
                      f"the bundled dev API keys in {cfg.tenants_file} (tenant "
                      f"{', '.join(holders)}; give every tenant keys of its own)"))
    return found


def dev_credentials(cfg: ServiceConfig) -> list[str]:
    """The development credentials this service would run with (empty: none). A
    production start refuses them; `pdmesh up` (`make up`) allows them and says so."""
    return [what for _, what in _dev_findings(cfg)]


def check_dev_credentials(cfg: ServiceConfig, allowed: bool) -> None:
    """Raise ConfigError when `cfg` uses dev credentials and they are not allowed."""
    found = _dev_findings(cfg)
    if found and not allowed:  # guard: dev-credentials
        field = found[0][0]
        raise ConfigError(field, "(hidden)" if field in KEY_FIELDS
                          else cfg.tenants_file or "(bundled)",
                          f"{cfg.role} would run with {' and '.join(w for _, w in found)}; "
                          f"pass --allow-dev-credentials or {ALLOW_DEV_ENV}=1 for local "
                          "development")


def mode_line(allowed: bool) -> str:
    """The line each service logs at start: which mode it runs in."""
    return "development mode: dev credentials allowed" if allowed else "production mode"


def replace(cfg: NatsConfig, **changes: Any) -> NatsConfig:
    return dataclasses.replace(cfg, **changes)


# -- README ----------------------------------------------------------------------------------
def used_by(s: Setting) -> str:
    """Who takes a setting, as README's table says it."""
    roles = set(s.roles)
    if set(ROLES) <= roles:
        parts = ["every role"]
    else:
        parts = [r for r in (ADMISSION, GATEWAY) if r in roles]
        parts += ["workers"] if set(WORKERS) <= roles else [r for r in WORKERS if r in roles]
    if CHECK in roles:
        parts.append("`pdmesh check`")
    if s.serve:
        parts.append("`pdmesh serve`")
    if s.up:
        parts.append("`pdmesh up`")
    if s.read_by:
        parts.append(("also read by " if s.roles else "no config; read by ")
                     + ", ".join(f"`{p}`" for p in s.read_by))
    return "; ".join(parts)


def markdown_table() -> str:
    """The settings table README.md carries (a test keeps them in step)."""
    rows = ["| CLI flag | env var | default | used by | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        default = "" if s.default == "" or s.default is False else f"`{s.default}`"
        flag = f"`{s.flag}`" if s.flag else ""
        rows.append(f"| {flag} | `{s.env}` | {default} | {used_by(s)} | {s.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
