"""Compose files: valid against the Compose Specification, accepted by docker-compose, and in
parity with `services/ops/topology.py` (what `pdmesh up` launches).

The real run of the stack is `make test-compose` (compose/ci.sh); these checks need no engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator

from pdmesh.services.ops import natsauth
from pdmesh.services.ops.topology import mesh_services
from pdmesh.services.runtime.config import SETTINGS

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
SCHEMA = Path(__file__).with_name("schema") / "compose-spec.json"  # vendored, Apache-2.0
LAB = COMPOSE / "docker-compose.yml"
CI_OVERRIDE = COMPOSE / "docker-compose.ci.yml"
UCX_OVERRIDE = COMPOSE / "docker-compose.ucx.yml"
FAULTS = sorted((REPO / "tests" / "compose" / "faults").glob("*.yml"))
ROLE_FILES = sorted((COMPOSE / "multihost").glob("*.yml"))
OVERRIDES = [CI_OVERRIDE, UCX_OVERRIDE, *FAULTS]
ALL_FILES = [LAB, *ROLE_FILES, *OVERRIDES]
KNOWN_ENV = {s.env for s in SETTINGS}
# What ${...} in the files needs for `docker-compose config` (values are placeholders).
CONFIG_ENV = {"PDMESH_ADVERTISE_HOST": "127.0.0.1", "CONTROL_HOST": "127.0.0.1",
              "PREFILL_HOST": "127.0.0.1", "DECODE_HOST": "127.0.0.1"}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("compose_generate", COMPOSE / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pdmesh_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in doc["services"].items()
            if svc.get("command", [None])[0] == "pdmesh"}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Enough of compose's merge for these files: mappings merge, everything else replaces."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


# ---- Compose Specification -------------------------------------------------------------

@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    return json.loads(SCHEMA.read_text())


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_file_matches_compose_spec(path: Path, compose_schema: dict[str, Any]) -> None:
    validator = Draft7Validator(compose_schema)  # the spec's $schema: draft-07
    errors = sorted(validator.iter_errors(_load(path)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_schema_rejects_a_broken_file(compose_schema: dict[str, Any]) -> None:
    """The validation above can fail: a misspelt key is caught."""
    validator = Draft7Validator(compose_schema)  # the spec's $schema: draft-07
    broken = _load(LAB)
    broken["services"]["decode"]["helthcheck"] = broken["services"]["decode"].pop("healthcheck")
    assert list(validator.iter_errors(broken))


# ---- docker-compose config ---------------------------------------------------------------

STACKS = [[LAB], [LAB, CI_OVERRIDE], [LAB, UCX_OVERRIDE],
          *[[LAB, CI_OVERRIDE, fault] for fault in FAULTS], *[[role] for role in ROLE_FILES]]


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("files", STACKS, ids=lambda fs: "+".join(f.name for f in fs))
def test_docker_compose_accepts(files: list[Path], tmp_path: Path) -> None:
    natsauth.write_secrets(tmp_path, hosts=["10.0.0.10", "10.0.0.11", "10.0.0.12"])
    (tmp_path / "tenants.toml").write_text('[[tenant]]\nid = "t"\napi_keys = ["k"]\n')
    env = {**os.environ, **CONFIG_ENV, "PDMESH_SECRETS_DIR": str(tmp_path)}
    argv = ["docker-compose", *[a for f in files for a in ("-f", str(f))], "config", "-q"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60,
                            cwd=files[0].parent, check=False)
    assert result.returncode == 0, result.stderr


# ---- parity with services/ops/topology.py ------------------------------------------------------

def test_generated_files_are_up_to_date() -> None:
    for path, text in _generator().outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run python compose/generate.py"


def test_lab_runs_exactly_the_topology() -> None:
    """Same services, same commands, same per-process environment as `pdmesh up`."""
    services = _pdmesh_services(_load(LAB))
    specs = mesh_services()
    assert set(services) == {spec.name for spec in specs}
    for spec in specs:
        svc = services[spec.name]
        assert svc["command"] == list(spec.argv)
        assert spec.env.items() <= svc["environment"].items(), spec.name
        assert svc["healthcheck"]["test"] == [
            "CMD", "pdmesh-ready", f"http://127.0.0.1:{spec.http_port}/ready"]


def test_ci_override_runs_the_topology_on_the_stacks_own_network() -> None:
    """CI runs the lab as it is: every container its own network stack on the compose
    bridge network (no host networking), the default model, the lab's commands and env."""
    lab, ci = _load(LAB), _load(CI_OVERRIDE)
    merged = {name: _merge(svc, ci["services"].get(name, {}))
              for name, svc in lab["services"].items()}
    assert not any("network_mode" in svc for svc in merged.values())
    assert "${PDMESH_MODEL:-smollm2}" == merged["gateway"]["environment"]["PDMESH_MODEL"]
    for spec in _generator().ci_specs():
        svc = merged[spec.name]
        assert svc["environment"]["PDMESH_NATS_URL"] == "nats://nats:4222"
        assert svc["command"] == list(spec.argv)
        assert spec.env.items() <= svc["environment"].items(), spec.name
        assert svc["healthcheck"]["test"][-1] == f"http://127.0.0.1:{spec.http_port}/ready"


