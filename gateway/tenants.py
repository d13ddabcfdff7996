"""Tenants and API keys, loaded once from TOML; each tenant gets a server-side cache salt.

File format (``--tenants FILE`` / ``PDMESH_TENANTS_FILE``)::

    [defaults]                            # optional: limits of every tenant not setting its own
    max_concurrent = 64
    kv_share = 0.5

    [[tenant]]
    id = "acme"
    api_keys = ["sk-..."]                 # keys in the clear, or
    api_key_sha256s = ["9f86d0818..."]    # SHA-256 (hex) of each key: the file holds no key
    weight = 2.0                          # any limit of LIMIT_KEYS, overriding [defaults]

A tenant needs at least one key in either list (both may be given). The directory keeps
only SHA-256 digests: a presented key is hashed and compared in constant time with every
digest, so the comparison does not tell which or how much of a key matched. A digest may
belong to one tenant only. `sha256_hex(key)` (or `printf %s KEY | sha256sum`) makes an entry
of `api_key_sha256s`. Unknown keys are refused (a misspelt limit would otherwise be no
limit). The keys of the bundled dev tenants (`dev_tenants.toml`) are public: a production
start refuses a file holding any of them, in the clear or as a digest, whatever its path
(`config.check_dev_credentials`, before the gateway loads the file).

Limits (`TenantLimits`; gateway/README.md has the table): `max_concurrent` requests in flight
at one gateway (each of `n` choices counts), `kv_share` of the live decode KV the tenant's
reservations may hold (a tenant holding none may always have one request), `requests_per_s`
and `tokens_per_s` (prompt + max_tokens; 0: none), and `weight` in admission's fair queue.
The defaults are safe for a shared mesh: 64 in flight, half the decode KV when the file
names several tenants (all of it when one), no rate limit, weight 1. The gateway enforces
concurrency and rates (limits.py); admission the KV share and the fair order.

The cache salt that namespaces a tenant's prefix-cache entries (invariant I7) is
HMAC-SHA256(salt key, "cache-salt:" + tenant id), truncated to 32 hex characters, under the
gateway's own `--salt-key`, which no other role holds. Nothing a client sends can set or
change it: request bodies never carry it and the gateway ignores any such field.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdmesh.services.protocol.errors import ConfigError

DEV_TENANTS_FILE = Path(__file__).with_name("dev_tenants.toml")
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class TenantLimits:
    max_concurrent: int = 64
    kv_share: float = 1.0
    requests_per_s: float = 0.0  # 0: no limit
    tokens_per_s: float = 0.0  # 0: no limit
    weight: float = 1.0


SHARED_KV_SHARE = 0.5  # the default kv_share of a file naming several tenants
# key -> (type read, the check, what the check demands)
LIMIT_KEYS: dict[str, tuple[type, Any, str]] = {
    "max_concurrent": (int, lambda v: v >= 1, "an integer >= 1"),
    "kv_share": (float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "requests_per_s": (float, lambda v: 0 <= v < math.inf, "a number >= 0 (0: no limit)"),
    "tokens_per_s": (float, lambda v: 0 <= v < math.inf, "a number >= 0 (0: no limit)"),
    "weight": (float, lambda v: 0 < v < math.inf, "a number > 0"),
}
TENANT_KEYS = frozenset({"id", "api_keys", "api_key_sha256s", *LIMIT_KEYS})


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    cache_salt: str
    limits: TenantLimits = TenantLimits()


def sha256_hex(api_key: str) -> str:
    """The digest `api_key_sha256s` lists for `api_key`."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def cache_salt(salt_key: str, tenant_id: str) -> str:
    """The tenant's server-side cache salt under the gateway's salt key (hex)."""
    return hmac.new(bytes.fromhex(salt_key), f"cache-salt:{tenant_id}".encode(),
                    hashlib.sha256).hexdigest()[:32]


