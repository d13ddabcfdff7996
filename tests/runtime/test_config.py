"""Configuration: one row per setting, one validated frozen config per role, README
documents every setting, and no module reads a `PDMESH_*` variable the table lacks."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from pdmesh.services.ops import cli
from pdmesh.services.protocol.errors import ConfigError
from pdmesh.services.runtime.config import (
    CONFIGS,
    SETTINGS,
    markdown_table,
    resolve,
    resolve_nats,
    settings_of,
    up_settings,
)
from pdmesh.services.runtime.settings import BY_ENV, BY_FIELD, CHECK, ROLES
from tests.support.meshproc import REPO


def test_readme_documents_every_setting() -> None:
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme, "README settings table is stale: regenerate it with " \
        "`python -m pdmesh.services.runtime.config`"
    for s in SETTINGS:
        assert s.env in readme and (s.flag is None or s.flag in readme)


def test_precedence_flag_over_env_over_default() -> None:
    env = {"PDMESH_TRANSPORT": "ucx", "PDMESH_KV_TOKENS": "100"}
    cfg = resolve("decode", {"kv_tokens": "64"}, env)
    assert cfg.transport == "ucx" and cfg.kv_tokens == 64 and cfg.page_tokens == 16
    assert cfg.kv_pages == 4
    assert cfg.http_port == 8103
    assert resolve("gateway", {}, {"PDMESH_GATEWAY_PORT": "9000"}).http_port == 9000


@pytest.mark.parametrize("env,field", [
    ({"PDMESH_TRANSPORT": "smoke"}, "transport"),
    ({"PDMESH_KV_TOKENS": "-1"}, "kv_tokens"),
    ({"PDMESH_KV_TOKENS": "lots"}, "kv_tokens"),
    ({"PDMESH_HTTP_PORT": "70000"}, "http_port"),
    ({"PDMESH_NATS_URL": "http://x"}, "nats_url"),
    ({"PDMESH_WORKER_ID": "a.b"}, "worker_id"),
    ({"PDMESH_FAULTS": "bypass_admission"}, "faults"),
])
def test_bad_settings_name_the_field_flag_and_env(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve("decode", {}, env)
    assert info.value.field == field
    s = BY_FIELD[field]
    assert s.flag in str(info.value) and s.env in str(info.value), str(info.value)


def test_a_bad_flag_names_the_flag_and_the_env_var() -> None:
    with pytest.raises(ConfigError) as info:
        resolve("gateway", {"max_n": "0"}, {})
    assert str(info.value) == ("bad setting max_n=0: --max-n must be > 0 (PDMESH_MAX_N)")
    with pytest.raises(ConfigError, match=r"--gateway-port port must be in 0\.\.65535"):
        resolve("gateway", {"gateway_port": "70000"}, {})  # not the http port it gives


def test_faults_need_explicit_permission() -> None:
    cfg = resolve("admission", {}, {"PDMESH_FAULTS": "bypass_admission",
                                    "PDMESH_ALLOW_FAULTS": "1"})
    assert cfg.fault_set == {"bypass_admission"}
    with pytest.raises(ConfigError, match="PDMESH_ALLOW_FAULTS=1"):
        resolve("admission", {"faults": "bypass_admission"}, {"PDMESH_ALLOW_FAULTS": "yes"})


# -- one declaration: the config classes are the table -------------------------------------
@pytest.mark.parametrize("role", sorted(CONFIGS))
def test_each_role_config_holds_exactly_its_rows(role: str) -> None:
    fields = [f for f in dataclasses.fields(CONFIGS[role]) if f.name != "role"]
    assert sorted(f.name for f in fields) == sorted(s.field for s in settings_of(role))
    for f in fields:
        s = f.metadata["setting"]
        assert s is BY_FIELD[f.name] and (f.type, f.default) == (s.kind, s.default)
    cfg = resolve(role, {}, {}) if role in ROLES else resolve_nats({}, {})
    assert type(cfg) is CONFIGS[role] and cfg.role == role
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nats_url = "nats://elsewhere:4222"  # type: ignore[misc]


@pytest.mark.parametrize("role,absent", [
    ("gateway", ("kv_tokens", "transport", "max_batch", "data_port", "prefill_max_active")),
    ("admission", ("model", "kv_tokens", "tenants_file", "max_n", "prefill_stall_s")),
    ("prefill", ("max_batch", "tenants_file", "ticket_ttl_s", "worker_ttl_s")),
    ("decode", ("prefill_max_active", "tenants_file", "queue_timeout_s", "max_n")),
    ("colocated", ("prefill_max_active", "tenants_file", "ticket_ttl_s")),
])
def test_a_role_config_lacks_other_roles_settings(role: str, absent: tuple[str, ...]) -> None:
    cfg = resolve(role, {}, {})
    for field in absent:
        assert not hasattr(cfg, field), f"{role} config carries {field}"
        with pytest.raises(ConfigError) as info:
            resolve(role, {field: "1"}, {})
        assert info.value.field == field and BY_FIELD[field].flag in str(info.value)
    # A shared environment serves every role: the env var of another role's setting is
    # not this role's business.
    env = {BY_FIELD[field].env: "not a number" for field in absent}
    assert resolve(role, {}, env) == cfg


def test_check_takes_the_nats_rows_only() -> None:
    cfg = resolve_nats({"nats_url": "tls://a:4222,tls://b:4222"},
                       {"PDMESH_NATS_USER": "tools", "PDMESH_NATS_PASSWORD": "pw",
                        "PDMESH_KV_TOKENS": "lots"})
    assert (cfg.nats_servers, cfg.nats_user, cfg.nats_password) == (
        ["tls://a:4222", "tls://b:4222"], "tools", "pw")
    assert not hasattr(cfg, "worker_id") and not hasattr(cfg, "signing_key")
    assert {s.field for s in settings_of(CHECK)} == {
        "nats_url", "nats_user", "nats_password", "nats_tls_ca"}


def test_pdmesh_check_parses_nats_like_a_service(capsys: pytest.CaptureFixture[str]) -> None:
    from pdmesh.loadtest import check

    assert check.main(["--nats-url", "http://x", "--no-probe"]) == check.EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "--nats-url" in err and "PDMESH_NATS_URL" in err, err


# -- flags: `pdmesh serve <role>` and `pdmesh up` ----------------------------------------------
def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _flags(text: str) -> set[str]:
    """The options a --help lists (each on a line of its own, indented two spaces)."""
    return set(re.findall(r"^  (--[a-z][a-z-]*)", text, re.M)) - {"--help"}


@pytest.mark.parametrize("role", ROLES)
def test_serve_offers_exactly_the_roles_flags(role: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    offered = _flags(_help(["serve", role], capsys))
    assert offered == {s.flag for s in settings_of(role)} | {"--allow-dev-credentials"}


def test_serve_refuses_another_roles_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "gateway", "--kv-tokens", "64"])
    assert info.value.code == 2
    assert "unrecognized arguments: --kv-tokens 64" in capsys.readouterr().err


def test_up_flags_come_from_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    offered = _flags(_help(["up"], capsys))
    own = {"--prefill", "--decode", "--quiet", "--colocated", "--keep-going", "--restart"}
    assert offered == {s.flag for s in up_settings()} | own
    assert "--torch-threads" in offered and "--faults" not in offered


def test_up_hands_each_role_its_own_settings() -> None:
    args = argparse.Namespace(**{s.field: None for s in up_settings()})
    args.kv_tokens, args.max_n, args.model = "64", "3", "tiny"
    env = cli.up_env(cli.up_configs(args, colocated=False), allow_dev=True)
    assert set(env) == {"admission", "prefill", "decode", "gateway"}
    assert env["prefill"]["PDMESH_KV_TOKENS"] == env["decode"]["PDMESH_KV_TOKENS"] == "64"
    assert env["gateway"]["PDMESH_MAX_N"] == "3" and env["gateway"]["PDMESH_MODEL"] == "tiny"
    assert "PDMESH_KV_TOKENS" not in env["gateway"] and "PDMESH_MAX_N" not in env["decode"]
    assert "PDMESH_MODEL" not in env["admission"]
    for role, role_env in env.items():
        assert {BY_ENV[name].field for name in role_env} - {"allow_dev_credentials"} <= {
            s.field for s in settings_of(role)}, role
        assert role_env["PDMESH_ALLOW_DEV_CREDENTIALS"] == "1"
    assert set(cli.up_env(cli.up_configs(args, colocated=True), False)) == {
        "admission", "colocated", "gateway"}


# -- every PDMESH_* variable the tree names is declared ---------------------------------------
SCANNED = ("services", "gateway", "kvstore", "transports", "loadtest", "compose")
# `${PDMESH_X:-...}` is compose's own interpolation, not a variable pdmesh reads.
ENV_NAME = re.compile(r"(?<![{\w])PDMESH_[A-Z0-9]+(?:_[A-Z0-9]+)*")
# The modules that read settings for every role, through the table's rows.
TABLE_READERS = ("services/runtime/config.py", "services/runtime/settings.py")


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def scan(source: str) -> tuple[set[str], set[str], set[str]]:
    """(PDMESH_* names the source spells, names it reads from os.environ directly, prefixes
    it builds names from) for one module's source."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def name_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    spelt, read, built = set(), set(), set()
    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelt.update(ENV_NAME.findall(node.value))
            if node.value.endswith("PDMESH_"):
                built.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg:  # env.update(PDMESH_X=...)
            spelt.update(ENV_NAME.findall(node.arg))
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if _is_environ(node.func.value) or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        name = name_of(key) if key is not None else None
        if name and name.startswith("PDMESH_"):
            read.add(name)
    return spelt, read, built


