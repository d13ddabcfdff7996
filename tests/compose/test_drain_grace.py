"""Compose must not SIGKILL a service before its drain is over: in every compose file, each
pdmesh service's `stop_grace_period` outlasts its drain timeout (PDMESH_DRAIN_TIMEOUT_S, as
the file sets it or by default) by the margin `pdmesh up` gives (the hand-off and the NATS
flush after the drain timeout). And the CI stack has what its rolling restart needs: two
decode replicas, each with its own worker id."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pdmesh.services.ops.launcher import STOP_MARGIN_S
from pdmesh.services.runtime.settings import BY_FIELD
from tests.compose.test_compose_files import (
    CI_OVERRIDE,
    FAULTS,
    LAB,
    REPO,
    ROLE_FILES,
    UCX_OVERRIDE,
    _load,
    _merge,
    _pdmesh_services,
)

DRAIN = BY_FIELD["drain_timeout_s"]
WORKER_ID_ENV = BY_FIELD["worker_id"].env
# Every stack a user or CI runs: the lab alone and with each override, each role file.
STACKS = [[LAB], [LAB, CI_OVERRIDE], [LAB, UCX_OVERRIDE],
          *[[LAB, CI_OVERRIDE, fault] for fault in FAULTS], *[[role] for role in ROLE_FILES]]
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_s(value: str) -> float:
    """A Compose duration (`40s`, `1m30s`, `500ms`) in seconds."""
    parts = _DURATION.findall(value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def drain_timeout_s(service: dict[str, Any]) -> float:
    """The service's drain timeout: its environment's (a `${VAR:-default}` counts with its
    default), else the setting's default."""
    value = str(service.get("environment", {}).get(DRAIN.env, DRAIN.default))
    if (m := re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)) is not None:
        value = m.group(1)
    return float(value)


def merged(files: list[Path]) -> dict[str, dict[str, Any]]:
    doc = _load(files[0])
    for override in files[1:]:
        doc = _merge(doc, _load(override))
    return _pdmesh_services(doc)


def short_grace(services: dict[str, dict[str, Any]]) -> list[str]:
    """The services whose grace period does not outlast their drain by STOP_MARGIN_S."""
    short = []
    for name, svc in services.items():
        grace = svc.get("stop_grace_period")
        drain = drain_timeout_s(svc)
        if grace is None or duration_s(str(grace)) - drain < STOP_MARGIN_S:
            short.append(f"{name}: stop_grace_period {grace}, drain timeout {drain:g}s")
    return short


@pytest.mark.parametrize("files", STACKS, ids=lambda fs: "+".join(
    str(f.relative_to(REPO)) for f in fs))
def test_stop_grace_period_outlasts_the_drain(files: list[Path]) -> None:
    services = merged(files)
    assert services
    assert short_grace(services) == []


def test_a_grace_period_at_the_drain_timeout_is_caught() -> None:
    """The check above can fail: a grace period equal to the drain timeout, none at all, or
    a drain timeout raised in the environment past the grace period."""
    services = merged([LAB])
    services["decode"] = {**services["decode"], "stop_grace_period": "30s"}
    services["prefill"] = {k: v for k, v in services["prefill"].items()
                           if k != "stop_grace_period"}
    services["gateway"] = _merge(services["gateway"],
                                 {"environment": {DRAIN.env: "${PDMESH_DRAIN_TIMEOUT_S:-35}"}})
    assert [line.split(":")[0] for line in short_grace(services)] == [
        "prefill", "decode", "gateway"]


def test_duration_s() -> None:
    assert duration_s("40s") == 40.0
    assert duration_s("1m30s") == 90.0
    assert duration_s("1500ms") == 1.5
    with pytest.raises(AssertionError):
        duration_s("40")


def test_ci_stack_rolls_two_decode_replicas_with_their_own_worker_ids() -> None:
    """compose/ci.sh restarts decode replicas one at a time: there must be two, and nothing
    may pin what makes their worker ids differ (each container's own hostname in the
    default `<role>-<hostname>-<pid>`) or clash between replicas (a published port)."""
    decode = merged([LAB, CI_OVERRIDE])["decode"]
    assert decode.get("scale", 1) >= 2
    assert WORKER_ID_ENV not in decode["environment"]
    assert not {"hostname", "container_name", "ports"} & decode.keys()
    assert "network_mode" not in decode
