"""Load a checkpoint directory of a served family (`families`: model_type llama, mistral,
qwen2): config.json + *.safetensors + tokenizer.json (+ optional tokenizer_config.json for
the chat template, generation_config.json for eos). HF weights are already in the
rotate-half RoPE layout our model uses; qwen2 adds q/k/v biases. The geometry and the
tokenizer come from the JSON files (`families`, `checkpoint`, no torch)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pdmesh.services.engine.checkpoint import (
    checkpoint_config,
    load_safetensors_tokenizer,
    read_json,
)
from pdmesh.services.engine.families import QKV_BIAS
from pdmesh.services.engine.model import LayerWeights, LoadedModel, ModelWeights
from pdmesh.services.protocol.errors import ConfigError


def load_safetensors(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = checkpoint_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))

    hf = read_json(directory / "config.json")
    model_type = hf.get("model_type", "llama")

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(name, None, f"tensor missing from the {model_type} checkpoint")
        return state[name].to(torch.float32)

    def bias(name: str) -> torch.Tensor | None:
        """Required where the family has q/k/v biases; refused elsewhere (dropped, it
        would be served silently wrong)."""
        if model_type in QKV_BIAS:
            return get(name)
        if name in state:
            raise ConfigError(name, "present", f"{model_type} attention has no biases here")
        return None

    layers = []
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"),
            wq=get(p + "self_attn.q_proj.weight"),
            wk=get(p + "self_attn.k_proj.weight"),
            wv=get(p + "self_attn.v_proj.weight"),
            wo=get(p + "self_attn.o_proj.weight"),
            ffn_norm=get(p + "post_attention_layernorm.weight"),
            w_gate=get(p + "mlp.gate_proj.weight"),
            w_up=get(p + "mlp.up_proj.weight"),
            w_down=get(p + "mlp.down_proj.weight"),
            bq=bias(p + "self_attn.q_proj.bias"),
            bk=bias(p + "self_attn.k_proj.bias"),
            bv=bias(p + "self_attn.v_proj.bias"),
        ))
    embed = get("model.embed_tokens.weight")
    if "lm_head.weight" in state:
        lm_head = get("lm_head.weight")
    elif hf.get("tie_word_embeddings") is False:
        raise ConfigError("lm_head.weight", None, "missing, and config.json says "
                          "tie_word_embeddings false")
    else:
        lm_head = embed
    weights = ModelWeights(embed=embed, layers=layers, norm=get("model.norm.weight"),
                           lm_head=lm_head)
    return LoadedModel(config, weights, load_safetensors_tokenizer(directory), directory.name)
