"""Load a Llama-architecture GGUF (llama.cpp's format) into fp32 torch weights.

Tensors are dequantized with the `gguf` package. llama.cpp's converter permutes the rows
of attn_q / attn_k from the HF "rotate-half" RoPE layout into the interleaved-pairs layout
llama.cpp uses; `unpermute` undoes that so our rotate-half RoPE is right. The tokenizer is
rebuilt from the GGUF metadata (BPE vocab + merges) with `tokenizers`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from services.engine.config import ModelConfig
from services.engine.model import LayerWeights, ModelWeights
from services.engine.models import LoadedModel
from services.engine.tokenizer import HFTokenizer

CONTROL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (what convert_hf_to_gguf does)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute`: llama.cpp interleaved rows -> HF rotate-half rows."""
    return (w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    dim = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(_field(reader, "llama.attention.key_length", dim // n_heads)),
        ffn_dim=int(_field(reader, "llama.feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(_field(reader, "llama.context_length", 2048)),
    )


def _tokenizer(reader: GGUFReader) -> HFTokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    core = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind in CONTROL_TOKEN_TYPES]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = {int(eos_id)} if eos_id is not None else set()
    template = _field(reader, "tokenizer.chat_template")
    if "<|im_end|>" in tokens and (template is None or "<|im_end|>" in template):
        eos_ids.add(tokens.index("<|im_end|>"))
    return HFTokenizer(
        core, eos_ids, chat_template=template,
        bos_token=tokens[int(bos_id)] if bos_id is not None else "",
        eos_token=tokens[int(eos_id)] if eos_id is not None else "",
    )


def _tensor(reader_tensors: dict, name: str) -> np.ndarray:
    t = reader_tensors[name]
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        data = np.asarray(t.data, dtype=np.float32)
    else:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists ne innermost-first
    return data.reshape(shape)


def load_gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """Only the tokenizer of a GGUF file (metadata; no tensor is dequantized)."""
    return _tokenizer(GGUFReader(str(path)))


def load_gguf(path: str | Path) -> LoadedModel:
    reader = GGUFReader(str(path))
    config = _config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str, heads: int | None = None) -> torch.Tensor:
        array = _tensor(tensors, name)
        if heads is not None:
            array = unpermute(array, heads)
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))

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
        ))
    embed = get("token_embd.weight")
    lm_head = get("output.weight") if "output.weight" in tensors else embed
    weights = ModelWeights(embed=embed, layers=layers, norm=get("output_norm.weight"),
                           lm_head=lm_head)
    return LoadedModel(config, weights, _tokenizer(reader), Path(path).stem)
