"""`pdmesh up --colocated`: the single-process baseline behind the same gateway/admission."""

from __future__ import annotations

import pytest

from tests.support.meshproc import run_mesh
from tests.support.meshstats import assert_pools_clean
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]


def test_colocated_mesh_serves_the_oracle_and_rejects_over_capacity() -> None:
    with run_mesh("--colocated", "--kv-tokens", "2048") as mesh:
        assert len(mesh.child_pids()) == 4  # nats, admission, colocated worker, gateway
        for prompt, n in (("colocated baseline", 10), ("second " * 30, 6)):
            status, body = mesh.http("POST", "/v1/completions", {
                "model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0})
            assert status == 200, body
            assert body["choices"][0]["text"] == expected_text(prompt, n)
        status, body = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": "z" * 3000, "max_tokens": 4})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert_pools_clean(mesh.nats_url)
