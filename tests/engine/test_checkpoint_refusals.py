"""Checkpoints the engine would serve silently wrong are refused with a ConfigError naming
the field: another pre-split rule, architecture or model type, RoPE scaling other than
Llama 3.1's, partial RoPE, biases the family does not have (or lacks), per-layer attention
kinds. Tokenizing with the wrong regex or rotating with other angles would give a model that
answers, just wrongly.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from pdmesh.services.engine.checkpoint import load_gguf_tokenizer
from pdmesh.services.engine.models import load_model
from pdmesh.services.protocol.errors import ConfigError


def _gguf(path, *, pre: str | None = None, scaling: tuple[str, float] | None = None,
          rope_freqs: int = 0, rotary_dims: int | None = None, arch: str = "llama",
          extra: dict | None = None) -> str:
    """A 1-layer GGUF (dim 8, 2 heads of 4) with a 4-token byte-level vocabulary."""
    writer = gguf.GGUFWriter(str(path), arch)
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
        shapes["rope_freqs.weight"] = (rope_freqs,)
    shapes |= extra or {}
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


def test_an_unknown_pre_tokenizer_is_refused(tmp_path) -> None:
    path = _gguf(tmp_path / "deepseek.gguf", pre="deepseek-llm")
    with pytest.raises(ConfigError, match="tokenizer.ggml.pre='deepseek-llm'") as caught:
        load_gguf_tokenizer(path)  # what the gateway loads
    assert caught.value.field == "tokenizer.ggml.pre"
    with pytest.raises(ConfigError, match="'deepseek-llm'"):
        load_model(path)  # what a worker loads


def test_an_unserved_gguf_architecture_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="general.architecture='phi3'"):
        load_model(_gguf(tmp_path / "phi3.gguf", arch="phi3"))


def test_a_rope_freqs_tensor_of_the_wrong_length_is_refused(tmp_path) -> None:
    """Llama 3.1's divisors are one per rotated pair: 2 for head_dim 4, not 3."""
    with pytest.raises(ConfigError, match="rope_freqs.weight"):
        load_model(_gguf(tmp_path / "llama31.gguf", pre="gpt2", rope_freqs=3))


def test_gguf_rope_scaling_keys_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="llama.rope.scaling.type='linear'"):
        load_model(_gguf(tmp_path / "linear.gguf", scaling=("linear", 4.0)))


def test_gguf_partial_rope_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="rotates 2 of 4"):
        load_model(_gguf(tmp_path / "partial.gguf", rotary_dims=2))


def test_a_bias_the_family_does_not_have_is_refused(tmp_path) -> None:
    """llama attention has no q/k/v biases here: dropping one would serve it wrong."""
    with pytest.raises(ConfigError, match="blk.0.attn_q.bias"):
        load_model(_gguf(tmp_path / "bias.gguf", extra={"blk.0.attn_q.bias": (8,)}))


def test_a_qwen2_gguf_without_its_biases_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="blk.0.attn_q.bias.*missing"):
        load_model(_gguf(tmp_path / "qwen2.gguf", arch="qwen2", pre="qwen2"))


CONFIG = {"model_type": "llama", "vocab_size": 4, "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "intermediate_size": 16}


@pytest.mark.parametrize(("extra", "field"), [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling.low_freq_factor"),
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    ({"model_type": "phi3"}, "model_type"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64},
     "use_sliding_window"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
])
def test_config_json_options_not_served_are_refused(tmp_path, extra, field) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG | extra))
    with pytest.raises(ConfigError) as caught:
        load_model(str(tmp_path))
    assert caught.value.field == field
