"""The model families the engine serves, and each one's geometry from its metadata.

| family | GGUF `general.architecture` | config.json `model_type` | beyond SmolLM2's Llama |
|---|---|---|---|
| Llama 2 / 3.x, SmolLM2 | `llama` | `llama` | Llama 3.1's RoPE frequency rescaling |
| Mistral | `llama` (llama.cpp's converter) | `mistral` | sliding-window attention |
| Qwen2 / 2.5 | `qwen2` | `qwen2` | q/k/v biases |

Every family may have an untied lm_head. What the engine does not compute is refused with a
`ConfigError` naming the field (another architecture, partial RoPE, another RoPE scaling,
per-layer attention kinds, biases it does not apply): served anyway, such a model would
answer, just wrongly. Torch-free: the gateway reads metadata through `checkpoint`.
"""

from __future__ import annotations

import math
from typing import Any

from gguf import GGUFReader

from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.protocol.errors import ConfigError

GGUF_ARCHITECTURES = ("llama", "qwen2")
MODEL_TYPES = ("llama", "mistral", "qwen2")
# Families whose attention has q/k/v biases (their loaders require the tensors).
QKV_BIAS = frozenset({"qwen2"})
LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings")


def llama3_freq_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int
                        ) -> tuple[float, ...]:
    """Llama 3.1's RoPE rescaling as per-frequency divisors (what llama.cpp's converter
    stores as `rope_freqs.weight`, and transformers' `rope_type: llama3` computes): long
    wavelengths slowed by `factor`, short ones kept, the band between interpolated."""
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    factors = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(float(factor))
        else:
            smooth = ((original_max_position_embeddings / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


# -- GGUF ------------------------------------------------------------------------------------
def gguf_field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader: GGUFReader) -> str:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError("general.architecture", arch,
                          f"not a served GGUF architecture ({', '.join(GGUF_ARCHITECTURES)})")
    return arch


def gguf_config(reader: GGUFReader) -> ModelConfig:
    arch = gguf_architecture(reader)

    def field(name: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{name}", default)

    dim = int(field("embedding_length"))
    n_heads = int(field("attention.head_count"))
    head_dim = int(field("attention.key_length", dim // n_heads))
    rotary = field("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ConfigError(f"{arch}.rope.dimension_count", int(rotary),
                          f"rotates {rotary} of {head_dim} head dims: partial RoPE is not "
                          "implemented")
    vocab = field("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    return ModelConfig(
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(field("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(field("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(field("feed_forward_length")),
        rope_theta=float(field("rope.freq_base", 10000.0)),
        norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
        max_context=int(field("context_length", 2048)),
        rope_freq_factors=_gguf_rope_freqs(reader, arch, head_dim),
        sliding_window=_positive(f"{arch}.attention.sliding_window",
                                 field("attention.sliding_window")),
    )


def _gguf_rope_freqs(reader: GGUFReader, arch: str, head_dim: int) -> tuple[float, ...] | None:
    """The `rope_freqs.weight` divisors (Llama 3.1+), or None. llama.cpp's other scalings
    (`rope.scaling.type` linear, yarn, ...) compute other angles: refused."""
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor")
    if kind not in (None, "none"):
        raise ConfigError(f"{arch}.rope.scaling.type", kind,
                          "rope scaling is not implemented (plain RoPE, or Llama 3.1's "
                          "rope_freqs.weight)")
    if factor not in (None, 0.0, 1.0):
        raise ConfigError(f"{arch}.rope.scaling.factor", factor,
                          "rope scaling is not implemented (plain RoPE, or Llama 3.1's "
                          "rope_freqs.weight)")
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    factors = tuple(float(f) for f in tensor.data.reshape(-1))
    if len(factors) != head_dim // 2 or not all(f > 0 for f in factors):
        raise ConfigError("rope_freqs.weight", f"{len(factors)} values",
                          f"expected {head_dim // 2} positive divisors (head_dim / 2)")
    return factors


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if int(value) < 1:
        raise ConfigError(name, value, "must be a positive number of tokens")
    return int(value)


# -- config.json -------------------------------------------------------------------------------
def hf_config(hf: dict) -> ModelConfig:
    """Geometry of a checkpoint's config.json (transformers' keys)."""
    model_type = hf.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise ConfigError("model_type", model_type,
                          f"not a served model type ({', '.join(MODEL_TYPES)})")
    _refuse_unserved(hf, model_type)
    n_heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    theta, factors = _hf_rope(hf, head_dim)
    window = hf.get("sliding_window") if model_type == "mistral" else None
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=dim,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(hf["intermediate_size"]),
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_context=int(hf.get("max_position_embeddings", 2048)),
        rope_freq_factors=factors,
        sliding_window=_positive("sliding_window", window),
    )


def _refuse_unserved(hf: dict, model_type: str) -> None:
    """Options of these families the engine does not compute."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", hf["hidden_act"], "only SwiGLU (silu) is implemented")
    if hf.get("attention_bias"):  # Llama's: q, k, v and o biases
        raise ConfigError("attention_bias", True, "attention biases are served for qwen2 "
                          "(q/k/v) only")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias", True, "MLP biases are not implemented")
    partial = hf.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ConfigError("partial_rotary_factor", partial, "partial RoPE is not implemented")
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        raise ConfigError("use_sliding_window", True, "Qwen2's per-layer sliding window "
                          "(max_window_layers) is not implemented")
    kinds = set(hf.get("layer_types") or ())
    if kinds - {"full_attention"} and not (model_type == "mistral"
                                           and kinds == {"sliding_attention"}):
        raise ConfigError("layer_types", sorted(kinds), "per-layer attention kinds are not "
                          "implemented (every layer full, or Mistral's sliding window)")


def _hf_rope(hf: dict, head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """(theta, frequency divisors) from `rope_theta` + `rope_scaling` (checkpoints written
    before transformers 5) or `rope_parameters` (after)."""
    name = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    spec = hf.get(name) or {}
    if not isinstance(spec, dict):
        raise ConfigError(name, spec, "expected an object")
    theta = float(hf.get("rope_theta") or spec.get("rope_theta") or 10000.0)
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"{name}.rope_type", kind, "rope scaling is not implemented "
                          "(default, or llama3's frequency rescaling): these angles would "
                          "be computed wrong")
    missing = [f for f in LLAMA3_FIELDS if spec.get(f) is None]
    if missing:
        raise ConfigError(f"{name}.{missing[0]}", None, "llama3 rope scaling needs it")
    return theta, llama3_freq_factors(head_dim, theta, float(spec["factor"]),
                                      float(spec["low_freq_factor"]),
                                      float(spec["high_freq_factor"]),
                                      int(spec["original_max_position_embeddings"]))
