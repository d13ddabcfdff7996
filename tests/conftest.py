"""Shared fixtures: a real nats-server and a real mesh started exactly as `pdmesh up` does."""

from __future__ import annotations

import os
from collections.abc import Iterator

import hypothesis  # noqa: F401 - see below
import pytest

from tests.support.meshproc import Mesh, NatsServer, mesh_env, run_mesh

# Imported here, at collection, not first by hypothesis's plugin in the terminal summary:
# CPython 3.11's AST constructor keeps its recursion depth in a global, so pytest's
# assertion rewriting (ast.parse) of a module imported while a leftover thread of a test
# parses too can fail the whole run with "AST constructor recursion depth mismatch".

# Every process the suite starts runs with the dev tenants, as `make up` does (keys are
# fresh per mesh: meshproc.run_mesh; tests/ops/test_launcher.py checks that a start with
# dev credentials is refused without this).
os.environ.setdefault("PDMESH_ALLOW_DEV_CREDENTIALS", "1")

# The shared mesh: tiny model, a decode/prefill pool smaller than the model's configured
# context so the capacity audit clamps (I5) and over-capacity prompts are cheap to make.
LIVE_MESH_KV_TOKENS = 4096


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    server = NatsServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def live_mesh() -> Iterator[Mesh]:
    # Configured past its pool (tiny's own 65536 positions, set explicitly: unset, a worker
    # serves what its pool holds): every worker clamps (I5) and says so.
    with run_mesh("--kv-tokens", str(LIVE_MESH_KV_TOKENS), "--max-context", "65536",
                  env=mesh_env(PDMESH_ALLOW_FAULTS="1", PDMESH_FAULTS="request_faults",
                               PDMESH_PREFILL_STALL_S="5")) as mesh:
        yield mesh