def _limits(table: dict[str, Any], base: dict[str, Any], where: str,
            bad: Any) -> dict[str, Any]:
    """`base` updated with the limits `table` sets, each checked."""
    out = dict(base)
    for key, (kind, ok, demand) in LIMIT_KEYS.items():
        if key not in table:
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and not isinstance(value, int)) or not ok(value):
            raise bad(f"{where}: {key} = {value!r} must be {demand}")
        out[key] = kind(value)
    return out


def _strings(entry: dict[str, Any], name: str) -> list[str] | None:
    """The entry's list `name` ([] when absent), or None when it is not a list of
    non-empty strings."""
    value = entry.get(name, [])
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        return None
    return value


class TenantDirectory:
    def __init__(self, digests: list[tuple[bytes, Tenant]]) -> None:
        self._digests = digests  # (SHA-256 of an API key, its tenant)

    @classmethod
    def load(cls, path: str | Path, salt_key: str) -> TenantDirectory:
        """The tenants of `path` (empty: the bundled dev tenants), salted with `salt_key`
        (hex, the gateway's `--salt-key`)."""
        try:
            bytes.fromhex(salt_key)
        except ValueError:
            raise ConfigError("salt_key", "(hidden)", "must be hex") from None
        path = Path(path) if path else DEV_TENANTS_FILE
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("tenants_file", str(path), exc.strerror or str(exc)) from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("tenants_file", str(path), f"not valid TOML: {exc}") from None
        entries = data.get("tenant")
        if not isinstance(entries, list) or not entries:
            raise ConfigError("tenants_file", str(path), "needs at least one [[tenant]] table")

        def bad(problem: str) -> ConfigError:
            return ConfigError("tenants_file", str(path), problem)

        unknown = sorted(set(data) - {"tenant", "defaults"})
        if unknown:
            raise bad(f"unknown table or key {unknown[0]!r} (tenant, defaults)")
        defaults = data.get("defaults", {})
        if not isinstance(defaults, dict):
            raise bad("defaults must be a table")
        extra = sorted(set(defaults) - set(LIMIT_KEYS))
        if extra:
            raise bad(f"[defaults]: unknown key {extra[0]!r} (limits: {', '.join(LIMIT_KEYS)})")
        base = _limits(defaults, {"kv_share": SHARED_KV_SHARE if len(entries) > 1 else 1.0},
                       "[defaults]", bad)

        digests: list[tuple[bytes, Tenant]] = []
        owner: dict[bytes, str] = {}
        for i, entry in enumerate(entries):
            tid = entry.get("id") if isinstance(entry, dict) else None
            if not isinstance(tid, str) or not tid:
                raise bad(f"tenant #{i + 1} has no id")
            extra = sorted(set(entry) - TENANT_KEYS)
            if extra:
                raise bad(f"tenant {tid!r}: unknown key {extra[0]!r} (keys: "
                          f"{', '.join(sorted(TENANT_KEYS))})")
            limits = TenantLimits(**_limits(entry, base, f"tenant {tid!r}", bad))
            plain, hashed = _strings(entry, "api_keys"), _strings(entry, "api_key_sha256s")
            if plain is None or hashed is None or not (plain or hashed):
                raise bad(f"tenant {tid!r} needs a non-empty api_keys or api_key_sha256s "
                          "list of strings")
            wrong = [h for h in hashed if len(h) != 64 or not set(h.lower()) <= _HEX]
            if wrong:
                raise bad(f"tenant {tid!r}: {wrong[0]!r} in api_key_sha256s is not a SHA-256 "
                          "hex digest (64 hex characters)")
            tenant = Tenant(tenant_id=tid, cache_salt=cache_salt(salt_key, tid),
                            limits=limits)
            for digest in [bytes.fromhex(sha256_hex(k)) for k in plain] + [
                    bytes.fromhex(h) for h in hashed]:
                if digest in owner:
                    raise bad(f"API key reused by {tid!r}")
                owner[digest] = tid
                digests.append((digest, tenant))
        return cls(digests)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """`Authorization: Bearer <key>` -> tenant, or None (the key's digest compared in
        constant time with every digest)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = hashlib.sha256(authorization[len("Bearer "):].strip().encode()).digest()
        found = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented):
                found = tenant
        return found
