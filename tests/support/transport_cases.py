"""Helpers of the transport conformance suite: which transports this install has, pages, a
transfer case, and the check that a failed transfer left each page untouched or poisoned."""

from __future__ import annotations

import asyncio
import importlib.util
import uuid

import numpy as np

from pdmesh.transports import POISON_BYTE, ExpectedTransfer, TransferError, TransferPlan
from pdmesh.transports._nixl_build import INSTALL_HINT, NIXL_MODULES, nixl_module
from pdmesh.transports.framing import transfer_key

SECRET = "conformance-mesh-secret"
HAVE_UCX = (importlib.util.find_spec("ucxx") is not None
            or importlib.util.find_spec("ucp") is not None)
HAVE_NIXL = nixl_module() is not None
NO_NIXL = f"none of {', '.join(NIXL_MODULES)} is importable ({INSTALL_HINT})"
PROGRESS_S = 0.5  # the suite's progress timeout: a stalled peer fails within it


class Pages:
    """A little pool: `num_pages` pages of `page_bytes` random bytes."""

    def __init__(self, num_pages: int, page_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.array = rng.integers(0, 256, (num_pages, page_bytes), dtype=np.uint8)
        self.page_bytes = page_bytes

    def views(self) -> list[memoryview]:
        return [memoryview(self.array[i]) for i in range(len(self.array))]

    def snapshot(self) -> np.ndarray:
        return self.array.copy()


def make_case(num_tokens=100, page_tokens=16, page_bytes=64 << 10, num_pages=None,
              epoch=3, deadline_s=10.0, seed=0):
    """Source pages, destination pages, and the matching expectation and plan."""
    n = num_pages or -(-num_tokens // page_tokens) + 2  # a lease bigger than the prompt
    src = Pages(n, page_bytes, seed)
    dst = Pages(n, page_bytes, seed + 1)
    page_ids = tuple(range(100, 100 + n))
    rid = uuid.uuid4().hex
    key = transfer_key(SECRET, rid, epoch)
    target = ExpectedTransfer(rid, epoch, page_ids, dst.views(), page_bytes, page_tokens,
                              num_tokens, deadline_s, key=key)
    plan = TransferPlan(rid, epoch, page_ids, num_tokens, page_tokens, page_bytes,
                        first_token=7, deadline_s=deadline_s, key=key)
    return src, dst, target, plan


def assert_untouched_or_poisoned(dst, snapshot, err: TransferError, page_ids) -> None:
    poisoned = set(err.pages_poisoned)
    for index, page_id in enumerate(page_ids):
        if page_id in poisoned:
            assert (dst.array[index] == POISON_BYTE).all(), f"page {page_id} not poisoned"
        else:
            assert (dst.array[index] == snapshot[index]).all(), f"page {page_id} touched"


async def wait_until(predicate, seconds: float = 3.0) -> None:
    """Poll `predicate` every 10 ms until it holds; AssertionError after `seconds`."""
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")
