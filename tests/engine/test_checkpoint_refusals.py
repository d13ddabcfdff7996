"""Checkpoints the engine would serve silently wrong are refused, naming what is missing.

Llama-3's tokenizer pre-split rule (`llama-bpe`) and Llama 3.1+'s rope scaling are not
implemented: tokenizing with GPT-2's regex or rotating with plain RoPE would give a model
that answers, just wrongly. Every test here passed silently before the refusals existed.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from pdmesh.services.engine.checkpoint import load_gguf_tokenizer
from pdmesh.services.engine.models import load_model


def _gguf(path, *, pre: str | None = None, scaling: tuple[str, float] | None = None,
          rope_freqs: bool = False, rotary_dims: int | None = None) -> str:
    """A 1-layer llama GGUF (dim 8, 2 heads) with a 4-token byte-level vocabulary."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    if rotary_dims is not None:
        writer.add_rope_dimension_count(rotary_dims)
    if scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(scaling[0]))
        writer.add_rope_scaling_factor(scaling[1])
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "c", "<|im_end|>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges([])
    writer.add_eos_token_id(3)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (4, 8), "output_norm.weight": (8,),
              "blk.0.attn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8),
              "blk.0.attn_k.weight": (8, 8), "blk.0.attn_v.weight": (8, 8),
              "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,),
              "blk.0.ffn_gate.weight": (16, 8), "blk.0.ffn_up.weight": (16, 8),
              "blk.0.ffn_down.weight": (8, 16)}
    if rope_freqs:
        shapes["rope_freqs.weight"] = (2,)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_plain_gguf_loads(tmp_path) -> None:
    """The fixture itself is servable: the refusals below are about one field each."""
    model = load_model(_gguf(tmp_path / "ok.gguf", pre="smollm", rotary_dims=4))
    assert model.config.n_layers == 1 and model.tokenizer.eos_token_ids == {3}


def test_llama3_pre_tokenizer_is_refused(tmp_path) -> None:
    path = _gguf(tmp_path / "llama3.gguf", pre="llama-bpe")
    with pytest.raises(ValueError, match="pre-split rule.*'llama-bpe'"):
        load_gguf_tokenizer(path)  # what the gateway loads
    with pytest.raises(ValueError, match="'llama-bpe'"):
        load_model(path)  # what a worker loads


def test_gguf_rope_freqs_tensor_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_model(_gguf(tmp_path / "llama31.gguf", pre="gpt2", rope_freqs=True))


def test_gguf_rope_scaling_keys_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="rope scaling.*'linear'"):
        load_model(_gguf(tmp_path / "linear.gguf", scaling=("linear", 4.0)))


def test_gguf_partial_rope_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="rotates 2 of 4"):
        load_model(_gguf(tmp_path / "partial.gguf", rotary_dims=2))


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"type": "linear", "factor": 2.0},
    "yarn",
])
def test_safetensors_rope_scaling_is_refused(tmp_path, scaling) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 4, "hidden_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 16, "rope_scaling": scaling}))
    with pytest.raises(ValueError, match="rope_scaling.*not implemented"):
        load_model(str(tmp_path))
