"""Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) over an abstract per-request KV store.

Batch invariance (invariant I4 depends on it: the leak oracle compares tokens bit for bit)
-----------------------------------------------------------------------------------------
A request's greedy tokens must not depend on what else is batched with it, nor on whether
its prompt KV was computed in another process and copied page by page. We get it by
construction:
* on CPU in fp32, a decode step's matmuls run in a native kernel (native.py,
  kernels/decode_linear.c) that computes every output in one order fixed by the weight's
  in-features alone (16 FMA lanes, then a fixed tree), so a row's bits do not depend on
  the row count, its place or the thread count, and a step runs exactly its rows
  (`NATIVE_TILES`); the whole step (norms, matmuls, RoPE and the K/V append, attention)
  then runs in one native call (`native.DecodeLayers`), every kernel row-wise or
  per-request. Otherwise (torch: no compiler, another device or dtype, a shape the
  kernel refuses) the rest of this paragraph holds:
* decode pads a step to a small fixed tile of rows (4, 8 or 16: `DECODE_TILES`) with dummy
  rows; a row's GEMM result is the same in every tile of the ladder and at every position
  in it. That is a property of the BLAS kernels (they choose blocking and reduction order
  from the shape and thread count, never from the values), so it is not assumed:
  `tiles_agree` checks it for every decode matmul shape of the model when the model is
  built and whenever the thread count changes, and where it fails decode pads every step
  to DECODE_TILE rows as before. On the AVX-512 machines' MKL, M=1..3 take GEMV-like
  kernels whose bits differ (so a lone request cannot run as a 1-row GEMV) while 4, 8 and
  16 agree; on an AMX machine only 16 does (see `tiles_agree`).
  Row-wise reductions (RMSNorm) reduce one row of `dim`
  floats, far below ATen's parallel grain, so they do not split with the row count;
* in torch, a decode tile's matmuls follow `decode_plan`: qkv, o and lm_head in the columns
  orientation (W @ x^T, pieces of at most 8 rows, whose 4..11-row kernels agree bit for
  bit), gate/up and down in the rows bits of the ladder above; each property is checked
  for the model's shapes (`columns_agree`, `tiles_agree`, `wide_agrees`);
* attention is computed per request over that request's own K/V only. Decode rows on CPU
  in fp32 use the native kernel (native.py, kernels/decode_attention.c): it reads K/V in
  place through the request's page table (a contiguous cache is one page), each request
  computed by one thread in an order fixed by its length, so paged and contiguous stores
  give the same bits. Otherwise (and for prefill chunks: two merged flash calls on CPU,
  `_chunk_attention`) one SDPA call per request per layer over its K/V gathered into a
  contiguous [T, kv_heads, head_dim] tensor; the paged gather and a contiguous cache give
  the same tensor, hence the same bits, and every attention shape depends only on the
  request's own positions (a decode row's query heads are folded onto their KV heads,
  [1, kv_heads, group, hd], whatever the batch);
* prefill is chunked at fixed absolute positions (multiples of PREFILL_CHUNK), whatever
  worker runs it, so the KV bytes a prefill worker ships equal the reference's bytes.
Caveat: the processes must use the same torch build, device, dtype and thread count.

Weights are kept in the layout the matmuls want (`ModelWeights.prepare`): q/k/v fused into
one [q_dim + 2*kv_dim, dim] matrix (and their biases, where the family has them, into one
vector added after it) and gate/up into one [2*ffn_dim, dim] matrix, so a layer is four
matmuls (and RoPE runs once over q and k together).

The families' details (`families.py`) change no shape a batch could influence: Llama 3.1's
RoPE rescaling only changes the cos/sin tables (`rope_inv_freq`); a sliding window limits a
row to its own last keys, by its own position (`_chunk_mask`, the decode paths).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pdmesh.services.engine import native
from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.native import DecodeAttention
from pdmesh.services.engine.tokenizer import Tokenizer

PREFILL_CHUNK = 512
DECODE_TILE = 16  # most requests one decode_tile call takes
# Decode pads a step to the smallest of these row counts that holds it. A row's GEMM result
# must not depend on which tile it runs in: `tiles_agree` checks that, for every decode
# matmul shape, at start-up and whenever the thread count changes; where it does not hold,
# decode pads every step to DECODE_TILE rows (always invariant, slower at low batch).
DECODE_TILES = (4, 8, DECODE_TILE)
NATIVE_TILES = tuple(range(1, DECODE_TILE + 1))  # the native matmuls need no padding rows
# Decode matmuls come in two orientations: "rows",
# F.linear(x, W) = x @ W^T, and "columns", torch.mm(W, x^T)^T. On this machine's MKL a
# row's bits are the same for every row count in 4..16 in the rows orientation, and in the
# columns orientation for every count in 4..11 (a second set of bits), while columns at
# 12..16 rows give the rows orientation's bits. The columns orientation at 4-8 rows streams
# the weights about twice as fast as any 1-4 row GEMM here, so the roles in COLUMN_ROLES run
# in pieces of at most COLUMN_PIECE rows that way, the others in the rows bits (as one
# 16-row columns GEMM at a full tile, the faster of the two). `LlamaModel.decode_plan`
# checks each property for the model's shapes (`tiles_agree`, `columns_agree`) and drops
# what does not hold; a role keeps one orientation for every batch size.
COLUMN_PIECE = 8
COLUMN_ROLES = ("qkv", "o", "lm_head")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """The compute dtype for `device`: fp32 on CPU (exact, and CPU matmuls gain nothing
    from bf16 here), bf16 on a CUDA device that supports it, else fp16."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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
    bq: torch.Tensor | None = None  # [n_heads*head_dim] q/k/v biases (Qwen2), same layout
    bk: torch.Tensor | None = None  # [n_kv_heads*head_dim]
    bv: torch.Tensor | None = None  # [n_kv_heads*head_dim]


