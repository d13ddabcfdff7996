"""Load a Llama checkpoint directory: config.json + *.safetensors + tokenizer.json
(+ optional tokenizer_config.json for the chat template, generation_config.json for eos).
HF weights are already in the rotate-half RoPE layout our model uses."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from services.engine.config import ModelConfig
from services.engine.model import LayerWeights, ModelWeights
from services.engine.models import LoadedModel
from services.engine.tokenizer import HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _eos_ids(directory: Path, hf: dict, core: Tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (hf, _read_json(directory / "generation_config.json")):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    tok_config = _read_json(directory / "tokenizer_config.json")
    eos = tok_config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and core.token_to_id(eos) is not None:
        ids.add(core.token_to_id(eos))
    return ids


def load_safetensors(directory: str | Path) -> LoadedModel:
    directory = Path(directory)
    hf = _read_json(directory / "config.json")
    if hf.get("model_type", "llama") != "llama":
        raise ValueError(f"unsupported model_type {hf.get('model_type')!r} (only 'llama')")
    n_heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    config = ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=dim,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or dim // n_heads),
        ffn_dim=int(hf["intermediate_size"]),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_context=int(hf.get("max_position_embeddings", 2048)),
    )
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


def load_safetensors_tokenizer(directory: str | Path) -> HFTokenizer:
    """Only the tokenizer of a checkpoint directory (tokenizer.json + configs)."""
    directory = Path(directory)
    hf = _read_json(directory / "config.json")
    core = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok_config = _read_json(directory / "tokenizer_config.json")
    return HFTokenizer(core, _eos_ids(directory, hf, core),
                       chat_template=tok_config.get("chat_template"))
