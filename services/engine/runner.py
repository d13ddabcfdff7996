"""The per-worker compute API: paged prefill and continuously batched paged decode.

Every attention read goes through the pool's lease checks first (invariant I2): a prefill
chunk checks that the lease may write its positions and read everything before them; a
decode step checks, for every request in the batch, that it appends at its written length
and may read all its earlier tokens. Only then does the model touch the pages.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from pdmesh.kvstore import KVPool, Lease, LeaseAccessError, PoolSpec, ScrubPolicy
from pdmesh.kvstore.spec import pages_for
from pdmesh.services.engine.model import (
    DECODE_TILE,
    PREFILL_CHUNK,
    LlamaModel,
    LoadedModel,
    Segment,
    default_dtype,
    prefill_windows,
)
from pdmesh.services.engine.native import DecodeAttention


@dataclass(frozen=True)
class DecodeSlot:
    """One request's place in a decode step: append `token_id` at `position`."""

    lease: Lease
    token_id: int
    position: int


class PagedKV:
    """KVView over one lease's pages. Access checks happen in Engine before the forward."""

    def __init__(self, pool: KVPool, lease: Lease) -> None:
        self.tensor = pool.tensor
        self.page_tokens = pool.spec.page_tokens
        self.lease = lease
        self.page_ids = lease.page_ids

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        PagedSegmentsKV([Segment(self, 0, k.shape[0], start)]).write(layer, k, v)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = next(PagedSegmentsKV([Segment(self, 0, 1, length - 1)]).read(layer))
        return keys[0].transpose(0, 1), values[0].transpose(0, 1)

    @staticmethod
    def for_segments(segments: list[Segment]) -> PagedSegmentsKV:
        return PagedSegmentsKV(segments)


@cache
def _layer_steps(num_layers: int, page_tokens: int) -> np.ndarray:
    """[layers, 1]: how many token slots layer l's K lies after layer 0's in a page."""
    steps = np.arange(num_layers, dtype=np.int64)[:, None] * (2 * page_tokens)
    steps.flags.writeable = False
    return steps


