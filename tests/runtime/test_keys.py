"""Keys per purpose and per role: admission alone holds the signing key, the workers its
verify key, the gateway the salt key; the built-in dev keys need --allow-dev-credentials;
`pdmesh up` makes fresh keys per run and hands each role only its own."""

from __future__ import annotations

import argparse
import dataclasses
import secrets

import pytest

from pdmesh.services.ops import cli
from pdmesh.services.protocol import tickets
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import (
    CONFIGS,
    DEV_SALT_KEY,
    DEV_SIGNING_KEY,
    DEV_VERIFY_KEY,
    check_dev_credentials,
    dev_credentials,
    resolve,
    up_settings,
)
from pdmesh.services.runtime.settings import ROLES

KEYS = {"signing_key": "PDMESH_SIGNING_KEY", "verify_key": "PDMESH_VERIFY_KEY",
        "salt_key": "PDMESH_SALT_KEY", "kv_tier_key": "PDMESH_KV_TIER_KEY"}
HOLDS = {"admission": {"signing_key"}, "prefill": {"verify_key", "kv_tier_key"},
         "decode": {"verify_key"}, "colocated": {"verify_key"},
         "gateway": {"salt_key"}}
REAL = {"PDMESH_SIGNING_KEY": tickets.generate_signing_key(),
        "PDMESH_VERIFY_KEY": tickets.verify_key_of(tickets.generate_signing_key()),
        "PDMESH_SALT_KEY": secrets.token_hex(32),
        "PDMESH_KV_TIER_KEY": secrets.token_hex(32),
        "PDMESH_TENANTS_FILE": "/etc/pdmesh/tenants.toml"}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_config_carries_only_its_own_key(role: str) -> None:
    fields = {f.name for f in dataclasses.fields(CONFIGS[role])}
    assert fields & set(KEYS) == HOLDS[role]
    assert "mesh_secret" not in fields
    for other in set(KEYS) - HOLDS[role]:
        with pytest.raises(ConfigError, match="is not a setting of"):
            resolve(role, {other: "ab" * 32}, {})


def test_no_config_but_admissions_can_sign() -> None:
    """The gateway, prefill and decode configs have no signing key: nothing they hold makes
    a ticket a worker accepts."""
    for role in ("gateway", "prefill", "decode", "colocated"):
        assert not hasattr(resolve(role, {}, REAL), "signing_key"), role
    assert not hasattr(resolve("gateway", {}, REAL), "verify_key")
    assert resolve("admission", {}, REAL).signing_key == REAL["PDMESH_SIGNING_KEY"]


@pytest.mark.parametrize("value", ["", "ab" * 31, "ab" * 33, "zz" * 32, "pdmesh-dev-secret"])
@pytest.mark.parametrize("role,field", [("admission", "signing_key"),
                                        ("decode", "verify_key"), ("gateway", "salt_key"),
                                        ("prefill", "kv_tier_key")])
def test_a_malformed_key_is_refused_naming_flag_and_env(role: str, field: str,
                                                        value: str) -> None:
    # By env var, and by flag (an empty env var means "not set", an empty flag does not).
    for given, env in (({}, {KEYS[field]: value}), ({field: value}, {})):
        if not value and not given:
            continue
        with pytest.raises(ConfigError) as info:
            resolve(role, given, env)
        assert info.value.field == field and KEYS[field] in str(info.value)
        assert "hex" in str(info.value)


def test_the_dev_pair_is_one_key_pair() -> None:
    assert tickets.verify_key_of(DEV_SIGNING_KEY) == DEV_VERIFY_KEY
    assert len({DEV_SIGNING_KEY, DEV_VERIFY_KEY, DEV_SALT_KEY}) == 3


@pytest.mark.parametrize("role", ROLES)
def test_dev_keys_are_refused_unless_allowed(role: str) -> None:
    cfg = resolve(role, {}, {})
    found = dev_credentials(cfg)
    for field in HOLDS[role]:
        assert any(f"dev {field.replace('_', ' ')}" in what for what in found), found
    with pytest.raises(ConfigError) as info:
        check_dev_credentials(cfg, allowed=False)
    assert info.value.field in HOLDS[role] and "--allow-dev-credentials" in str(info.value)
    check_dev_credentials(cfg, allowed=True)
    real = resolve(role, {}, REAL)
    assert dev_credentials(real) == []
    check_dev_credentials(real, allowed=False)