def _tree() -> dict[str, tuple[set[str], set[str], set[str]]]:
    return {str(p.relative_to(REPO)): scan(p.read_text())
            for pkg in SCANNED for p in sorted((REPO / pkg).rglob("*.py"))}


def test_the_scan_sees_reads_spellings_and_built_names() -> None:
    spelt, read, built = scan(
        'import os\nNAME = "PDMESH_SECRET_SAUCE"\nos.environ.get(NAME)\n'
        'os.getenv("PDMESH_A")\nos.environ["PDMESH_B"]\n"PDMESH_C" in os.environ\n'
        'env.update(PDMESH_D="1")\nos.environ.get("PDMESH_" + x)\n"${PDMESH_COMPOSE}"\n')
    assert read == {"PDMESH_SECRET_SAUCE", "PDMESH_A", "PDMESH_B", "PDMESH_C"}
    assert spelt == read | {"PDMESH_D"} and built == {"PDMESH_"}
    found = _tree()
    assert {"PDMESH_CACHE_DIR"} <= found["services/engine/checkpoint.py"][1]
    assert {"PDMESH_NATIVE_KERNELS"} <= found["services/engine/native.py"][1]
    assert {"PDMESH_UCX_ERROR_MODE"} <= found["transports/ucx.py"][1]