@dataclass
class FusedLayer:
    """One layer in the layout the forward uses: four matmuls per layer."""

    attn_norm: torch.Tensor  # [dim]
    wqkv: torch.Tensor  # [q_dim + 2*kv_dim, dim] = cat(wq, wk, wv)
    wo: torch.Tensor  # [dim, q_dim]
    ffn_norm: torch.Tensor  # [dim]
    w_gate_up: torch.Tensor  # [2*ffn_dim, dim] = cat(w_gate, w_up)
    w_down: torch.Tensor  # [dim, ffn_dim]
    bqkv: torch.Tensor | None = None  # [q_dim + 2*kv_dim] = cat(bq, bk, bv), added after wqkv


@dataclass
class PreparedWeights:
    embed: torch.Tensor
    layers: list[FusedLayer]
    norm: torch.Tensor
    lm_head: torch.Tensor


@dataclass
class QuantizedWeights:
    """The quantized blocks a GGUF stores (`ModelWeights.quantized`); a matrix it stores in
    another type is absent and stays fp32."""

    layers: list[dict[str, native.QuantMatrix]]  # by LayerWeights name: wq, wk, ... w_down
    lm_head: native.QuantMatrix | None = None

    def fused(self) -> list[dict[str, native.QuantMatrix | None]]:
        """Per layer, the fused matmuls (`native.QUANT_MATMULS`) whose parts are all
        quantized alike."""
        return [{"wqkv": native.QuantMatrix.cat([q.get("wq"), q.get("wk"), q.get("wv")]),
                 "wo": q.get("wo"),
                 "w_gate_up": native.QuantMatrix.cat([q.get("w_gate"), q.get("w_up")]),
                 "w_down": q.get("w_down")} for q in self.layers]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, dim]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [dim]
    lm_head: torch.Tensor  # [vocab, dim] (may be the same tensor as embed)
    # A GGUF's own blocks of the matrices it stores as Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, with
    # PDMESH_QUANTIZED_DECODE=on (the default): per layer by LayerWeights name (wq .. w_down),
    # and "lm_head"; decode's matmuls run on them (native.linear_q), everything else on fp32.
    quantized: QuantizedWeights | None = field(default=None, repr=False, compare=False)
    _prepared: dict = field(default_factory=dict, repr=False, compare=False)

    def to(self, device: str | torch.device, dtype: torch.dtype = torch.float32
           ) -> ModelWeights:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device=device, dtype=dtype).contiguous()

        layers = [LayerWeights(**{k: move(v) for k, v in vars(layer).items()})
                  for layer in self.layers]
        return ModelWeights(move(self.embed), layers, move(self.norm), move(self.lm_head),
                            self.quantized)

    def prepare(self, device: str | torch.device, dtype: torch.dtype) -> PreparedWeights:
        """The fused layout on `device` in `dtype`, built once and shared by every model
        (paged engine and reference) of this process. When device and dtype are the ones
        the weights already have, the per-matrix fields become views of the fused
        matrices, so the process holds the weights once."""
        device = torch.device(device)
        key = (str(device), dtype)
        if key in self._prepared:
            return self._prepared[key]

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        fused = []
        for layer in self.layers:
            q, kv, ffn = layer.wq.shape[0], layer.wk.shape[0], layer.w_gate.shape[0]
            wqkv = move(torch.cat((layer.wq, layer.wk, layer.wv)))
            gate_up = move(torch.cat((layer.w_gate, layer.w_up)))
            biases = (layer.bq, layer.bk, layer.bv)
            if any(b is not None for b in biases) and any(b is None for b in biases):
                raise ValueError("a layer has some of the q/k/v biases, not all three")
            bqkv = None if layer.bq is None else move(torch.cat(biases))
            fused.append(FusedLayer(move(layer.attn_norm), wqkv, move(layer.wo),
                                    move(layer.ffn_norm), gate_up, move(layer.w_down), bqkv))
            if layer.wq.device == device and layer.wq.dtype == dtype:
                layer.wq, layer.wk, layer.wv = wqkv.split((q, kv, kv))
                layer.w_gate, layer.w_up = gate_up.split((ffn, ffn))
        lm_head = move(self.lm_head)
        prepared = PreparedWeights(move(self.embed), fused, move(self.norm), lm_head)
        self._prepared[key] = prepared
        return prepared


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

    @staticmethod
    def for_segments(segments: list[Segment]) -> SegmentsKV:
        """The store of one forward's segments (all of this KVView type), batched per
        layer: a paged store writes and gathers every segment in one call per layer."""


