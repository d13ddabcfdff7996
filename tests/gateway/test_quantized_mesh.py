"""SmolLM2 served by the disaggregated mesh with decode on its Q4_1 blocks
(`PDMESH_QUANTIZED_DECODE=on`): every reply is the same-setting oracle's, token for token
and logprob for logprob (I4), and not the fp32 engine's (the setting reached the workers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from openai import OpenAI

from pdmesh.services.engine import native
from pdmesh.services.engine.oracle import ReferenceOracle
from pdmesh.services.protocol import messages as m
from tests.support.meshproc import Mesh, smollm2_mesh

pytestmark = [pytest.mark.mesh, pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("PDMESH_LONG_TESTS") != "1",
    reason="SmolLM2 through the mesh on its quantized blocks: make test-long"),
    pytest.mark.skipif(not native.available(), reason="native kernels unavailable")]

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a",
           "List three colours:")


@pytest.fixture(scope="module")
def quantized_mesh() -> Iterator[Mesh]:
    with smollm2_mesh("on") as mesh:
        yield mesh


def test_the_mesh_on_q4_1_blocks_answers_as_its_oracle(quantized_mesh: Mesh,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    client = OpenAI(base_url=quantized_mesh.base_url, api_key="sk-dev-alice")
    monkeypatch.setenv(native.QUANT_SETTING, "on")
    oracle = ReferenceOracle("smollm2")
    monkeypatch.setenv(native.QUANT_SETTING, "off")
    fp32 = ReferenceOracle("smollm2")
    assert oracle.engine.model.quantized is not None and fp32.engine.model.quantized is None
    sampling = m.Sampling(temperature=0.0, logprobs=0)
    differs = 0
    for prompt in PROMPTS:
        ids = oracle.prompt_ids(prompt)
        reply = client.completions.create(model="smollm2", prompt=ids, max_tokens=24,
                                          temperature=0, logprobs=0)
        want_ids, want_lps = oracle.run(ids, 24, sampling)
        got = reply.choices[0]
        assert got.logprobs is not None
        assert got.text == oracle.tokenizer.decode(want_ids), prompt
        assert got.logprobs.token_logprobs == [lp for lp, _ in want_lps], prompt
        _, fp32_lps = fp32.run(ids, 24, sampling)
        differs += [lp for lp, _ in fp32_lps] != got.logprobs.token_logprobs
    assert differs == len(PROMPTS), "some replies had the fp32 engine's logprobs"