def test_every_pdmesh_variable_named_in_the_tree_is_declared() -> None:
    problems = []
    for path, (spelt, _read, built) in _tree().items():
        problems += [f"{path}: {name} has no row in services/runtime/settings.py"
                     for name in sorted(spelt - set(BY_ENV))]
        problems += [f"{path}: builds a PDMESH_* name from {b!r}" for b in sorted(built)
                     if path not in TABLE_READERS]
    assert problems == [], "\n".join(problems)


def test_direct_env_reads_are_the_rows_readers() -> None:
    """Outside the table's own modules, a module that reads a PDMESH_* variable from the
    environment is named in its row's `read_by`; and every `read_by` is true."""
    found = _tree()
    problems = [f"{path} reads {name} but is not in its row's read_by"
                for path, (_spelt, read, _built) in found.items() if path not in TABLE_READERS
                for name in sorted(read) if path not in getattr(BY_ENV.get(name), "read_by", ())]
    for s in SETTINGS:
        for path in s.read_by:
            text = (REPO / path).read_text()
            assert s.env in found[path][1] or f'env_value("{s.field}"' in text, (path, s.env)
    assert problems == [], "\n".join(problems)


def test_readers_below_the_runtime_follow_their_rows(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """The engine and the ucx transport may not import the table, so they repeat the name:
    held here to its row's default and choices."""
    from pdmesh.services.engine import checkpoint, native
    from pdmesh.transports import ucx

    readers = {"PDMESH_NATIVE_KERNELS": native.setting,
               "PDMESH_UCX_ERROR_MODE": ucx.error_mode_setting}
    assert (native.SETTING, ucx.ERROR_MODE_ENV) == tuple(readers)
    for env, read in readers.items():
        s = BY_ENV[env]
        monkeypatch.delenv(env, raising=False)
        assert read() == s.default
        for choice in s.choices or ():
            monkeypatch.setenv(env, choice)
            assert read() == choice
        monkeypatch.setenv(env, "sideways")
        with pytest.raises(ValueError, match=env):
            read()
    monkeypatch.delenv("PDMESH_CACHE_DIR", raising=False)
    assert checkpoint.cache_dir() == Path(BY_ENV["PDMESH_CACHE_DIR"].default).expanduser()
    monkeypatch.setenv("PDMESH_CACHE_DIR", str(tmp_path))
    assert checkpoint.cache_dir() == tmp_path and native._cache_dir() == tmp_path / "kernels"
