"""A whole mesh (`pdmesh up --transport nixl`) whose KV moves by NIXL WRITE: it serves the
oracle, and a faulty transfer fails only its own request (the data-plane threats of
tests/isolation/test_ucx_mesh.py, on nixl)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from pdmesh.services.config import TRANSPORTS
from tests.isolation.meshstats import assert_pools_clean
from tests.meshproc import Mesh, mesh_env, run_mesh
from tests.oracle import expected_text

pytestmark = [pytest.mark.slow, pytest.mark.nixl, pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None,
    reason="nixl_cu12 is not importable (pip install 'pdmesh[nixl]')"), pytest.mark.skipif(
    "nixl" not in TRANSPORTS, reason="services/config.py does not offer --transport nixl yet")]

PROMPT = "over the NIXL data plane, " * 6


@pytest.fixture(scope="module")
def nixl_mesh() -> Iterator[Mesh]:
    env = mesh_env(PDMESH_ALLOW_FAULTS="1", PDMESH_FAULTS="request_faults",
                   PDMESH_TRANSFER_DEADLINE_S="5", UCX_TLS="tcp")
    with run_mesh("--transport", "nixl", "--kv-tokens", "4096", env=env) as mesh:
        yield mesh


def test_nixl_mesh_serves_the_oracle(nixl_mesh: Mesh) -> None:
    status, body = nixl_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(PROMPT, 10)
    assert_pools_clean(nixl_mesh.nats_url)


@pytest.mark.parametrize("fault", ["corrupt_payload", "stale_epoch", "stub_transfer",
                                   "drop_frame", "commit_first", "foreign_reservation"])
def test_nixl_faulty_transfer_fails_only_that_request(nixl_mesh: Mesh, fault: str) -> None:
    status, body = nixl_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={"X-Pdmesh-Fault": fault})
    assert status == 502 and body["error"]["code"] == "transfer_failed", (fault, body)
    status, body = nixl_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected_text(PROMPT, 8)
    assert_pools_clean(nixl_mesh.nats_url)