class SegmentsKV(Protocol):
    """The KV of every segment of one forward, written and read one layer at a time."""

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each segment's rows of k, v [N, kv_heads, head_dim] (the forward's rows;
        padding rows are not stored) at the segment's positions."""

    def read(self, layer: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Per segment in order, K and V [1, kv_heads, T, head_dim] (SDPA's layout) of its
        positions 0..T, T = start_pos + num_rows. A paged store yields them lazily: a
        segment's pair is valid until the next one is taken."""

    def decode_attention(self) -> DecodeAttention:
        """The native decode attention over these segments' storage in place (every
        segment one decode row, rows 0..n-1 in order); see native.py."""

    def decode_targets(self) -> np.ndarray:
        """Byte addresses [layers, 2 (K, V), rows] int64 of each decode row's K and V slot
        (rows 0..n-1, one per segment, in order), each checked to lie in the segment's own
        storage: where the native K/V append (kernels/decode_pointwise.c) writes."""


class PerSegmentKV:
    """SegmentsKV over per-request KVViews, one call per segment (contiguous caches)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        for seg in self.segments:
            rows = slice(seg.row, seg.row + seg.num_rows)
            seg.kv.write(layer, seg.start_pos, k[rows], v[rows])

    def read(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for seg in self.segments:
            keys, values = seg.kv.read(layer, seg.start_pos + seg.num_rows)
            out.append((keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)))
        return out

    def decode_targets(self) -> np.ndarray:
        caches = [seg.kv.cache for seg in self.segments]  # type: ignore[attr-defined]
        shape = caches[0].shape
        layers, _, max_tokens, kv_heads, head_dim = shape
        for i, (seg, cache) in enumerate(zip(self.segments, caches, strict=True)):
            if (seg.num_rows != 1 or not 0 <= seg.start_pos < max_tokens
                    or cache.shape != shape or not cache.is_contiguous()):
                raise ValueError(f"segment {i}: not one decode row inside its cache")
        row_bytes = kv_heads * head_dim * caches[0].element_size()
        first = np.fromiter((c.data_ptr() + seg.start_pos * row_bytes
                             for c, seg in zip(caches, self.segments, strict=True)),
                            np.int64, len(caches))
        out = np.empty((layers, 2, len(caches)), dtype=np.int64)
        out[:, 0] = first + np.arange(layers, dtype=np.int64)[:, None] * (
            2 * max_tokens * row_bytes)
        out[:, 1] = out[:, 0] + max_tokens * row_bytes
        return out

    def decode_attention(self) -> DecodeAttention:
        """Each contiguous cache is one page of `max_tokens` tokens."""
        caches = [seg.kv.cache for seg in self.segments]  # type: ignore[attr-defined]
        return DecodeAttention([c.data_ptr() for c in caches], [c.shape[2] for c in caches],
                               [0] * len(caches), [np.zeros(1, np.int64)] * len(caches),
                               [seg.start_pos + seg.num_rows for seg in self.segments], caches,
                               [1] * len(caches))


class ContiguousKV:
    """A per-request contiguous cache [n_layers, 2, max_tokens, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, max_tokens: int, device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (config.n_layers, 2, max_tokens, config.n_kv_heads, config.head_dim)
        self.cache = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache[layer, 0, start:start + k.shape[0]] = k
        self.cache[layer, 1, start:start + v.shape[0]] = v

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache[layer, 0, :length], self.cache[layer, 1, :length]

    @staticmethod
    def for_segments(segments: list[Segment]) -> SegmentsKV:
        return PerSegmentKV(segments)


@dataclass
class Segment:
    """Rows [row, row+num_rows) of the batch are positions start_pos.. of one request."""

    kv: KVView
    row: int
    num_rows: int
    start_pos: int


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] in fp64: theta^(-2i/head_dim), divided by
    the checkpoint's per-frequency factors where it has them (Llama 3.1's rescaling)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float64) / half))
    if config.rope_freq_factors is not None:
        factors = torch.tensor(config.rope_freq_factors, dtype=torch.float64)
        inv_freq = inv_freq / factors  # guard: rope-freq-factors
    return inv_freq


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()  # no-op in fp32; reduces in fp32 under bf16/fp16
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [N, heads, head_dim] with cos/sin [N, 1, head_dim/2] of its
    positions, in fp32 (a no-op cast in fp32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     start: int) -> torch.Tensor:
    """Causal attention of a prefill chunk on CPU: query [1, heads, n, hd] holds positions
    start..start+n, keys/values [1, kv_heads, start+n, hd] positions 0..start+n.

    Two flash-attention calls instead of one with an explicit [n, start+n] mask: the earlier
    chunks' keys, which every row sees (no mask), and the chunk's own keys with `is_causal`
    (top-left aligned: row i sees keys 0..i of the chunk), whose upper triangle the kernel
    skips; the two partial results are merged by their log-sum-exp. Every operation's shape
    depends only on (start, n), never on the batch, so the bits do not either; the reference
    engine runs this same function."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own, own_lse = flash(query, keys[:, :, start:], values[:, :, start:], 0.0, True)
    if start == 0:
        return own
    past, past_lse = flash(query, keys[:, :, :start], values[:, :, :start], 0.0, False)
    top = torch.maximum(own_lse, past_lse)
    own_w = (own_lse - top).exp_().unsqueeze(-1)
    past_w = (past_lse - top).exp_().unsqueeze(-1)
    merged = (own.float() * own_w + past.float() * past_w) / (own_w + past_w)
    return merged.to(query.dtype)


def tiles_agree(shapes: list[tuple[int, int]], tiles: tuple[int, ...], device: torch.device,
                dtype: torch.dtype) -> bool:
    """Whether, for every weight shape [out, in], each row of an M-row GEMM (M in `tiles`)
    equals bit for bit the same row of a DECODE_TILE-row GEMM, wherever it sits in either.
    BLAS picks its kernel (and its reduction order) from the shape and thread count, never
    from the values, so random data decides it. MKL on the AVX-512 machines of sessions
    1-8: true for (4, 8, 16) at 1 and 2 threads, false for M=1..3 (GEMV-like kernels); on
    an AMX (Sapphire Rapids class) machine only M=16 agrees, and torch decode pads to 16."""
    gen = torch.Generator().manual_seed(0)
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=gen).to(device, dtype)
        rows = torch.randn(DECODE_TILE, in_features, generator=gen).to(device, dtype)
        full = F.linear(rows, weight)
        for m in tiles:
            for first in {0, DECODE_TILE - m, (DECODE_TILE - m) // 2}:
                if not torch.equal(F.linear(rows[first:first + m].clone(), weight),
                                   full[first:first + m]):
                    return False
    return True


def _columns(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T computed as weight @ x^T (the columns orientation), [rows, out]. x is
    made contiguous first (a no-op for most callers): BLAS may take another kernel for
    another operand layout, and the checks below run on contiguous rows."""
    return torch.mm(weight, x.contiguous().t()).t()


