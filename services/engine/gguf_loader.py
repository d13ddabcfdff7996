"""Load a GGUF (llama.cpp's format) of a served family (`families`: architectures llama
and qwen2) into fp32 torch weights.

Tensors are dequantized with the `gguf` package. For the llama architecture, llama.cpp's
converter permutes the rows of attn_q / attn_k (and their biases) from the HF "rotate-half"
RoPE layout into the interleaved-pairs layout llama.cpp uses; `unpermute` undoes that so
our rotate-half RoPE is right. qwen2 files keep HF's layout (llama.cpp rotates them NeoX
style, i.e. rotate-half) and carry q/k/v biases. The geometry and the tokenizer (BPE vocab +
merges) come from the GGUF metadata (`families`, `checkpoint`, no torch).

With PDMESH_QUANTIZED_DECODE=on (the default), the matrices stored as Q4_0 / Q4_1 / Q8_0 /
Q4_K / Q6_K are also kept as their own blocks (`ModelWeights.quantized`, rows permuted as
the fp32 ones) for decode's quantized matmuls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from pdmesh.services.engine import native
from pdmesh.services.engine.checkpoint import gguf_tokenizer
from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.families import QKV_BIAS, gguf_architecture, gguf_config
from pdmesh.services.engine.model import (
    LayerWeights,
    LoadedModel,
    ModelWeights,
    QuantizedWeights,
)
from pdmesh.services.protocol.errors import ConfigError


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp interleaved rows -> HF rotate-half rows (the inverse of the row permutation
    llama.cpp's convert_hf_to_gguf applies to attn_q / attn_k)."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensor(reader_tensors: dict, name: str) -> np.ndarray:
    t = reader_tensors[name]
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.asarray(t.data, dtype=np.float32)
    else:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne innermost-first
    return data.reshape(shape)


# LayerWeights name -> (GGUF tensor suffix, whose heads permute its rows on llama)
_MATMULS = {"wq": ("attn_q", "q"), "wk": ("attn_k", "kv"), "wv": ("attn_v", None),
            "wo": ("attn_output", None), "w_gate": ("ffn_gate", None),
            "w_up": ("ffn_up", None), "w_down": ("ffn_down", None)}


def _blocks(t: Any, heads: int | None) -> native.QuantMatrix | None:
    """The tensor's own blocks when its type is one decode_linear_q.c takes (rows in the
    layout the fp32 weights have: llama's q/k rows unpermuted), else None."""
    kind = native.QUANT_TYPES.get(t.tensor_type.name)
    if kind is None:
        return None
    data = np.asarray(t.data, dtype=np.uint8)
    if heads is not None:
        data = unpermute(data, heads)
    cols = int(t.shape.tolist()[0])  # GGUF lists ne innermost-first: the row's length
    return native.QuantMatrix(kind, cols, np.ascontiguousarray(data))


def _quantized(tensors: dict, config: ModelConfig, permuted: bool,
               head_name: str) -> QuantizedWeights:
    layers = []
    for i in range(config.n_layers):
        found = {}
        for name, (suffix, heads) in _MATMULS.items():
            n = {"q": config.n_heads, "kv": config.n_kv_heads}.get(heads or "")
            qm = _blocks(tensors[f"blk.{i}.{suffix}.weight"], n if permuted else None)
            if qm is not None:
                found[name] = qm
        layers.append(found)
    return QuantizedWeights(layers, _blocks(tensors[head_name], None))


def load_gguf(path: str | Path) -> LoadedModel:
    reader = GGUFReader(str(path))
    config = gguf_config(reader)
    arch = gguf_architecture(reader)
    permuted = arch == "llama"  # llama.cpp's interleaved q/k rows
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, heads: int | None = None) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(name, None, f"tensor missing from the {arch} GGUF")
        array = _tensor(tensors, name)
        if heads is not None and permuted:
            array = unpermute(array, heads)
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))

    def bias(name: str, heads: int | None = None) -> torch.Tensor | None:
        """A q/k/v bias: required where the family has them; where it does not, one in
        the file would be silently dropped, so it is refused."""
        if arch in QKV_BIAS:
            return get(name, heads)
        if name in tensors:
            raise ConfigError(name, "present", f"{arch} attention has no biases here")
        return None

    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=get(p + "attn_norm.weight"),
            wq=get(p + "attn_q.weight", config.n_heads),
            wk=get(p + "attn_k.weight", config.n_kv_heads),
            wv=get(p + "attn_v.weight"),
            wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"),
            w_up=get(p + "ffn_up.weight"),
            w_down=get(p + "ffn_down.weight"),
            bq=bias(p + "attn_q.bias", config.n_heads),
            bk=bias(p + "attn_k.bias", config.n_kv_heads),
            bv=bias(p + "attn_v.bias"),
        ))
    embed = get("token_embd.weight")
    head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    lm_head = get("output.weight") if head_name == "output.weight" else embed
    weights = ModelWeights(embed=embed, layers=layers, norm=get("output_norm.weight"),
                           lm_head=lm_head)
    if native.quantized_decode():
        weights.quantized = _quantized(tensors, config, permuted, head_name)
    return LoadedModel(config, weights, gguf_tokenizer(reader), Path(path).stem)
