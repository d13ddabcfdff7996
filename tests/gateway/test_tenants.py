"""The tenant directory: API keys in the clear or as SHA-256 digests, constant-time lookup,
and cache salts derived from the gateway's own salt key."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

from pdmesh.gateway.tenants import TenantDirectory, sha256_hex
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import DEV_SALT_KEY

SALT_KEY = "a1" * 32


def _load(tmp_path: Path, text: str, salt_key: str = SALT_KEY) -> TenantDirectory:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return TenantDirectory.load(path, salt_key)


def test_keys_in_the_clear_and_as_digests_both_authenticate(tmp_path: Path) -> None:
    d = _load(tmp_path, f"""
[[tenant]]
id = "acme"
api_keys = ["sk-acme-plain"]
api_key_sha256s = ["{sha256_hex('sk-acme-hashed')}"]

[[tenant]]
id = "globex"
api_key_sha256s = ["{sha256_hex('sk-globex').upper()}"]
""")
    for key, tenant in (("sk-acme-plain", "acme"), ("sk-acme-hashed", "acme"),
                        ("sk-globex", "globex")):
        found = d.authenticate(f"Bearer {key}")
        assert found is not None and found.tenant_id == tenant, key
    # The digest itself is no key, nor is a key's prefix or another header form.
    for header in (f"Bearer {sha256_hex('sk-acme-hashed')}", "Bearer sk-acme", "Bearer ",
                   "sk-acme-plain", "Basic sk-acme-plain", None, ""):
        assert d.authenticate(header) is None, header
    assert sha256_hex("sk-globex") == hashlib.sha256(b"sk-globex").hexdigest()


def test_the_cache_salt_is_the_salt_keys_hmac_of_the_tenant(tmp_path: Path) -> None:
    text = '[[tenant]]\nid = "acme"\napi_keys = ["k1"]\n[[tenant]]\nid = "b"\napi_keys = ["k2"]\n'
    d = _load(tmp_path, text)
    salt = d.authenticate("Bearer k1").cache_salt  # type: ignore[union-attr]
    expected = hmac.new(bytes.fromhex(SALT_KEY), b"cache-salt:acme", hashlib.sha256)
    assert salt == expected.hexdigest()[:32]
    assert d.authenticate("Bearer k2").cache_salt != salt  # type: ignore[union-attr]
    # Another salt key, other salts: whoever lacks the gateway's key cannot compute them.
    other = _load(tmp_path, text, "b2" * 32).authenticate("Bearer k1")
    assert other is not None and other.cache_salt != salt
    dev = TenantDirectory.load("", DEV_SALT_KEY).authenticate("Bearer sk-dev-alice")
    assert dev is not None and dev.tenant_id == "alice"


@pytest.mark.parametrize("text,problem", [
    ('[[tenant]]\nid = "a"\n', "api_keys or api_key_sha256s"),
    ('[[tenant]]\nid = "a"\napi_keys = []\napi_key_sha256s = []\n', "api_keys or"),
    ('[[tenant]]\nid = "a"\napi_keys = ["k"]\napi_key_sha256s = "x"\n', "list of strings"),
    ('[[tenant]]\nid = "a"\napi_key_sha256s = ["abc"]\n', "not a SHA-256"),
    ('[[tenant]]\nid = "a"\napi_key_sha256s = ["' + "g" * 64 + '"]\n', "not a SHA-256"),
    ('[[tenant]]\nid = "a"\napi_keys = ["k"]\n[[tenant]]\nid = "b"\napi_key_sha256s = ["'
     + sha256_hex("k") + '"]\n', "reused by 'b'"),
    ('[[tenant]]\nid = "a"\napi_keys = ["k", "k"]\n', "reused"),
    ('[[tenant]]\napi_keys = ["k"]\n', "no id"),
])
def test_a_bad_tenants_file_is_one_clear_error(tmp_path: Path, text: str,
                                                problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        _load(tmp_path, text)
    assert info.value.field == "tenants_file"


def test_a_malformed_salt_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        TenantDirectory.load("", "not hex")
    assert info.value.field == "salt_key" and "not hex" not in str(info.value)
