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
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from pdmesh.kvstore.spec import pages_for
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.settings import (
    ADMISSION,
    BY_FIELD,
    CHECK,
    COLOCATED,
    DECODE,
    DEFAULT_HTTP_PORTS,
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

__all__ = ["ALLOW_DEV_ENV", "CONFIGS", "DEFAULT_HTTP_PORTS", "DEV_SALT_KEY",
           "DEV_SIGNING_KEY", "DEV_VERIFY_KEY", "DEV_VALUES", "MISMATCH_POLICIES", "ROLES",
           "SCRUB_POLICIES", "SETTINGS", "TRANSPORTS", "WORKERS",
           "AdmissionConfig", "ArgumentParser", "ColocatedConfig", "DecodeConfig",
           "GatewayConfig", "NatsConfig", "PrefillConfig", "ServiceConfig", "Setting",
           "WorkerConfig", "add_arguments", "check_dev_credentials", "dev_credentials",
           "env_value", "markdown_table", "replace", "resolve", "resolve_nats", "serve_settings",
           "settings_of", "up_settings"]


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
            parser.add_argument(s.flag, dest=s.field, default=None, help=f"{s.help} [{s.env}]")


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


def _value(s: Setting, given: Any, env: Mapping[str, str]) -> tuple[Any, str | None]:
    """A setting's value by precedence (flag, env var, default) and the flag or env var it
    came from (None: the default)."""
    if given is not None:
        return _coerce(s, given, s.flag or s.field), s.flag
    raw = env.get(s.env, "")
    if raw != "":
        return _coerce(s, raw, s.env), s.env
    return s.default, None


def env_value(field: str, env: Mapping[str, str] | None = None) -> Any:
    """A process-level setting (one no config carries) read from the environment alone."""
    s = BY_FIELD[field]
    value, _ = _value(s, None, os.environ if env is None else env)
    if s.check is not None and (problem := s.check(value)):
        raise _error(s, value, problem, s.env)
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
DEV_VALUES = dict(zip(KEY_FIELDS, (DEV_SIGNING_KEY, DEV_VERIFY_KEY, DEV_SALT_KEY),
                      strict=True))


def _dev_findings(cfg: ServiceConfig) -> list[tuple[str, str]]:
    """(field, what) for each built-in development credential `cfg` holds."""
    found = [(f, f"the built-in dev {f.replace('_', ' ')} (set {BY_FIELD[f].env})")
             for f, dev in DEV_VALUES.items() if getattr(cfg, f, None) == dev]
    if cfg.role == GATEWAY and not cfg.tenants_file:
        found.append(("tenants_file",
                      "the bundled dev tenants and API keys (set PDMESH_TENANTS_FILE)"))
    return found


def dev_credentials(cfg: ServiceConfig) -> list[str]:
    """The built-in development credentials this service would run with (empty: none).
    A production start refuses them; `pdmesh up` (`make up`) allows them and says so."""
    return [what for _, what in _dev_findings(cfg)]


def check_dev_credentials(cfg: ServiceConfig, allowed: bool) -> None:
    """Raise ConfigError when `cfg` uses dev credentials and they are not allowed."""
    found = _dev_findings(cfg)
    if found and not allowed:  # guard: dev-credentials
        raise ConfigError(found[0][0], "(built-in default)",
                          f"{cfg.role} would run with {' and '.join(w for _, w in found)}; "
                          f"pass --allow-dev-credentials or {ALLOW_DEV_ENV}=1 for local "
                          "development")


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