class PagedSegmentsKV:
    """The paged KV of one forward's segments.

    Every slot and page-row index of the forward is computed once (numpy). Per layer, two
    `index_put_` on the pool viewed as token slots `[pages*layers*2*page_tokens, kv_heads,
    head_dim]` write every segment's new K and V; then, per segment and just before its
    attention, one `index_select` on the pool viewed as page rows `[pages*layers*2,
    page_tokens*kv_heads*head_dim]` (a contiguous source) gathers its K and V page rows
    into one buffer allocated once per forward. Before, each request paid two slice writes
    per page touched and two gathers (from a strided view, into fresh allocations) per
    layer, a dozen small torch calls each. The bytes moved, hence the bits, are the same."""

    def __init__(self, segments: list[Segment]) -> None:
        first: PagedKV = segments[0].kv  # type: ignore[assignment]
        tensor, size = first.tensor, first.page_tokens
        num_layers, device = tensor.shape[1], tensor.device
        self.tensor = tensor
        if any(seg.kv.tensor is not tensor for seg in segments):  # type: ignore[attr-defined]
            raise ValueError("one forward's paged segments must share one pool")
        leases = [seg.kv.lease for seg in segments]  # type: ignore[attr-defined]
        self.lengths: list[int] = [seg.start_pos + seg.num_rows for seg in segments]
        # Per segment, its pages 0..length (what its attention reads).
        self.gather = [lease.page_array[:pages_for(length, size)]
                       for lease, length in zip(leases, self.lengths, strict=True)]
        # Token slots in the view [pages * layers * 2 * page_tokens, kv_heads, head_dim]:
        # K of (page, layer, offset) at ((page * layers + layer) * 2 + 0) * page_tokens +
        # offset, V one page_tokens further. `_slots` [layers, rows]: the K slot of each
        # row in each layer. The torch index tensors and views are built on first use
        # (`write`, `read`): a decode step whose K/V append and attention run natively
        # uses neither.
        page_slots = num_layers * 2 * size
        self.rows: slice | torch.Tensor
        if all(seg.num_rows == 1 for seg in segments):  # a decode step: scalars per row
            n = len(segments)
            first_slots = np.fromiter(
                (lease.page_ids[seg.start_pos // size] * page_slots + seg.start_pos % size
                 for lease, seg in zip(leases, segments, strict=True)), np.int64, n)
            self._rows_in_order = all(seg.row == i for i, seg in enumerate(segments))
            self.rows = slice(0, n)
            if not self._rows_in_order:
                self.rows = torch.tensor([seg.row for seg in segments], device=device)
        else:
            pages, offsets, rows = [], [], []
            for lease, seg in zip(leases, segments, strict=True):
                positions = np.arange(seg.start_pos, seg.start_pos + seg.num_rows)
                pages.append(lease.page_array[positions // size])
                offsets.append(positions % size)
                rows.append(np.arange(seg.row, seg.row + seg.num_rows))
            first_slots = np.concatenate(pages) * page_slots + np.concatenate(offsets)
            row_index = np.concatenate(rows)
            self.rows = slice(0, len(row_index))
            self._rows_in_order = bool(np.array_equal(row_index, np.arange(len(row_index))))
            if not self._rows_in_order:
                self.rows = torch.from_numpy(row_index).to(device)
        self._slots = first_slots[None, :] + _layer_steps(num_layers, size)
        self.num_layers, self.page_tokens = num_layers, size
        self._torch_slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._gather_rows: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def _views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K slots [layers, rows], V slots, the pool as token slots) for `write`."""
        if self._torch_slots is None:
            k_slots = torch.from_numpy(self._slots).to(self.tensor.device)
            self._torch_slots = (k_slots, k_slots + self.page_tokens,
                                 self.tensor.view(-1, *self.tensor.shape[-2:]))
        return self._torch_slots

    @property
    def rows_view(self) -> torch.Tensor:
        """The pool as page rows [pages * layers * 2, page_tokens * kv_heads * head_dim]."""
        t = self.tensor
        return t.view(-1, self.page_tokens * t.shape[-2] * t.shape[-1])

    def _gather_plan(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per segment, its page rows in the view [pages * layers * 2, page_tokens *
        kv_heads * head_dim] (per layer, the K rows of its pages, then their V rows), and
        one buffer for a segment's K and V. Built on the first `read`: a forward whose
        decode attention runs natively never gathers."""
        if self._gather_rows is None:
            device = self.tensor.device
            layer_rows = 2 * np.arange(self.num_layers)[:, None]
            page_rows = []
            for pages_of_seg in self.gather:
                k_rows = pages_of_seg[None, :] * (self.num_layers * 2) + layer_rows
                page_rows.append(torch.from_numpy(
                    np.concatenate((k_rows, k_rows + 1), axis=1)).to(device))
            # One segment's K and V at a time, gathered just before its attention reads
            # them (a request's layer is ~0.8 MB for smollm2 at 512 tokens: still in L2
            # when SDPA reads it; gathering the whole batch first was measured slower).
            buffer = torch.empty(max(r.shape[1] for r in page_rows), self.rows_view.shape[1],
                                 dtype=self.tensor.dtype, device=device)
            self._gather_rows = (page_rows, buffer)
        return self._gather_rows

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        k_slots, v_slots, slots_view = self._views()
        slots_view.index_put_((k_slots[layer],), k[self.rows])
        slots_view.index_put_((v_slots[layer],), v[self.rows])

    def decode_targets(self) -> np.ndarray:
        """Byte addresses of every row's K and V slot, [layers, 2, rows] int64 (rows in
        forward order), for the native K/V append (kernels/decode_pointwise.c). The slots come
        from the leases' own pages; each is checked to lie inside the pool."""
        if not self._rows_in_order:
            raise ValueError("the native K/V append takes a decode step's rows in order")
        slots, t = self._slots, self.tensor
        if slots.size and (slots.min() < 0 or slots.max() + self.page_tokens
                           >= t.shape[0] * t.shape[1] * 2 * self.page_tokens):
            raise ValueError("a K/V slot outside the pool")
        row_bytes = t.shape[-2] * t.shape[-1] * t.element_size()
        out = np.empty((slots.shape[0], 2, slots.shape[1]), dtype=np.int64)
        np.multiply(slots, row_bytes, out=out[:, 0])  # guard: native-kv-append
        out[:, 0] += t.data_ptr()
        np.add(out[:, 0], self.page_tokens * row_bytes, out=out[:, 1])
        return out

    def decode_attention(self) -> DecodeAttention:
        """The pool in place: page `p` of a request starts p * page_stride floats in."""
        tensor = self.tensor
        return DecodeAttention.over_pool(tensor, self.page_tokens,
                                         self.gather, self.lengths)  # guard: native-page-table

    def read(self, layer: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        shape = (2, -1, *self.tensor.shape[-2:])  # K/V, tokens, kv_heads, head_dim
        all_rows, whole = self._gather_plan()
        rows_view = self.rows_view
        for page_rows, length in zip(all_rows, self.lengths, strict=True):
            buffer = whole[:page_rows.shape[1]]
            torch.index_select(rows_view, 0, page_rows[layer], out=buffer)
            keys, values = buffer.view(shape)[:, :length].transpose(1, 2).unsqueeze(1)
            yield keys, values


def pool_spec_for(
    model: LoadedModel, num_pages: int, page_tokens: int = 16, dtype: torch.dtype = torch.float32
) -> PoolSpec:
    cfg = model.config
    return PoolSpec(num_layers=cfg.n_layers, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    page_tokens=page_tokens, num_pages=num_pages, dtype=dtype)


def make_pool(
    model: LoadedModel,
    num_pages: int,
    page_tokens: int = 16,
    scrub: ScrubPolicy | str = ScrubPolicy.NONE,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> KVPool:
    """A KVPool whose geometry matches `model`, on `device`, in the engine's compute dtype
    for that device (`default_dtype`: fp32 on CPU, bf16/fp16 on CUDA) unless given."""
    dtype = dtype or default_dtype(device)
    return KVPool(pool_spec_for(model, num_pages, page_tokens, dtype), scrub=scrub,
                  device=str(device))


class Engine:
    """Synchronous torch engine over one KVPool. Services call it from a worker thread."""

    def __init__(self, model: LoadedModel, pool: KVPool) -> None:
        cfg, spec = model.config, pool.spec
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim) != (
            cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        ):
            raise ValueError(f"pool geometry {spec} does not match model {cfg}")
        if not spec.dtype.is_floating_point or spec.dtype.itemsize < 2:
            raise ValueError(f"the engine computes in the pool's dtype; {spec.dtype} is not "
                             "a float type it runs (float32, bfloat16, float16)")
        self.loaded = model
        self.config = cfg
        self.pool = pool
        # The model computes in the pool's dtype on the pool's device: K/V are stored as
        # computed, so paged and reference engines of one dtype produce the same bits.
        self.model = LlamaModel(cfg, model.weights, device=pool.device, dtype=spec.dtype)
        self.prefill_tokens_computed = 0  # prompt tokens run through the model (not cached)

    @property
    def prefix_align_tokens(self) -> int:
        """Granularity of prefix-cache reuse: whole pages *and* whole prefill chunks, so a
        prefill that starts after a cached prefix runs the same chunk shapes, hence the
        same bits, as one that starts at 0 (see model.py, batch invariance)."""
        return math.lcm(self.pool.spec.page_tokens, PREFILL_CHUNK)

    @torch.inference_mode()
    def prefill(self, lease: Lease, token_ids: list[int], start_position: int = 0) -> torch.Tensor:
        """Write K/V of `token_ids` at positions start_position.. into the lease's pages
        (chunked at fixed PREFILL_CHUNK boundaries) and return the last position's logits.

        With a prefix-cache hit, `start_position` is the lease's cached length and the lease
        reads its pinned cached pages for positions before it; the same checks apply."""
        return self.model.logits(self._prefill(lease, token_ids, start_position)[-1][-1])

    @torch.inference_mode()
    def prefill_scored(self, lease: Lease, token_ids: list[int], start_position: int,
                       k: int, next_id: int | None
                       ) -> tuple[torch.Tensor, list[tuple[float, list[tuple[int, float]]]]]:
        """`prefill`, and the logprobs of each of these tokens' successors: token i + 1 given
        the tokens up to i, and `next_id` (the prompt token after these, None at the
        prompt's end) after the last; `k` alternatives each."""
        chunks = self._prefill(lease, token_ids, start_position, all_rows=True)
        successors = [*token_ids[1:], *([] if next_id is None else [next_id])]
        entries, row = [], 0
        for hidden in chunks:
            take = successors[row:row + hidden.shape[0]]
            entries += self.model.row_logprobs(hidden, take, k)
            row += hidden.shape[0]
        return self.model.logits(chunks[-1][-1]), entries

    @torch.inference_mode()
    def _prefill(self, lease: Lease, token_ids: list[int], start_position: int,
                 all_rows: bool = False) -> list[torch.Tensor]:
        """Each chunk's hidden rows ([n, dim]; the last row only, [1, dim], unless
        `all_rows`), the KV written and checked as `prefill` says."""
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise ValueError("prefill needs at least one token")
        if start_position + num_tokens > self.config.max_context:
            raise ValueError(f"{start_position + num_tokens} tokens exceed max_context "
                             f"{self.config.max_context}")
        self._check_append(lease, start_position)
        self.pool.check_writable(lease, start_position, num_tokens)
        kv = PagedKV(self.pool, lease)
        out = []
        for chunk_start, chunk_len in prefill_windows(start_position, num_tokens):
            # I2: this chunk attends over [0, chunk_start + chunk_len); the earlier part must
            # be this lease's own, written, in this epoch.
            self.pool.check_readable(lease, chunk_start)
            self.pool.check_writable(lease, chunk_start, chunk_len)
            piece = token_ids[chunk_start - start_position:chunk_start - start_position + chunk_len]
            hidden = self.model.prefill_chunk(kv, piece, chunk_start, all_rows=all_rows)
            out.append(hidden if all_rows else hidden[None])
            self.pool.mark_written_range(lease, chunk_start, chunk_len)
            self.prefill_tokens_computed += chunk_len
        return out

    @torch.inference_mode()
    def decode_step(self, batch: list[DecodeSlot]) -> torch.Tensor:
        """Append each slot's token at its position and return next logits [B, vocab].

        Each request attends only to its own pages and every matmul is row-wise, so results
        do not depend on the batch (see model.py); the batch runs DECODE_TILE rows per
        model call."""
        if not batch:
            raise ValueError("empty decode batch")
        seen: set[str] = set()
        for slot in batch:
            if slot.lease.lease_id in seen:
                raise ValueError(f"lease {slot.lease.lease_id} twice in one decode batch")
            seen.add(slot.lease.lease_id)
            if slot.position >= self.config.max_context:
                raise ValueError(f"position {slot.position} >= max_context")
        leases, positions = [s.lease for s in batch], [s.position for s in batch]
        self.pool.check_decode_batch(leases, positions)
        outputs = []
        for first in range(0, len(batch), DECODE_TILE):
            tile = batch[first:first + DECODE_TILE]
            outputs.append(self.model.decode_tile(
                [PagedKV(self.pool, s.lease) for s in tile],
                [s.token_id for s in tile],
                [s.position for s in tile],
            ))
        self.pool.mark_decode_batch(leases, positions)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _check_append(self, lease: Lease, position: int) -> None:
        written = self.pool.written_prefix(lease)
        if position != written:
            raise LeaseAccessError(
                lease.lease_id, None,
                f"append at position {position} but the lease has {written} tokens written",
            )