@pytest.mark.parametrize("path", [LAB, *ROLE_FILES, *OVERRIDES],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_every_pdmesh_setting_exists(path: Path) -> None:
    """A misspelt PDMESH_* variable would be ignored silently by the service."""
    for name, svc in _load(path)["services"].items():
        unknown = {k for k in svc.get("environment", {}) if k.startswith("PDMESH_")} - KNOWN_ENV
        assert not unknown, f"{path.name}:{name} sets unknown settings {unknown}"


@pytest.mark.parametrize("path", ROLE_FILES, ids=lambda p: p.name)
def test_role_files_run_topology_commands(path: Path) -> None:
    specs = {spec.name: spec for spec in mesh_services()}
    services = _pdmesh_services(_load(path))
    assert services
    for name, svc in services.items():
        assert svc["command"] == list(specs[name].argv)
        assert specs[name].env.items() <= svc["environment"].items(), name


@pytest.mark.parametrize("path", OVERRIDES, ids=lambda p: str(p.relative_to(REPO)))
def test_overrides_name_only_lab_services(path: Path) -> None:
    """A typo in an override would add a service with no image instead of changing one."""
    assert set(_load(path)["services"]) <= set(_load(LAB)["services"])


@pytest.mark.parametrize("path", [LAB, *ROLE_FILES], ids=lambda p: str(p.relative_to(REPO)))
def test_nats_runs_with_credentials_from_secrets(path: Path) -> None:
    """NATS loads the authorization block `pdmesh secrets` writes, and every service reads
    its role's NATS user from that role's env file (not another role's, not none)."""
    doc = _load(path)
    nats_cmd = [str(a) for a in doc["services"]["nats"]["command"]]
    conf = next((a.split("=", 1)[1] for a in nats_cmd if a.startswith("--config=")), None)
    if conf is None and "--config" in nats_cmd:
        conf = nats_cmd[nats_cmd.index("--config") + 1]
    # The lab: one node, users only; multi-host: users plus the authenticated cluster routes.
    name = "nats.conf" if path == LAB else "nats-cluster.conf"
    assert conf == f"/run/secrets/{name}", nats_cmd
    assert not any(a.startswith(("--routes", "--cluster")) for a in nats_cmd), \
        "cluster flags replace the config's cluster block (and its route authorization)"
    mounts = {s["target"]: s["source"] for s in doc["services"]["nats"].get("secrets", [])}
    assert doc["secrets"][mounts[name]]["file"].endswith(f"/{name}")
    for name, svc in _pdmesh_services(doc).items():
        role = svc["command"][-1]
        env_files = [Path(f).name for f in svc["env_file"]]
        assert [f for f in env_files if f.startswith("nats-")] == [f"nats-{role}.env"], name
        assert role in natsauth.ROLES


@pytest.mark.parametrize("path", [LAB, *ROLE_FILES], ids=lambda p: str(p.relative_to(REPO)))
def test_each_service_mounts_only_its_roles_key(path: Path) -> None:
    """Admission the signing key, prefill and decode its verify key (prefill the KV-tier key
    too), the gateway the salt key (`pdmesh secrets`' files): no other service holds a key
    that signs tickets."""
    for name, svc in _pdmesh_services(_load(path)).items():
        role = svc["command"][-1]
        env_files = [Path(f).name for f in svc["env_file"]]
        keys = [f for f in env_files if f in natsauth.KEY_FILES]
        assert keys == [k for k, (_, roles) in natsauth.KEY_FILES.items() if role in roles], \
            (name, env_files)
        assert [f for f in env_files if f not in keys and not f.startswith("nats-")] == [], \
            (name, env_files)
        assert not any(k.startswith("PDMESH_") and "KEY" in k for k in svc["environment"]), \
            name


def test_gateway_is_the_only_published_port() -> None:
    published = {name for name, svc in _load(LAB)["services"].items()
                 if svc.get("ports") and not svc.get("profiles")}
    assert published == {"gateway"}


def test_dockerfile_copies_every_packaged_module() -> None:
    """The image copies the project module by module (no .venv, no .git in a layer): a new
    package in pyproject.toml must get its COPY line too."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # Installed as pdmesh.<name> from the top-level folder package-dir maps it to.
    wanted = sorted(set(setuptools["package-dir"].values()))
    assert wanted and all(p.startswith("pdmesh.") for p in setuptools["packages"])
    wanted += [f"{m}.py" for m in setuptools.get("py-modules", [])]
    copies = [line.split()[1:-1] for line in (COMPOSE / "Dockerfile").read_text().splitlines()
              if line.startswith("COPY ") and "--from" not in line]
    copied = {src for srcs in copies for src in srcs}
    assert not [w for w in wanted if w not in copied], f"Dockerfile misses {wanted}"
