"""Load a Llama checkpoint directory: config.json + *.safetensors + tokenizer.json
(+ optional tokenizer_config.json for the chat template, generation_config.json for eos).
HF weights are already in the rotate-half RoPE layout our model uses. The geometry and the
tokenizer come from the JSON files (`checkpoint`, no torch)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from pdmesh.services.engine.checkpoint import checkpoint_config, load_safetensors_tokenizer
from pdmesh.services.engine.model import LayerWeights, LoadedModel, ModelWeights


def load_safetensors(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    config = checkpoint_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))

    def get(name: str) -> torch.Tensor:
        return state[name].to(torch.float32)

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
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = get("lm_head.weight") if "lm_head.weight" in state else embed
    weights = ModelWeights(embed=embed, layers=layers, norm=get("model.norm.weight"),
                           lm_head=lm_head)
    return LoadedModel(config, weights, load_safetensors_tokenizer(directory), directory.name)
