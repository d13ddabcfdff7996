"""Prefill one window at a time equals one prefill of the whole prompt, bit for bit.

The prefill service calls `Engine.prefill(lease, piece, start_position)` once per
`prefill_windows` window (chunk-level fairness, KV streamed as each window lands), so a
prompt prefilled window by window must leave the same KV bytes in its pages and return the
same last logits as one call over the whole prompt, and as the reference engine.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh.kvstore.spec import pages_for
from pdmesh.services.engine.model import PREFILL_CHUNK, prefill_windows
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.runner import Engine, PagedKV, make_pool
from tests.support.engine import prompt


def _kv_bytes(pool, lease, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V of positions 0..length, read back through the pages."""
    kv = PagedKV(pool, lease)
    return [tuple(t.clone() for t in kv.read(layer, length))
            for layer in range(pool.spec.num_layers)]


@pytest.mark.parametrize("length", [PREFILL_CHUNK, 2 * PREFILL_CHUNK + 277])
def test_window_by_window_prefill_equals_one_call(tiny, length) -> None:
    tokens = prompt(7, length)
    pool = make_pool(tiny, num_pages=2 * pages_for(length, 16) + 2, page_tokens=16)
    engine = Engine(tiny, pool)
    whole = pool.allocate("whole", length)
    whole_logits = engine.prefill(whole, tokens)

    pieces = pool.allocate("pieces", length)
    windows = prefill_windows(0, length)
    assert len(windows) == -(-length // PREFILL_CHUNK)
    for start, count in windows:
        piece_logits = engine.prefill(pieces, tokens[start:start + count], start)
    assert torch.equal(piece_logits, whole_logits)
    for (wk, wv), (pk, pv) in zip(_kv_bytes(pool, whole, length), _kv_bytes(pool, pieces, length),
                                  strict=True):
        assert torch.equal(wk, pk) and torch.equal(wv, pv)

    reference = ReferenceEngine(tiny)
    cache = reference.new_cache(length)
    assert torch.equal(reference.prefill(cache, tokens), whole_logits)
    for layer, (wk, wv) in enumerate(_kv_bytes(pool, whole, length)):
        keys, values = cache.read(layer, length)
        assert torch.equal(keys, wk) and torch.equal(values, wv)
    pool.release(whole, "done")
    pool.release(pieces, "done")
