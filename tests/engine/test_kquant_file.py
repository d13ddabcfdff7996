"""A GGUF that llama.cpp's own `llama-quantize` wrote with K-quants (Q4_K, Q6_K), named by
`PDMESH_KQUANT_GGUF`: the kernel on the file's own Q4_K / Q6_K blocks against the int8 rows
times the file's dequantized rows, decode on its blocks against the fp32 path, and the fp32
path against transformers on the same file.

No K-quant GGUF is reachable from these machines; make one from the SmolLM2 Q4_1 file with
llama.cpp's quantizer (services/engine/README.md, "On a real llama.cpp K-quant file"), then
`PDMESH_KQUANT_GGUF=/path/q4km.gguf pytest -s tests/engine/test_kquant_file.py`. Skipped
without it; the same checks on random super-blocks and tiny GGUFs run in
tests/engine/test_quantized.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pdmesh.services.engine import native
from tests.support.engine import fp32_and_on_blocks, int8_rows, teacher_forced

FILE = os.environ.get("PDMESH_KQUANT_GGUF", "")
pytestmark = [
    pytest.mark.skipif(not FILE, reason="PDMESH_KQUANT_GGUF names no K-quant GGUF"),
    pytest.mark.skipif(not native.available(), reason="native kernels unavailable")]
K_TYPES = {native.QUANT_TYPES["Q4_K"]: "Q4_K", native.QUANT_TYPES["Q6_K"]: "Q6_K"}


def _chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def engines() -> tuple[object, object]:
    """The file loaded once with its blocks: (fp32 engine, engine decoding on the blocks)."""
    return fp32_and_on_blocks(FILE)


def test_the_kernel_on_the_files_k_blocks_is_int8_rows_times_its_rows(engines) -> None:
    reference, _ = engines
    weights = reference.loaded.weights
    seen: dict[str, int] = {}
    for i, layer in enumerate(weights.quantized.layers):
        for name, qm in layer.items():
            if qm.type not in K_TYPES:
                continue
            w = getattr(weights.layers[i], name).double().numpy()
            x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(i))
            got = native.linear_q(x, qm)
            want = int8_rows(x.numpy()) @ w.T
            err = np.abs(got.double().numpy() - want).max() / np.abs(want).max()
            assert err < 1e-5, (i, name, K_TYPES[qm.type], err)
            assert torch.equal(native.linear_q(x[2:3], qm)[0], got[2]), (i, name)
            seen[K_TYPES[qm.type]] = seen.get(K_TYPES[qm.type], 0) + 1
    print(f"K-quant matrices checked: {seen}")
    assert seen, "the file keeps no Q4_K or Q6_K matrix"


def test_decode_on_the_blocks_follows_the_fp32_path(engines) -> None:
    from pdmesh.services.engine.sampling import SamplingParams

    reference, quantized = engines
    tok = reference.loaded.tokenizer
    prompt = _chat(tok, "Write a short story about a lighthouse keeper.")
    tokens = reference.generate(prompt, SamplingParams(max_tokens=200))
    assert len(tokens) >= 50, len(tokens)  # generate stops at EOS
    ref = teacher_forced(reference, prompt, tokens)
    got = teacher_forced(quantized, prompt, tokens)
    picked = torch.tensor(tokens[1:])[:, None]
    diff = (got.gather(1, picked) - ref.gather(1, picked)).abs()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"blocks vs fp32: {len(picked)} steps, greedy agreement {agree:.3f}, "
          f"|logprob diff| mean {diff.mean():.4f}, max {diff.max():.4f}")
    assert agree >= 0.9 and diff.mean() < 0.1
    assert not torch.equal(got, ref)  # the blocks were used


def test_the_fp32_path_equals_transformers_on_the_file(engines) -> None:
    transformers = pytest.importorskip("transformers")
    from pdmesh.services.engine.sampling import SamplingParams

    reference, _ = engines
    tok = reference.loaded.tokenizer
    prompt = _chat(tok, "Write a Python function that returns the n-th Fibonacci number.")
    tokens = reference.generate(prompt, SamplingParams(max_tokens=120))
    assert len(tokens) >= 50, len(tokens)
    ours = teacher_forced(reference, prompt, tokens)
    directory, name = os.path.split(FILE)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt):]
    theirs = torch.log_softmax(logits.float(), -1)
    worst = (theirs - ours).abs().max().item()
    print(f"fp32 path vs transformers: {len(tokens) - 1} steps, max |logprob diff| {worst:.2e}")
    assert worst < 1e-3
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))
