"""The `tiny` model: fixed config and weights generated from a seed; its tokenizer is the
byte-level `tokenizer.ByteTokenizer` (torch-free, for the gateway).

Sized so an 8k-token prompt prefills in a few seconds on 2 CPU cores; the test suite and
long-prompt load tests use it. Same seed, same bits, on every machine with this torch.
"""

from __future__ import annotations

import torch

from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.model import LayerWeights, ModelWeights

TINY_SEED = 20261027
TINY_CONFIG = ModelConfig(
    vocab_size=258,
    dim=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=2,
    head_dim=32,
    ffn_dim=768,
    rope_theta=10000.0,
    norm_eps=1e-5,
    max_context=65536,  # long-context tests run 32k-64k prompts
)


def tiny_weights(config: ModelConfig = TINY_CONFIG, seed: int = TINY_SEED) -> ModelWeights:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(config.dim, std=0.1)

    dim = config.dim
    layers = []
    for _ in range(config.n_layers):
        layers.append(LayerWeights(
            attn_norm=norm_weight(),
            wq=normal(config.q_dim, dim, std=dim ** -0.5),
            wk=normal(config.kv_dim, dim, std=dim ** -0.5),
            wv=normal(config.kv_dim, dim, std=dim ** -0.5),
            wo=normal(dim, config.q_dim, std=config.q_dim ** -0.5),
            ffn_norm=norm_weight(),
            w_gate=normal(config.ffn_dim, dim, std=dim ** -0.5),
            w_up=normal(config.ffn_dim, dim, std=dim ** -0.5),
            w_down=normal(dim, config.ffn_dim, std=config.ffn_dim ** -0.5),
        ))
    embed = normal(config.vocab_size, dim, std=1.0)
    lm_head = normal(config.vocab_size, dim, std=2.0 * dim ** -0.5)
    return ModelWeights(embed=embed, layers=layers, norm=norm_weight(), lm_head=lm_head)
