"""Tenants and API keys, loaded once from TOML; each tenant gets a server-side cache salt.

File format (``--tenants FILE`` / ``PDMESH_TENANTS_FILE``)::

    [[tenant]]
    id = "acme"
    api_keys = ["sk-..."]

The cache salt that namespaces a tenant's prefix-cache entries (invariant I7) is derived on
the server from the mesh secret and the tenant id. Nothing a client sends can set or change
it: request bodies never carry it and the gateway ignores any such field.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pdmesh.services.protocol.errors import ConfigError

DEV_TENANTS_FILE = Path(__file__).with_name("dev_tenants.toml")


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    cache_salt: str


class TenantDirectory:
    def __init__(self, keys: dict[str, Tenant]) -> None:
        self._by_key = keys

    @classmethod
    def load(cls, path: str | Path, mesh_secret: str) -> TenantDirectory:
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
        keys: dict[str, Tenant] = {}
        for i, entry in enumerate(entries):
            tid = entry.get("id") if isinstance(entry, dict) else None
            api_keys = entry.get("api_keys") if isinstance(entry, dict) else None
            if not isinstance(tid, str) or not tid:
                raise ConfigError("tenants_file", str(path), f"tenant #{i + 1} has no id")
            if (not isinstance(api_keys, list) or not api_keys
                    or not all(isinstance(k, str) and k for k in api_keys)):
                raise ConfigError("tenants_file", str(path),
                                  f"tenant {tid!r} needs a non-empty api_keys list of strings")
            salt = hmac.new(mesh_secret.encode(), f"cache-salt:{tid}".encode(),
                            hashlib.sha256).hexdigest()[:32]
            for k in api_keys:
                if k in keys:
                    raise ConfigError("tenants_file", str(path), f"API key reused by {tid!r}")
                keys[k] = Tenant(tenant_id=tid, cache_salt=salt)
        return cls(keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """`Authorization: Bearer <key>` -> tenant, or None (compared in constant time)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = authorization[len("Bearer "):].strip().encode()
        found = None
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(key.encode(), presented):
                found = tenant
        return found
