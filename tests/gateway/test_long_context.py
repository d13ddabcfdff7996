"""Size is never the failure, at a long context: a mesh of the tiny model serving 32,768
tokens takes a prompt that fills the whole context (prefill alone is over a minute on two
CPU cores, several times the old fixed transfer deadline, so the mesh must go by progress),
and one token more is a 400 before anything is sent.

Slow (minutes), so it runs in `make test-long` (PDMESH_LONG_TESTS=1), not in `make test`;
tests/gateway/test_long_prompt.py covers the same rules at the shared mesh's
context, and the control-message sizes at 262,144 tokens, in every run.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support.meshproc import mesh_env, run_mesh

CONTEXT = 32_768

pytestmark = [pytest.mark.mesh, 
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PDMESH_LONG_TESTS") != "1",
                       reason="long-context scenario: make test-long (PDMESH_LONG_TESTS=1)"),
]


@pytest.mark.timeout(1200)
def test_a_prompt_filling_a_32k_context_is_served_and_one_more_token_is_a_400() -> None:
    with run_mesh("--max-context", str(CONTEXT), "--kv-tokens", str(CONTEXT + 256),
                  env=mesh_env()) as mesh:
        assert mesh.max_context == CONTEXT
        prompt = [3 + (i * 13) % 240 for i in range(CONTEXT - 1)]
        t0 = time.monotonic()
        status, reply = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
            timeout=1100)
        elapsed = time.monotonic() - t0
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens"] == CONTEXT - 1
        assert reply["usage"]["completion_tokens"] == 1
        print(f"32k prompt served in {elapsed:.1f}s")
        status, reply = mesh.http("POST", "/v1/completions", {
            "model": "tiny", "prompt": [*prompt, 5], "max_tokens": 1})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
