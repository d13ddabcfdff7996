"""Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) over an abstract per-request KV store.

Batch invariance (invariant I4 depends on it: the leak oracle compares tokens bit for bit)
-----------------------------------------------------------------------------------------
A request's greedy tokens must not depend on what else is batched with it, nor on whether
its prompt KV was computed in another process and copied page by page. We get it by
construction, in fp32:
* every matmul a request takes part in has a shape that does not depend on the batch:
  decode runs in fixed tiles of DECODE_TILE rows (padded with dummy rows), so a row's
  GEMM has the same M, K, N whether it is alone or with 15 others; BLAS kernels pick their
  blocking and reduction order from the shape, never from the other rows' values (a test
  checks row-position independence on this machine's kernels);
* attention is computed per request (one SDPA call per request per layer) over that
  request's own K/V only, gathered into a contiguous [T, kv_heads, head_dim] tensor; the
  paged gather and a contiguous cache give the same tensor, hence the same bits;
* prefill is chunked at fixed absolute positions (multiples of PREFILL_CHUNK), whatever
  worker runs it, so the KV bytes a prefill worker ships equal the reference's bytes.
Caveat: the processes must use the same torch build and thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.tokenizer import Tokenizer

PREFILL_CHUNK = 512
DECODE_TILE = 16


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [dim]
    wq: torch.Tensor  # [n_heads*head_dim, dim]  (rotate-half RoPE layout, as in HF)
    wk: torch.Tensor  # [n_kv_heads*head_dim, dim]
    wv: torch.Tensor  # [n_kv_heads*head_dim, dim]
    wo: torch.Tensor  # [dim, n_heads*head_dim]
    ffn_norm: torch.Tensor  # [dim]
    w_gate: torch.Tensor  # [ffn_dim, dim]
    w_up: torch.Tensor  # [ffn_dim, dim]
    w_down: torch.Tensor  # [dim, ffn_dim]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, dim]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [dim]
    lm_head: torch.Tensor  # [vocab, dim] (may be the same tensor as embed)

    def to(self, device: str | torch.device) -> ModelWeights:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.float32).contiguous()

        layers = [LayerWeights(**{k: move(v) for k, v in vars(layer).items()})
                  for layer in self.layers]
        return ModelWeights(move(self.embed), layers, move(self.norm), move(self.lm_head))


@dataclass
class LoadedModel:
    """A model ready to run: what every loader returns (`models.load_model`)."""

    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    name: str


class KVView(Protocol):
    """One request's KV storage as the model sees it (paged pool or contiguous cache)."""

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, kv_heads, head_dim] at positions start..start+n."""

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K, V [length, kv_heads, head_dim] of positions 0..length."""


class ContiguousKV:
    """A per-request contiguous cache [n_layers, 2, max_tokens, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, max_tokens: int, device: torch.device) -> None:
        shape = (config.n_layers, 2, max_tokens, config.n_kv_heads, config.head_dim)
        self.cache = torch.zeros(shape, dtype=torch.float32, device=device)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache[layer, 0, start:start + k.shape[0]] = k
        self.cache[layer, 1, start:start + v.shape[0]] = v

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache[layer, 0, :length], self.cache[layer, 1, :length]


@dataclass
class Segment:
    """Rows [row, row+num_rows) of the batch are positions start_pos.. of one request."""

    kv: KVView
    row: int
    num_rows: int
    start_pos: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, device: str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.weights = weights.to(self.device)
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
        angles = torch.arange(config.max_context, dtype=torch.float64)[:, None] * inv_freq
        self.cos = angles.cos().to(torch.float32).to(self.device)
        self.sin = angles.sin().to(torch.float32).to(self.device)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x [N, heads, head_dim], rotate-half convention.
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment]
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, dim]. Rows outside every segment are
        padding: they write no KV and attend to nothing."""
        cfg, w = self.config, self.weights
        n = token_ids.shape[0]
        x = w.embed[token_ids]
        for index, layer in enumerate(w.layers):
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q = self._rope(F.linear(h, layer.wq).view(n, cfg.n_heads, cfg.head_dim), positions)
            k = self._rope(F.linear(h, layer.wk).view(n, cfg.n_kv_heads, cfg.head_dim), positions)
            v = F.linear(h, layer.wv).view(n, cfg.n_kv_heads, cfg.head_dim)
            attn = torch.zeros_like(q)
            for seg in segments:
                rows = slice(seg.row, seg.row + seg.num_rows)
                seg.kv.write(index, seg.start_pos, k[rows], v[rows])
                keys, values = seg.kv.read(index, seg.start_pos + seg.num_rows)
                mask = None
                if seg.num_rows > 1:  # causal within the chunk, all earlier chunks visible
                    query_pos = torch.arange(seg.num_rows, device=x.device) + seg.start_pos
                    key_pos = torch.arange(keys.shape[0], device=x.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                out = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0),
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=True,
                )
                attn[rows] = out[0].transpose(0, 1)
            x = x + F.linear(attn.view(n, cfg.q_dim), layer.wo)
            h = rms_norm(x, layer.ffn_norm, cfg.norm_eps)
            x = x + F.linear(F.silu(F.linear(h, layer.w_gate)) * F.linear(h, layer.w_up),
                             layer.w_down)
        return rms_norm(x, w.norm, cfg.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights.lm_head)

    # ---- the two fixed-shape schedules every engine uses --------------------------------
    def prefill_chunk(self, kv: KVView, token_ids: list[int], start: int) -> torch.Tensor:
        """Run one chunk (within a PREFILL_CHUNK-aligned window); returns last hidden [dim]."""
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        hidden = self.forward(tokens, positions, [Segment(kv, 0, len(token_ids), start)])
        return hidden[-1]

    def decode_tile(
        self, kvs: list[KVView], token_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One decode step for up to DECODE_TILE requests, padded to exactly DECODE_TILE
        rows so the GEMM shapes never depend on the batch. Returns logits [len(kvs), vocab]."""
        count = len(kvs)
        assert 0 < count <= DECODE_TILE
        pad = DECODE_TILE - count
        tokens = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions + [0] * pad, dtype=torch.long, device=self.device)
        segments = [Segment(kv, row, 1, positions[row]) for row, kv in enumerate(kvs)]
        hidden = self.forward(tokens, pos, segments)
        return self.logits(hidden)[:count]


def prefill_windows(start: int, num_tokens: int) -> list[tuple[int, int]]:
    """(chunk_start, chunk_len) pieces of [start, start+num_tokens), split at absolute
    multiples of PREFILL_CHUNK so the split never depends on who runs the prefill."""
    pieces, pos, end = [], start, start + num_tokens
    while pos < end:
        stop = min(end, (pos // PREFILL_CHUNK + 1) * PREFILL_CHUNK)
        pieces.append((pos, stop - pos))
        pos = stop
    return pieces
