"""A decode step's native element-wise kernels (services/engine/native.py,
kernels/decode_pointwise.c): RoPE with the K/V append gives the torch RoPE's bits and
writes each row's K and V only into that row's own slot (I3: the addresses come from the
request's own pages, checked), SiLU * up is close to torch's and row-independent (I4),
and both are clear about what they refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdmesh.services.engine import native
from pdmesh.services.engine.model import ContiguousKV, LlamaModel, Segment, _rope
from pdmesh.services.engine.native import DecodeAttention
from pdmesh.services.engine.runner import PagedKV, PagedSegmentsKV, make_pool

pytestmark = pytest.mark.skipif(native.setting() == "off", reason="PDMESH_NATIVE_KERNELS=off")

# (heads, kv_heads, head_dim): tiny's, SmolLM2's, and a small odd one.
GEOMETRIES = [(8, 2, 32), (9, 3, 64), (3, 1, 6)]


def _tables(head_dim: int, rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(0, half, dtype=torch.float64) / half))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return angles.cos().float(), angles.sin().float()


def _targets(k_rows: torch.Tensor, v_rows: torch.Tensor) -> np.ndarray:
    """One layer's [1, 2, m] byte addresses: row i's K into k_rows[i], V into v_rows[i]."""
    return np.array([[[row.data_ptr() for row in k_rows], [row.data_ptr() for row in v_rows]]],
                    dtype=np.int64)


def rope_kv(qkv, positions, cos, sin, heads, kv_heads, targets) -> torch.Tensor:
    return native.KVAppend(targets)(0, qkv, positions, cos, sin, heads, kv_heads)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_rope_kv_gives_the_torch_ropes_bits_and_appends_k_and_v(geometry) -> None:
    heads, kv_heads, head_dim = geometry
    cos, sin = _tables(head_dim)
    m = 7
    qkv = torch.randn(m, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 1, 15, 16, 511, 1000, 2047])
    k_rows, v_rows = torch.zeros(m, kv_heads, head_dim), torch.zeros(m, kv_heads, head_dim)
    q = rope_kv(qkv, positions, cos, sin, heads, kv_heads, _targets(k_rows, v_rows))
    qk_dim = (heads + kv_heads) * head_dim
    expected = _rope(qkv[:, :qk_dim].view(m, heads + kv_heads, head_dim),
                     cos[positions][:, None], sin[positions][:, None])
    assert torch.equal(q, expected[:, :heads])
    assert torch.equal(k_rows, expected[:, heads:])
    assert torch.equal(v_rows, qkv[:, qk_dim:].view(m, kv_heads, head_dim))


def test_rope_kv_refuses_what_it_cannot_serve_and_writes_nothing() -> None:
    heads, kv_heads, head_dim = GEOMETRIES[0]
    cos, sin = _tables(head_dim, rows=64)
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim)
    k_rows, v_rows = torch.zeros(2, kv_heads, head_dim), torch.zeros(2, kv_heads, head_dim)
    targets = _targets(k_rows, v_rows)
    with pytest.raises(ValueError, match="position outside the tables"):
        rope_kv(qkv, torch.tensor([3, 64]), cos, sin, heads, kv_heads, targets)
    with pytest.raises(ValueError, match="position outside the tables"):
        rope_kv(qkv, torch.tensor([-1, 2]), cos, sin, heads, kv_heads, targets)
    null = targets.copy()
    null[0, 1, 1] = 0
    with pytest.raises(ValueError, match="null target"):
        rope_kv(qkv, torch.tensor([3, 4]), cos, sin, heads, kv_heads, null)
    assert not k_rows.any() and not v_rows.any()  # refused before the first byte
    with pytest.raises(ValueError, match="int64 \\[layers, 2, m\\]"):
        rope_kv(qkv, torch.tensor([3, 4]), cos, sin, heads, kv_heads, targets[0])
    with pytest.raises(ValueError, match="a layer < 1"):
        native.KVAppend(targets)(1, qkv, torch.tensor([3, 4]), cos, sin, heads, kv_heads)
    with pytest.raises(ValueError, match="int64 positions"):  # one target row, two rows
        rope_kv(qkv, torch.tensor([3, 4]), cos, sin, heads, kv_heads, targets[:, :, :1].copy())
    with pytest.raises(ValueError, match="contiguous fp32"):
        rope_kv(qkv[:, :-1], torch.tensor([3, 4]), cos, sin, heads, kv_heads, targets)
    with pytest.raises(ValueError, match="int64 positions"):
        rope_kv(qkv, torch.tensor([3, 4], dtype=torch.int32), cos, sin, heads,
                       kv_heads, targets)


def test_silu_mul_is_close_to_torch_and_a_rows_bits_are_its_own() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(16, 2 * 768, generator=gen) * 8
    gate_up[0, :6] = torch.tensor([-100.0, -87.5, -20.0, 0.0, 20.0, 100.0])
    out = native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
    for r in (0, 7, 15):
        assert torch.equal(native.silu_mul(gate_up[r:r + 1].clone())[0], out[r])
    others = torch.randn(16, 2 * 768, generator=gen)
    others[9] = gate_up[9]
    assert torch.equal(native.silu_mul(others)[9], out[9])
    with pytest.raises(ValueError, match="multiple of 16"):
        native.silu_mul(torch.randn(2, 2 * 24))


def test_the_k_v_append_targets_are_each_rows_own_slot(tiny) -> None:
    """The addresses the native append writes to: in the paged store, the slot of each
    request's own page for its position (pages scattered and out of order); in a
    contiguous cache, its own cache's row; positions outside a cache are refused."""
    pool = make_pool(tiny, num_pages=40, page_tokens=16)
    spacer = pool.allocate("spacer", 16 * 5)
    first = pool.allocate("a", 16 * 3)
    pool.release(spacer, "spacer")
    second = pool.allocate("b", 16 * 9)
    positions = [33, 100]
    segments = [Segment(PagedKV(pool, lease), row, 1, pos)
                for row, (lease, pos) in enumerate(zip((first, second), positions, strict=True))]
    targets = PagedSegmentsKV(segments).decode_targets()
    assert targets.shape == (tiny.config.n_layers, 2, 2)
    for row, (lease, pos) in enumerate(zip((first, second), positions, strict=True)):
        page, offset = lease.page_ids[pos // 16], pos % 16
        for layer in range(tiny.config.n_layers):
            assert targets[layer, 0, row] == pool.tensor[page, layer, 0, offset].data_ptr()
            assert targets[layer, 1, row] == pool.tensor[page, layer, 1, offset].data_ptr()

    caches = [ContiguousKV(tiny.config, 50, torch.device("cpu")) for _ in range(2)]
    store = ContiguousKV.for_segments([Segment(c, i, 1, 10 + i) for i, c in enumerate(caches)])
    targets = store.decode_targets()
    for i, cache in enumerate(caches):
        for layer in range(tiny.config.n_layers):
            assert targets[layer, 0, i] == cache.cache[layer, 0, 10 + i].data_ptr()
            assert targets[layer, 1, i] == cache.cache[layer, 1, 10 + i].data_ptr()
    with pytest.raises(ValueError, match="not one decode row inside its cache"):
        ContiguousKV.for_segments([Segment(caches[0], 0, 1, 50)]).decode_targets()


def test_a_decode_step_writes_only_its_rows_own_slots(tiny) -> None:
    """A native decode step changes no pool byte outside the slots of its rows' positions
    (another request's pages and the rest of its own stay as they were)."""
    model = LlamaModel(tiny.config, tiny.weights)
    if not model.native_linear():
        pytest.skip("the native matmuls do not take this model here")
    pool = make_pool(tiny, num_pages=12, page_tokens=16)
    pool.tensor.normal_()
    leases = [pool.allocate("a", 40), pool.allocate("b", 40)]
    before = pool.tensor.clone()
    positions = [5, 37]
    model.decode_tile([PagedKV(pool, lease) for lease in leases], [1, 2], positions)
    changed = (pool.tensor != before).flatten(2).any(-1)  # [pages, layers]: K or V rows
    touched = torch.zeros_like(changed)
    for lease, pos in zip(leases, positions, strict=True):
        touched[lease.page_ids[pos // 16]] = True
    assert changed.any() and not (changed & ~touched).any()
    slots = (pool.tensor != before).any(-1).any(-1)  # [pages, layers, 2, tokens]
    for lease, pos in zip(leases, positions, strict=True):
        page = lease.page_ids[pos // 16]
        assert slots[page, :, :, pos % 16].all()
        slots[page, :, :, pos % 16] = False
    assert not slots.any()


def test_the_pool_page_table_refuses_pages_outside_the_pool() -> None:
    pool = torch.zeros(4, 1, 2, 16, 1, 8)
    with pytest.raises(ValueError, match="outside its storage of 4 pages"):
        DecodeAttention.over_pool(pool, 16, [np.array([0, 1]), np.array([2, 4])], [20, 20])
    with pytest.raises(ValueError, match="segment 0: page ids outside"):
        DecodeAttention.over_pool(pool, 16, [np.array([-1])], [3])
    with pytest.raises(ValueError, match="one length per segment"):
        DecodeAttention.over_pool(pool, 16, [np.array([0])], [3, 4])
