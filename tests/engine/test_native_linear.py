"""The native decode matmuls and RMSNorm (services/engine/native.py,
kernels/decode_linear.c): close to torch's, each row's bits the same whatever the other
rows, their count, the row's place or the thread count (so a decode step needs no padding
rows and I4 holds), and clear about what they refuse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdmesh.services.engine import native
from pdmesh.services.engine.model import NATIVE_TILES, LlamaModel, rms_norm

pytestmark = pytest.mark.skipif(native.setting() == "off", reason="PDMESH_NATIVE_KERNELS=off")

# [out, in]: tiny's qkv, o, gate_up, down and lm_head (258 rows: the last block of 8 or
# 16 overlaps the one before), SmolLM2's qkv and down, and two small odd ones.
SHAPES = [(384, 256), (256, 256), (1536, 256), (256, 768), (258, 256), (960, 576),
          (576, 1536), (16, 16), (23, 48)]


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_it_computes_x_times_w_transposed(shape) -> None:
    weight = _weight(shape, 1)
    for m in (1, 3, 4, 7, 16):
        x = torch.randn(m, shape[1])
        torch.testing.assert_close(native.linear(x, weight), F.linear(x, weight),
                                   rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads(shape) -> None:
    """Row r of a 16-row call equals, bit for bit, the same row alone, among 1..15 others
    at any place, among rows of other values, and at another thread count."""
    weight = _weight(shape, 2)
    x = torch.randn(16, shape[1])
    full = native.linear(x, weight)
    for r in range(16):
        assert torch.equal(native.linear(x[r:r + 1].clone(), weight)[0], full[r]), r
    for first, count in ((0, 2), (1, 3), (5, 5), (3, 8), (9, 7), (0, 15)):
        assert torch.equal(native.linear(x[first:first + count].clone(), weight),
                           full[first:first + count]), (first, count)
    others = torch.randn(16, shape[1])
    others[6] = x[6]
    assert torch.equal(native.linear(others, weight)[6], full[6])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(native.linear(x, weight), full)
    finally:
        torch.set_num_threads(threads)


def test_arguments_it_cannot_serve_are_refused() -> None:
    x = torch.randn(2, 24)
    with pytest.raises(ValueError, match="multiple of 16|k \\* 16"):  # in = 24
        native.linear(x, torch.randn(16, 24))
    with pytest.raises(ValueError, match="out >= 16"):
        native.linear(torch.randn(2, 16), torch.randn(15, 16))
    with pytest.raises(ValueError, match="float64"):
        native.linear(torch.randn(2, 16, dtype=torch.float64), torch.randn(16, 16))
    with pytest.raises(ValueError, match="\\(16, 32\\)"):  # a weight viewed transposed
        native.linear(torch.randn(2, 32), torch.randn(32, 16).t())
    with pytest.raises(ValueError, match="\\(2, 16\\)"):  # in-features disagree
        native.linear(torch.randn(2, 16), torch.randn(16, 32))
    assert native.linear(torch.randn(0, 16), torch.randn(16, 16)).shape == (0, 16)
    assert not native.linear_takes((16, 24)) and not native.linear_takes((15, 16))
    assert native.linear_takes((16, 16))


def test_decode_uses_them_without_padding_and_falls_back_to_torch(tiny, monkeypatch) -> None:
    """tiny's every decode weight fits the kernel: its steps run their own rows. A model
    with a shape the kernel refuses keeps the torch plan (padding to checked tiles)."""
    model = LlamaModel(tiny.config, tiny.weights)
    assert model.native_linear() and model.decode_tiles == NATIVE_TILES
    monkeypatch.setattr(native, "linear_takes", lambda shape: shape[1] != 768)  # down's
    fallback = LlamaModel(tiny.config, tiny.weights)
    assert not fallback.native_linear()
    assert fallback.decode_tiles == fallback.decode_plan.tiles != NATIVE_TILES


@pytest.mark.parametrize("dim", [256, 576, 16])
def test_rms_norm_is_torchs_and_each_rows_own(dim) -> None:
    """The decode RMSNorm (with the residual add fused in) is close to the torch one, and a
    row's bits do not depend on the other rows."""
    weight = torch.randn(dim)
    x, delta = torch.randn(16, dim), torch.randn(16, dim)
    plain = native.rms_norm(x.clone(), weight, 1e-5)
    torch.testing.assert_close(plain, rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    summed = x.clone()
    fused = native.rms_norm(summed, weight, 1e-5, delta)
    torch.testing.assert_close(summed, x + delta, rtol=0, atol=0)  # the add, in place
    torch.testing.assert_close(fused, rms_norm(x + delta, weight, 1e-5), rtol=1e-5, atol=1e-5)
    for first, count in ((0, 1), (7, 1), (3, 5), (0, 16)):
        rows = x[first:first + count].clone()
        assert torch.equal(native.rms_norm(rows, weight, 1e-5,
                                           delta[first:first + count].clone()),
                           fused[first:first + count]), (first, count)


def test_rms_norm_refuses_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="dim = k \\* 16"):
        native.rms_norm(torch.randn(2, 24), torch.randn(24), 1e-5)
    with pytest.raises(ValueError, match="weight \\[dim\\]"):
        native.rms_norm(torch.randn(2, 32), torch.randn(16), 1e-5)
    with pytest.raises(ValueError, match="delta like x"):
        native.rms_norm(torch.randn(2, 32), torch.randn(32), 1e-5, torch.randn(3, 32))
    with pytest.raises(ValueError, match="contiguous"):
        native.rms_norm(torch.randn(32, 2).t(), torch.randn(32), 1e-5)


def test_a_model_the_one_call_step_refuses_decodes_its_matmuls_in_torch() -> None:
    """Every matmul shape suits the native kernel, but head_dim 12 is not a multiple of 8,
    which the one-call step (`native.DecodeLayers`) refuses: decode must not choose the
    native path and then fail on it."""
    import dataclasses

    from pdmesh.services.engine.tiny import TINY_CONFIG, tiny_weights

    config = dataclasses.replace(TINY_CONFIG, dim=64, n_heads=4, n_kv_heads=2, head_dim=12,
                                 ffn_dim=128, n_layers=2)
    weights = tiny_weights(config)
    assert all(native.linear_takes(tuple(t.shape)) for layer in weights.layers
               for t in (layer.wq, layer.wk, layer.wv, layer.wo, layer.w_gate, layer.w_down))
    model = LlamaModel(config, weights)
    with pytest.raises(ValueError, match="head_dim 12"):
        native.DecodeLayers(model.weights.layers, model.weights.norm, 4, 2, 12, 1e-5)
    assert not model.native_linear()
    assert model.decode_tiles != NATIVE_TILES
