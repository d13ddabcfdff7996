"""The same data-plane threats on a mesh whose KV moves over UCX (UCXX, UCX_TLS=tcp)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.isolation.meshstats import assert_pools_clean
from tests.meshproc import Mesh, mesh_env, run_mesh
from tests.oracle import expected_text

pytestmark = [pytest.mark.slow, pytest.mark.ucx, pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucxx is not importable")]

PROMPT = "over the UCX data plane, " * 6


@pytest.fixture(scope="module")
def ucx_mesh() -> Iterator[Mesh]:
    env = mesh_env(PDMESH_ALLOW_FAULTS="1", PDMESH_FAULTS="request_faults",
                   PDMESH_TRANSFER_DEADLINE_S="5", UCX_TLS="tcp")
    with run_mesh("--transport", "ucx", "--kv-tokens", "4096", env=env) as mesh:
        yield mesh


def test_ucx_mesh_serves_the_oracle(ucx_mesh: Mesh) -> None:
    status, body = ucx_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(PROMPT, 10)
    assert_pools_clean(ucx_mesh.nats_url)


@pytest.mark.parametrize("fault", ["corrupt_payload", "stale_epoch", "stub_transfer",
                                   "drop_frame", "commit_first", "foreign_reservation"])
def test_ucx_faulty_transfer_fails_only_that_request(ucx_mesh: Mesh, fault: str) -> None:
    status, body = ucx_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={"X-Pdmesh-Fault": fault})
    assert status == 502 and body["error"]["code"] == "transfer_failed", (fault, body)
    status, body = ucx_mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == expected_text(PROMPT, 8)
    assert_pools_clean(ucx_mesh.nats_url)