def columns_agree(shapes: list[tuple[int, int]], sizes: tuple[int, ...],
                  device: torch.device, dtype: torch.dtype) -> bool:
    """Whether, for every weight shape [out, in], each row of a columns-orientation GEMM of
    m rows (m in `sizes`) equals bit for bit the same row computed first in a COLUMN_PIECE-row
    one, wherever it sits in the m rows. On this machine's MKL: true for 4..11 rows, false
    for 1..3 and 12..16."""
    gen = torch.Generator().manual_seed(1)
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=gen).to(device, dtype)
        rows = torch.randn(DECODE_TILE + COLUMN_PIECE, in_features, generator=gen
                           ).to(device, dtype)
        alone = torch.stack([_columns(rows[r:r + COLUMN_PIECE], weight)[0]
                             for r in range(DECODE_TILE)])
        for m in sizes:
            for first in {0, DECODE_TILE - m, (DECODE_TILE - m) // 2}:
                if not torch.equal(_columns(rows[first:first + m], weight),
                                   alone[first:first + m]):
                    return False
    return True


def wide_agrees(shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a DECODE_TILE-row GEMM gives the same bits in both orientations (true here:
    MKL runs both as the same kernel at 16 rows; the columns one is faster)."""
    gen = torch.Generator().manual_seed(2)
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features, generator=gen).to(device, dtype)
        rows = torch.randn(DECODE_TILE, in_features, generator=gen).to(device, dtype)
        if not torch.equal(_columns(rows, weight), F.linear(rows, weight)):
            return False
    return True


@dataclass(frozen=True)
class DecodePlan:
    """How decode runs its matmuls at one thread count (see COLUMN_ROLES)."""

    tiles: tuple[int, ...]  # row counts a step pads to
    column_roles: frozenset[str]  # roles run in the columns orientation, <= COLUMN_PIECE rows
    wide_columns: bool  # the other roles run a full tile as one columns GEMM (same bits)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.weights = weights.prepare(self.device, self.dtype)
        # Decode on the GGUF's quantized blocks: only where the fp32 decode runs natively
        # (`native_linear`), never in torch.
        self.quantized = (weights.quantized if weights.quantized is not None
                          and native.quantized_decode() else None)
        angles = torch.arange(config.max_context, dtype=torch.float64)[:, None] * rope_inv_freq(
            config)
        self.cos = angles.cos().to(torch.float32).to(self.device)
        self.sin = angles.sin().to(torch.float32).to(self.device)
        self._plan_for_threads: tuple[int, DecodePlan] | None = None
        self._native_shapes: bool | None = None
        self._decode_layers: native.DecodeLayers | None = None

    def native_linear(self) -> bool:
        """Whether decode matmuls run in the native kernel (`native.linear`,
        kernels/decode_linear.c: each output in one fixed order, so no padding rows): on
        CPU in fp32 where the native kernels built, for a model whose every decode weight
        shape the kernel takes and whose layers the one-call step takes (`DecodeLayers`:
        the decision and the path it leads to agree). Otherwise they follow `decode_plan`
        in torch."""
        if not native.usable(self.device, self.dtype):
            return False
        if self._native_shapes is None:
            ok = all(native.linear_takes(tuple(t.shape))
                     for ts in self._role_weights().values() for t in ts)
            if ok:
                try:
                    self._native_layers()
                except ValueError:
                    ok = False
            self._native_shapes = ok
        return self._native_shapes

    def _native_layers(self) -> native.DecodeLayers:
        """Every layer of a decode step in one native call (built once: the weights'
        addresses, checked)."""
        if self._decode_layers is None:
            cfg = self.config
            quant = self.quantized.fused() if self.quantized is not None else None
            self._decode_layers = native.DecodeLayers(self.weights.layers, self.weights.norm,
                                                      cfg.n_heads, cfg.n_kv_heads,
                                                      cfg.head_dim, cfg.norm_eps,
                                                      cfg.attention_window or 0, quant)
        return self._decode_layers

    @property
    def decode_tiles(self) -> tuple[int, ...]:
        """Row counts decode pads to: every count 1..DECODE_TILE with the native matmuls
        (no padding); in torch DECODE_TILES where `tiles_agree` holds for this model's
        matmul shapes at the current thread count, else (DECODE_TILE,)."""
        if self.native_linear():
            return NATIVE_TILES
        return self.decode_plan.tiles

    def _role_weights(self) -> dict[str, list[torch.Tensor]]:
        w = self.weights
        return {"qkv": [layer.wqkv for layer in w.layers], "o": [layer.wo for layer in w.layers],
                "gate_up": [layer.w_gate_up for layer in w.layers],
                "down": [layer.w_down for layer in w.layers], "lm_head": [w.lm_head]}

    @property
    def decode_plan(self) -> DecodePlan:
        """The decode matmul plan at the current thread count, every part of it checked
        on this machine for this model's shapes (BLAS picks kernels by shape and threads)."""
        threads = torch.get_num_threads()
        if self._plan_for_threads is None or self._plan_for_threads[0] != threads:
            roles = {role: sorted({tuple(t.shape) for t in ts})
                     for role, ts in self._role_weights().items()}
            all_shapes = sorted({s for shapes in roles.values() for s in shapes})
            tiles = (DECODE_TILES if tiles_agree(all_shapes, DECODE_TILES, self.device,
                                                 self.dtype) else (DECODE_TILE,))
            column_shapes = sorted({s for r in COLUMN_ROLES for s in roles[r]})
            sizes = tuple(sorted({min(t, COLUMN_PIECE) for t in tiles}))
            columns = columns_agree(column_shapes, sizes, self.device, self.dtype)
            row_shapes = sorted({s for r, shapes in roles.items() if r not in COLUMN_ROLES
                                 or not columns for s in shapes})
            plan = DecodePlan(tiles, frozenset(COLUMN_ROLES if columns else ()),
                              wide_agrees(row_shapes, self.device, self.dtype))
            self._plan_for_threads = (threads, plan)
        return self._plan_for_threads[1]

    def _decode_linear(self, x: torch.Tensor, weight: torch.Tensor, role: str) -> torch.Tensor:
        """x @ weight^T for a decode tile of x's rows in torch, in the role's orientation."""
        plan = self.decode_plan
        if role in plan.column_roles:
            if x.shape[0] <= COLUMN_PIECE:
                return _columns(x, weight)
            return torch.cat([_columns(piece, weight) for piece in x.split(COLUMN_PIECE)])
        if plan.wide_columns and x.shape[0] == DECODE_TILE:
            return _columns(x, weight)
        return F.linear(x, weight)

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
        decode: bool = False,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, dim]. Rows outside every segment are
        padding: they write no KV and attend to nothing.

        Per layer: the K/V of every segment is written, then read back (a paged store
        does each in one call for the whole batch), and attention runs per segment over
        that segment's own keys only (see the module docstring). `decode`: the rows are
        one padded decode tile (its matmuls follow `decode_plan`)."""
        cfg, w = self.config, self.weights
        n, heads, kv_heads, hd = token_ids.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qk_dim = cfg.q_dim + cfg.kv_dim
        kinds = {type(seg.kv) for seg in segments}
        if len(kinds) != 1:
            raise ValueError(f"one forward needs one KV store type, got {sorted(map(str, kinds))}")
        store = kinds.pop().for_segments(segments)
        eps = cfg.norm_eps
        if decode and n == len(segments) and self.native_linear():
            # All of it native (no padding rows): every layer in one call.
            if any(seg.row != i or seg.num_rows != 1 for i, seg in enumerate(segments)):
                raise ValueError("a decode tile's segments are rows 0..n-1, one row each")
            attend, targets = store.decode_attention(), store.decode_targets()
            return self._native_layers()(w.embed[token_ids], positions, self.cos, self.sin,
                                         attend, targets)
        window = cfg.attention_window
        masks = [self._chunk_mask(seg, window) for seg in segments]

        def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
            """The residual add (when there is one), then RMSNorm: (new x, its norm)."""
            if delta is not None:
                x = x + delta
            return x, rms_norm(x, weight, eps)

        if not decode:
            linear = lambda x, weight, role: F.linear(x, weight)  # noqa: E731
        else:  # the torch decode matmuls (the native ones ran above)
            linear = self._decode_linear
        attend = None
        if decode and native.usable(self.device, self.dtype):
            if any(seg.row != i or seg.num_rows != 1 for i, seg in enumerate(segments)):
                raise ValueError("a decode tile's segments are rows 0..n-1, one row each")
            attend = store.decode_attention()
        x, delta = w.embed[token_ids], None  # delta: the residual branch not yet added to x
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        for index, layer in enumerate(w.layers):
            x, h = add_norm(x, delta, layer.attn_norm)
            qkv = linear(h, layer.wqkv, "qkv")
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv  # guard: qkv-bias-torch
            qk = _rope(qkv[:, :qk_dim].view(n, heads + kv_heads, hd), cos, sin)
            store.write(index, qk[:, heads:], qkv[:, qk_dim:].view(n, kv_heads, hd))
            q = qk[:, :heads]
            per_segment: Iterable = ()
            if attend is not None and n == len(segments):  # no padding rows: as it comes
                attn = attend(index, q, kv_heads, hd, window or 0)
            elif attend is not None:  # every decode row over its K/V in place (native.py)
                attn = torch.zeros(n, heads, hd, dtype=x.dtype, device=x.device)
                attn[:len(segments)] = attend(index, q[:len(segments)], kv_heads, hd,
                                              window or 0)
            else:
                attn = torch.zeros(n, heads, hd, dtype=x.dtype, device=x.device)
                per_segment = zip(segments, masks, store.read(index), strict=True)
            for seg, (mask, first_key), (keys, values) in per_segment:
                rows = slice(seg.row, seg.row + seg.num_rows)
                if seg.num_rows == 1:
                    if window is not None:  # its last `window` keys
                        first = max(0, keys.shape[2] - window)  # guard: window-decode-torch
                        keys, values = keys[:, :, first:], values[:, :, first:]
                    # Decode: the query heads sharing a KV head become that head's query
                    # rows ([1, kv_heads, group, hd], no mask: a decode row sees every
                    # key), so SDPA runs kv_heads heads of `group` rows instead of
                    # n_heads heads of one row.
                    out = F.scaled_dot_product_attention(
                        q[rows].reshape(1, kv_heads, heads // kv_heads, hd), keys, values)
                    attn[rows] = out.view(1, heads, hd)
                    continue
                query = q[rows].transpose(0, 1).unsqueeze(0)
                if mask is None:
                    out = _chunk_attention(query, keys, values, seg.start_pos)
                else:
                    out = F.scaled_dot_product_attention(
                        query, keys[:, :, first_key:], values[:, :, first_key:],
                        attn_mask=mask, enable_gqa=True)
                attn[rows] = out[0].transpose(0, 1)
            x, h = add_norm(x, linear(attn.view(n, cfg.q_dim), layer.wo, "o"), layer.ffn_norm)
            gate, up = linear(h, layer.w_gate_up, "gate_up").chunk(2, dim=-1)
            delta = linear(F.silu(gate) * up, layer.w_down, "down")
        return add_norm(x, delta, w.norm)[1]

    def _chunk_mask(self, seg: Segment, window: int | None
                    ) -> tuple[torch.Tensor | None, int]:
        """(additive mask, first key) of a prefill chunk's attention: each row sees the
        keys up to its own position, the last `window` of them with a sliding window. None
        (keys from 0) where `_chunk_attention`'s two flash calls compute it unmasked: on
        CPU, no key outside any row's window. Built once per forward: SDPA would turn a
        boolean mask into this same 0/-inf tensor in every layer. Its shape depends on the
        chunk's positions only."""
        end = seg.start_pos + seg.num_rows
        windowed = window is not None and end > window
        if seg.num_rows == 1 or (self.device.type == "cpu" and not windowed):
            return None, 0
        first_key = max(0, seg.start_pos - window + 1) if windowed else 0
        query_pos = torch.arange(seg.start_pos, end, device=self.device)[:, None]
        key_pos = torch.arange(first_key, end, device=self.device)
        hidden = key_pos > query_pos
        if windowed:
            hidden |= key_pos <= query_pos - window  # guard: window-prefill
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill(hidden, float("-inf")), first_key

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden [N, dim] (or [dim])."""
        return F.linear(hidden, self.weights.lm_head).float()

    # ---- the two fixed-shape schedules every engine uses --------------------------------
    def prefill_chunk(self, kv: KVView, token_ids: list[int], start: int,
                      all_rows: bool = False) -> torch.Tensor:
        """Run one chunk (within a PREFILL_CHUNK-aligned window); returns the last hidden
        [dim], or every row's [n, dim] with `all_rows` (the prompt's own logprobs)."""
        tokens = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        hidden = self.forward(tokens, positions, [Segment(kv, 0, len(token_ids), start)])
        return hidden if all_rows else hidden[-1]

    def row_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int,
                     block: int = 64) -> list[tuple[float, list[tuple[int, float]]]]:
        """For row i of `hidden` [n, dim] (n >= len(targets)): the logprob of `targets[i]`
        and the top `k`, from the raw logits (as a sampled token's), `block` rows at a time
        so a long chunk never holds [n, vocab] logits at once."""
        out: list[tuple[float, list[tuple[int, float]]]] = []
        for lo in range(0, len(targets), block):
            rows = targets[lo:lo + block]
            logp = torch.log_softmax(self.logits(hidden[lo:lo + len(rows)]), dim=-1)
            picked = logp.gather(1, torch.tensor(rows, device=logp.device)[:, None])[:, 0]
            if k > 0:
                values, ids = torch.topk(logp, k, dim=-1)
            for i in range(len(rows)):
                top = ([(int(t), float(v)) for t, v in zip(ids[i], values[i], strict=True)]
                       if k > 0 else [])
                out.append((float(picked[i]), top))
        return out

    def decode_tile(
        self, kvs: list[KVView], token_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """One decode step for up to DECODE_TILE requests, padded with dummy rows to the
        smallest of `decode_tiles` that holds them, so a row's GEMM results never depend
        on the batch. Returns fp32 logits [len(kvs), vocab]."""
        count = len(kvs)
        assert 0 < count <= DECODE_TILE
        rows = next(t for t in self.decode_tiles if t >= count)
        pad = rows - count
        tokens = torch.tensor(token_ids + [0] * pad, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions + [0] * pad, dtype=torch.long, device=self.device)
        segments = [Segment(kv, row, 1, positions[row]) for row, kv in enumerate(kvs)]
        hidden = self.forward(tokens, pos, segments, decode=True)
        if self.native_linear():
            if self.quantized is not None and self.quantized.lm_head is not None:
                return native.linear_q(hidden[:count], self.quantized.lm_head)
            return native.linear(hidden[:count], self.weights.lm_head)
        return self._decode_linear(hidden, self.weights.lm_head, "lm_head")[:count].float()


def prefill_windows(start: int, num_tokens: int) -> list[tuple[int, int]]:
    """(chunk_start, chunk_len) pieces of [start, start+num_tokens), split at absolute
    multiples of PREFILL_CHUNK so the split never depends on who runs the prefill."""
    pieces, pos, end = [], start, start + num_tokens
    while pos < end:
        stop = min(end, (pos // PREFILL_CHUNK + 1) * PREFILL_CHUNK)
        pieces.append((pos, stop - pos))
        pos = stop
    return pieces