# -- `pdmesh up`: fresh keys per run, each role only its own ---------------------------------
def _up_args(**given: str) -> argparse.Namespace:
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    for k, v in given.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("colocated", [False, True])
def test_up_gives_each_role_only_its_key(colocated: bool) -> None:
    cfgs = cli.up_configs(_up_args(tenants_file="/etc/pdmesh/tenants.toml"),
                          colocated=colocated, env={})
    env = cli.up_env(cfgs, allow_dev=False)
    signing = env["admission"]["PDMESH_SIGNING_KEY"]
    for role, role_env in env.items():
        held = {f for f, name in KEYS.items() if name in role_env}
        assert held == HOLDS[role], role
    workers = [r for r in env if r not in ("admission", "gateway")]
    for role in workers:
        assert env[role]["PDMESH_VERIFY_KEY"] == tickets.verify_key_of(signing)
    # The pair works end to end, and nothing of it is a dev key.
    t = tickets.Signer(signing).sign(request_id="r", tenant="t", cache_salt="s",
                                     prompt_len=1, max_tokens=1, prefill_worker="p",
                                     decode_worker="d", ttl_s=5)
    role = workers[-1]
    tickets.TicketVerifier(env[role]["PDMESH_VERIFY_KEY"], "d", tickets.m.Role.DECODE).verify(t)
    assert signing != DEV_SIGNING_KEY and env["gateway"]["PDMESH_SALT_KEY"] != DEV_SALT_KEY
    for role_cfg in cfgs.values():
        check_dev_credentials(role_cfg, allowed=False)  # fresh keys are no dev credentials


def test_up_makes_fresh_keys_per_run_unless_given() -> None:
    runs = [cli.up_env(cli.up_configs(_up_args(), colocated=False, env={}), False)
            for _ in range(2)]
    assert runs[0]["admission"]["PDMESH_SIGNING_KEY"] != runs[1]["admission"][
        "PDMESH_SIGNING_KEY"]
    assert runs[0]["gateway"]["PDMESH_SALT_KEY"] != runs[1]["gateway"]["PDMESH_SALT_KEY"]
    assert runs[0]["prefill"]["PDMESH_KV_TIER_KEY"] != runs[1]["prefill"]["PDMESH_KV_TIER_KEY"]
    tier_key = "e7" * 16 + "3c" * 16
    kept = cli.up_env(cli.up_configs(_up_args(), colocated=False,
                                     env={"PDMESH_KV_TIER_KEY": tier_key}), False)
    assert kept["prefill"]["PDMESH_KV_TIER_KEY"] == tier_key  # tiers 2/3 stay readable
    signing, salt = tickets.generate_signing_key(), "cd" * 32
    by_flag = cli.up_env(cli.up_configs(_up_args(signing_key=signing, salt_key=salt),
                                        colocated=False, env={}), False)
    by_env = cli.up_env(cli.up_configs(_up_args(), colocated=False, env={
        "PDMESH_SIGNING_KEY": signing, "PDMESH_SALT_KEY": salt,
        "PDMESH_VERIFY_KEY": DEV_VERIFY_KEY}), False)  # a stray verify key is not used
    for env in (by_flag, by_env):
        assert env["admission"]["PDMESH_SIGNING_KEY"] == signing
        assert env["gateway"]["PDMESH_SALT_KEY"] == salt
        assert env["decode"]["PDMESH_VERIFY_KEY"] == tickets.verify_key_of(signing)


def test_up_refuses_a_malformed_key_before_starting() -> None:
    """One clear error naming the flag and env var, without echoing the would-be key."""
    almost = tickets.generate_signing_key()[:-1]
    for given, env in (({"signing_key": almost}, {}), ({}, {"PDMESH_SALT_KEY": almost})):
        with pytest.raises(ConfigError) as info:
            cli.up_configs(_up_args(**given), colocated=False, env=env)
        field = "signing_key" if given else "salt_key"
        assert info.value.field == field and KEYS[field] in str(info.value)
        assert almost not in str(info.value) and info.value.value == "(hidden)"
