"""The native paged decode attention (services/engine/native.py): close to torch's SDPA,
bit for bit the same for a request whatever its batch, its page layout or the thread
count (I4 rests on it), and clear about what it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdmesh.services.engine import native
from pdmesh.services.engine.model import LlamaModel, columns_agree, tiles_agree, wide_agrees
from pdmesh.services.engine.native import DecodeAttention, NativeUnavailable

pytestmark = pytest.mark.skipif(native.setting() == "off", reason="PDMESH_NATIVE_KERNELS=off")

# (layers, kv_heads, group, head_dim): tiny's, SmolLM2's, and an odd small one.
GEOMETRIES = [(4, 2, 4, 32), (30, 3, 3, 64), (2, 1, 1, 8)]
LENGTHS = [1, 15, 16, 17, 100, 513]
PAGE = 16


def _pool(layers: int, kv_heads: int, head_dim: int, pages: int, seed: int,
          page: int = PAGE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(pages, layers, 2, page, kv_heads, head_dim, generator=gen)


def _scattered(lengths: list[int], pages: int, seed: int, page: int = PAGE
               ) -> list[np.ndarray]:
    """Each request's pages, disjoint, in a random order across the pool."""
    order = np.random.default_rng(seed).permutation(pages)
    out, used = [], 0
    for length in lengths:
        count = -(-length // page)
        out.append(order[used:used + count])
        used += count
    return out


def _paged(pool: torch.Tensor, page_lists: list[np.ndarray], lengths: list[int]
           ) -> DecodeAttention:
    n, page = len(lengths), pool.shape[3]
    return DecodeAttention([pool.data_ptr()] * n, [page] * n, [pool[0].numel()] * n,
                           page_lists, lengths, [pool], [pool.shape[0]] * n)


def test_it_builds_on_this_machine() -> None:
    assert native.available()


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_it_computes_attention_over_each_requests_own_pages(geometry) -> None:
    layers, kv_heads, group, head_dim = geometry
    pages = sum(-(-n // PAGE) for n in LENGTHS) + 5
    pool = _pool(layers, kv_heads, head_dim, pages, seed=1)
    page_lists = _scattered(LENGTHS, pages, seed=2)
    q = torch.randn(len(LENGTHS), kv_heads * group, head_dim)
    attend = _paged(pool, page_lists, LENGTHS)
    for layer in {0, layers - 1}:
        out = attend(layer, q, kv_heads, head_dim)
        for i, length in enumerate(LENGTHS):
            kv = pool[torch.from_numpy(page_lists[i]), layer]  # [pages, 2, PAGE, kvh, hd]
            keys = kv[:, 0].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)
            values = kv[:, 1].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)
            expected = F.scaled_dot_product_attention(
                q[i].view(kv_heads, group, head_dim), keys, values)
            torch.testing.assert_close(out[i], expected.reshape(-1, head_dim),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("geometry", "page"), [(GEOMETRIES[0], PAGE), (GEOMETRIES[1], PAGE),
                                                 (GEOMETRIES[1], 5), (GEOMETRIES[0], 12)])
def test_a_requests_bits_do_not_depend_on_batch_layout_or_threads(geometry, page) -> None:
    """Alone, in a batch, from scattered pages or from one contiguous cache, at 1 or 2
    threads: the same bits (the reference engine reads a contiguous cache, I4). Pages of 5
    and 12 tokens split the kernel's 8-token blocks elsewhere than a contiguous cache does."""
    layers, kv_heads, group, head_dim = geometry
    pages = sum(-(-n // page) for n in LENGTHS) + 3
    pool = _pool(layers, kv_heads, head_dim, pages, seed=3, page=page)
    page_lists = _scattered(LENGTHS, pages, seed=4, page=page)
    q = torch.randn(len(LENGTHS), kv_heads * group, head_dim)
    layer = layers - 1
    batched = _paged(pool, page_lists, LENGTHS)(layer, q, kv_heads, head_dim)
    threads = torch.get_num_threads()
    try:
        for i, length in enumerate(LENGTHS):
            alone = _paged(pool, [page_lists[i]], [length])(layer, q[i:i + 1], kv_heads,
                                                             head_dim)
            assert torch.equal(alone[0], batched[i]), length
            # The same K/V as a contiguous cache [layers, 2, capacity, kvh, hd], one page.
            capacity = length + 7
            cache = torch.zeros(layers, 2, capacity, kv_heads, head_dim)
            kv = pool[torch.from_numpy(page_lists[i])]  # [pages, layers, 2, PAGE, kvh, hd]
            cache[:, :, :length] = kv.permute(1, 2, 0, 3, 4, 5).reshape(
                layers, 2, -1, kv_heads, head_dim)[:, :, :length]
            contiguous = DecodeAttention([cache.data_ptr()], [capacity], [0],
                                         [np.zeros(1, np.int64)], [length], [cache], [1])
            assert torch.equal(contiguous(layer, q[i:i + 1], kv_heads, head_dim)[0],
                               batched[i]), length
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(_paged(pool, page_lists, LENGTHS)(layer, q, kv_heads, head_dim),
                           batched)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_a_sliding_window_attends_to_the_last_keys_the_same_in_any_layout(window) -> None:
    """With a window, each request over its last `window` keys only (close to SDPA over
    them); the same bits from scattered pages of 5 or 16 tokens, alone or batched, and
    from one contiguous cache, whose keys before the window the kernel reads but weighs
    nothing."""
    layers, kv_heads, group, head_dim = GEOMETRIES[0]
    q = torch.randn(len(LENGTHS), kv_heads * group, head_dim)
    for page in (PAGE, 5):
        pages = sum(-(-n // page) for n in LENGTHS) + 3
        pool = _pool(layers, kv_heads, head_dim, pages, seed=6, page=page)
        page_lists = _scattered(LENGTHS, pages, seed=7, page=page)
        batched = _paged(pool, page_lists, LENGTHS)(1, q, kv_heads, head_dim, window)
        for i, length in enumerate(LENGTHS):
            kv = pool[torch.from_numpy(page_lists[i]), 1]
            keys, values = (kv[:, j].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1)
                            for j in (0, 1))
            first = max(0, length - window)
            expected = F.scaled_dot_product_attention(
                q[i].view(kv_heads, group, head_dim), keys[:, first:], values[:, first:])
            torch.testing.assert_close(batched[i], expected.reshape(-1, head_dim),
                                       rtol=1e-5, atol=1e-5)
            alone = _paged(pool, [page_lists[i]], [length])(1, q[i:i + 1], kv_heads,
                                                             head_dim, window)
            assert torch.equal(alone[0], batched[i]), (page, length)
            cache = torch.zeros(layers, 2, length + 3, kv_heads, head_dim)
            cache[1, 0, :length], cache[1, 1, :length] = keys.transpose(0, 1), values.transpose(
                0, 1)
            contiguous = DecodeAttention([cache.data_ptr()], [length + 3], [0],
                                         [np.zeros(1, np.int64)], [length], [cache], [1])
            assert torch.equal(contiguous(1, q[i:i + 1], kv_heads, head_dim, window)[0],
                               batched[i]), (page, length)


def test_arguments_it_cannot_serve_are_refused() -> None:
    pool = _pool(1, 1, 8, 4, seed=5)
    q = torch.randn(1, 1, 8)
    with pytest.raises(ValueError, match="refused"):  # 40 tokens need 3 pages, 2 given
        _paged(pool, [np.array([0, 1])], [40])(0, q, 1, 8)
    with pytest.raises(ValueError, match="refused"):  # head_dim not a multiple of 8
        _paged(pool, [np.array([0])], [4])(0, torch.randn(1, 1, 6), 1, 6)
    with pytest.raises(ValueError, match="outside its storage of 4 pages"):
        _paged(pool, [np.array([0, 4])], [20])
    with pytest.raises(ValueError, match="outside its storage"):
        _paged(pool, [np.array([-1])], [3])


def test_the_setting_and_a_missing_compiler_are_clear(monkeypatch) -> None:
    monkeypatch.setenv(native.SETTING, "fast")
    with pytest.raises(ValueError, match="auto, on or off"):
        native.setting()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(NativeUnavailable, match="no C compiler"):
        native._build()
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PDMESH_CACHE_DIR", "/tmp/pdmesh-test-native-cache-false")
    with pytest.raises(NativeUnavailable, match="failed"):
        native._build()


def test_the_decode_matmul_plan_is_checked_on_this_machine(tiny) -> None:
    """Decode runs qkv, o and lm_head in the columns orientation only because, here, its
    4..8-row GEMMs agree bit for bit; the check can fail (1-3 rows take other kernels),
    and the 16-row columns GEMM equals the rows one. The row tiles depend on the CPU's
    MKL kernels: (4, 8, 16) on the AVX-512 machines of sessions 1-8 (where 12-row columns
    GEMMs also disagree), only 16 on an AMX (Sapphire Rapids class) machine."""
    shapes = [(768, 256), (256, 768), (258, 256)]
    cpu = torch.device("cpu")
    assert columns_agree(shapes, (4, 8), cpu, torch.float32)
    assert not columns_agree(shapes, (1,), cpu, torch.float32)
    assert not tiles_agree(shapes, (1,), cpu, torch.float32)
    assert wide_agrees(shapes, cpu, torch.float32)
    plan = LlamaModel(tiny.config, tiny.weights).decode_plan
    if tiles_agree(shapes, (4, 8, 16), cpu, torch.float32):
        assert not columns_agree(shapes, (4, 12), cpu, torch.float32)
        assert plan.tiles == (4, 8, 16)
    else:
        assert plan.tiles == (16,)
    assert plan.wide_columns
    assert plan.column_roles == {"qkv", "o", "lm_head"}
