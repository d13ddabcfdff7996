"""Model geometry shared by every loader (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, repr=False)
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_context: int = 2048
    # RoPE frequency i is theta^(-2i/head_dim) / rope_freq_factors[i] (head_dim / 2 of
    # them): Llama 3.1's rescaling, as llama.cpp's `rope_freqs.weight` stores it; None is
    # plain RoPE.
    rope_freq_factors: tuple[float, ...] | None = None
    # Position p attends keys (p - sliding_window, p] (Mistral); None: every earlier key.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not a multiple of {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for RoPE")
        factors = self.rope_freq_factors
        if factors is not None and (len(factors) != self.head_dim // 2
                                    or not all(f > 0 for f in factors)):
            raise ValueError(f"rope_freq_factors: {len(factors)} factors for head_dim "
                             f"{self.head_dim} (expected head_dim / 2, every one > 0)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1 (or None)")

    def __repr__(self) -> str:
        # The fields after max_context appear only when set, so a model without them has
        # the repr (hence `fingerprint.weights_digest`) it had before they existed.
        shown = [f for f in fields(self) if f.name not in _OPTIONAL
                 or getattr(self, f.name) is not None]
        return f"ModelConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def attention_window(self) -> int | None:
        """Keys a position attends to, where that is fewer than the context holds; None
        (plain causal attention) for a window as long as the context, or none at all."""
        window = self.sliding_window
        return window if window is not None and window < self.max_context else None


_OPTIONAL = ("rope_freq_factors", "sliding_window")
