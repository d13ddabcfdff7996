"""No foreign byte leaves a prefill worker: the unwritten tail of a prompt's last page is
zeroed before the page is sent (with the default scrub policy `none` freed pages keep the
previous tenant's KV)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdmesh.kvstore import KVPool, PoolSpec, ScrubPolicy
from pdmesh.services.prefill.service import outgoing_pages


def test_the_last_page_tail_carries_no_earlier_tenants_kv() -> None:
    spec = PoolSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=4, num_pages=4)
    pool = KVPool(spec, scrub=ScrubPolicy.NONE)
    a = pool.allocate("tenant-a", 8)  # two full pages of A's KV
    for i in range(a.num_pages):
        pool.page_tensor(a, i).fill_(7.0)
    pool.mark_written_range(a, 0, 8)
    pool.release(a, "stop")
    b = pool.allocate("tenant-b", 6)  # LIFO: the same pages, A's bytes still in them
    assert set(b.page_ids) == set(a.page_ids)
    pool.page_tensor(b, 0).fill_(2.0)
    pool.page_tensor(b, 1)[:, :, :2].fill_(2.0)
    pool.mark_written_range(b, 0, 6)
    assert float(pool.page_tensor(b, 1)[:, :, 2:].abs().sum()) > 0  # A's tail is there

    pages = outgoing_pages(pool, b, 6)

    assert len(pages) == 2 and all(p.readonly for p in pages)
    last = torch.from_numpy(np.frombuffer(pages[1], dtype=np.float32).copy()).view(
        spec.num_layers, 2, spec.page_tokens, spec.num_kv_heads, spec.head_dim)
    assert torch.all(last[:, :, :2] == 2.0)  # B's own tokens are sent as they are
    assert torch.all(last[:, :, 2:] == 0.0)  # the tail: zeros, not tenant A's 7.0
    first = np.frombuffer(pages[0], dtype=np.float32)
    assert np.all(first == 2.0)
    pool.release(b, "stop")
    pool.check_integrity()


def test_a_page_aligned_prompt_sends_its_pages_untouched() -> None:
    spec = PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=4, num_pages=2)
    pool = KVPool(spec, scrub=ScrubPolicy.NONE)
    b = pool.allocate("b", 8)
    for i in range(2):
        pool.page_tensor(b, i).fill_(3.0)
    pool.mark_written_range(b, 0, 8)
    pages = outgoing_pages(pool, b, 8)
    assert all(np.all(np.frombuffer(p, dtype=np.float32) == 3.0) for p in pages)
    pool.release(b, "stop")


def test_a_streamed_send_gets_no_page_before_the_pool_says_it_is_written() -> None:
    # Streamed KV: the send holds views of every page from its start; prefill
    # lets it read a page only after the pool's read check for that page's tokens (I2).
    from pdmesh.kvstore import LeaseAccessError
    from pdmesh.services.prefill.service import release_pages
    from pdmesh.transports import PagesReady

    spec = PoolSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_tokens=4, num_pages=4)
    pool = KVPool(spec, scrub=ScrubPolicy.NONE)
    lease = pool.allocate("b", 14)
    views = outgoing_pages(pool, lease, 14)  # before any token is written
    assert len(views) == 4 and all(v.readonly for v in views)
    pages = PagesReady(len(views))
    with pytest.raises(LeaseAccessError):
        release_pages(pool, lease, pages, 8)  # nothing written yet
    assert pages.ready == 0
    pool.mark_written_range(lease, 0, 9)
    release_pages(pool, lease, pages, 9)
    assert pages.ready == 2  # whole pages only: the third is still being written
    with pytest.raises(LeaseAccessError):
        release_pages(pool, lease, pages, 14, first_token=7)
    assert pages.ready == 2 and pages.first_token is None
    pool.mark_written_range(lease, 9, 5)
    release_pages(pool, lease, pages, 14, first_token=7)
    assert pages.ready == 4 and pages.first_token == 7
    pool.release(lease, "stop")
    pool.check_integrity()
