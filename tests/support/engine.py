"""Drive the paged Engine the way the services will: prefill, then continuous batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdmesh.kvstore import KVPool, Lease
from pdmesh.services.engine import native
from pdmesh.services.engine.runner import DecodeSlot, Engine
from pdmesh.services.engine.sampling import Sampler, SamplingParams


def tiny_gguf_writer(path, cfg):
    """A `gguf.GGUFWriter` at `path` with a llama-architecture header of `cfg`'s geometry
    and tiny's byte tokenizer (256 byte tokens, <|im_start|>, <|im_end|> as eos), as
    llama.cpp's converter writes them; the caller adds the tensors and writes the file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(2048)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<0x{i:02X}>" for i in range(256)] + ["<|im_start|>", "<|im_end|>"])
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(257)
    return writer


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


def batched_generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams,
    leases: list[Lease] | None = None, first_tokens: list[int] | None = None,
) -> list[list[int]]:
    """Generate for all prompts at once; requests join the batch one by one and leave when
    done (continuous batching). With `leases` + `first_tokens`, the prompts are assumed
    already prefilled into those leases (disaggregated mode)."""
    pool: KVPool = engine.pool
    eos = engine.loaded.tokenizer.eos_token_ids
    samplers = [Sampler(params) for _ in prompts]
    if leases is None:
        leases = [pool.allocate(f"r{i}", len(p) + params.max_tokens) for i, p in enumerate(prompts)]
        first_tokens = None
    outputs: list[list[int]] = [[] for _ in prompts]
    active: list[int] = []
    pending = list(range(len(prompts)))
    while pending or active:
        if pending:  # admit one new request per step: batches of shifting composition
            i = pending.pop(0)
            if first_tokens is None:
                outputs[i].append(samplers[i].sample(engine.prefill(leases[i], prompts[i])))
            else:
                outputs[i].append(first_tokens[i])
            if outputs[i][-1] not in eos and params.max_tokens > 1:
                active.append(i)
        if not active:
            continue
        slots = [DecodeSlot(leases[i], outputs[i][-1], len(prompts[i]) + len(outputs[i]) - 1)
                 for i in active]
        logits = engine.decode_step(slots)
        for row, i in enumerate(list(active)):
            token = samplers[i].sample(logits[row])
            outputs[i].append(token)
            if token in eos or len(outputs[i]) >= params.max_tokens:
                active.remove(i)
    for lease in leases:
        pool.release(lease, "finished")
    return outputs


# -- decode on a GGUF's quantized blocks (tests/engine/test_quantized.py, test_kquant_file.py)
def fp32_and_on_blocks(path) -> tuple[object, object]:
    """A GGUF loaded once with its blocks: (fp32 reference engine, engine decoding on the
    blocks), the same weights."""
    from pdmesh.services.engine.gguf_loader import load_gguf
    from pdmesh.services.engine.reference import ReferenceEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.QUANT_SETTING, "on")
        loaded = load_gguf(path)
        quantized = ReferenceEngine(loaded)
        mp.setenv(native.QUANT_SETTING, "off")
        reference = ReferenceEngine(loaded)  # fp32
    assert loaded.weights.quantized is not None and reference.model.quantized is None
    assert quantized.model.native_linear() and quantized.model.quantized is not None
    return reference, quantized


def int8_rows(x: np.ndarray) -> np.ndarray:
    """What the quantized kernel multiplies by: each row's blocks of 32 at scale amax / 127,
    values rounded to nearest (float32, as the kernel computes them), in float64."""
    out = np.empty(x.shape, dtype=np.float64)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            v = x[r, b:b + 32].astype(np.float32)
            d = np.float32(np.abs(v).max()) / np.float32(127)
            q = np.rint(v * (np.float32(1) / d)) if d else np.zeros(32)
            out[r, b:b + 32] = q.astype(np.float64) * np.float64(d)
    return out


def teacher_forced(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-softmax of every decode step's logits along `tokens` (the first comes from the
    prompt's prefill, which stays fp32), [len(tokens) - 1, vocab]."""
    cache = engine.new_cache(len(prompt) + len(tokens))
    engine.prefill(cache, prompt)
    out = []
    for i, token in enumerate(tokens[:-1]):
        out.append(torch.log_softmax(engine.decode([cache], [token], [len(prompt) + i])[0], -1))
    return torch.stack(out)
