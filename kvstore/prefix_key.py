"""The prefix-cache key: a tenant's cache salt chained with whole pages of token ids.

Shared by the prefill worker's cache (which matches on the token ids themselves, one tree
per salt) and by admission (which only compares these hashes with worker heartbeats to
route a request to the worker holding its longest cached prefix). A hash collision can
therefore at worst misroute a request; it can never make a cache hit, and the salt is the
first link of every chain, so two tenants' chains never meet (invariant I7).

Pure Python on purpose: admission imports this without torch or numpy.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence

_PERSON = b"pdmesh-prefix"
_MASK63 = (1 << 63) - 1  # msgpack-friendly non-negative int64


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(),
                          "little") & _MASK63


def root_hash(cache_salt: str) -> int:
    """The first link of every chain of this salt."""
    return _digest(b"salt:" + cache_salt.encode())


def page_hash(parent_hash: int, page_token_ids: Sequence[int]) -> int:
    """Chain link: the parent's hash followed by one whole page of token ids."""
    tokens = array("q", page_token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    return _digest(parent_hash.to_bytes(8, "little") + tokens.tobytes())


def aligned_prefix_hashes(cache_salt: str, token_ids: Sequence[int], page_tokens: int,
                          align_tokens: int, max_tokens: int) -> Iterator[int]:
    """Yields the key of the first k * align_tokens tokens for k = 1, 2, ... while that
    prefix is no longer than `max_tokens` (and the prompt). Lazy: a caller that stops at
    the first miss pays only for the prefix it matched."""
    if page_tokens <= 0 or align_tokens <= 0 or align_tokens % page_tokens:
        return
    limit = min(max_tokens, len(token_ids)) // align_tokens * align_tokens
    h = root_hash(cache_salt)
    for start in range(0, limit, page_tokens):
        h = page_hash(h, token_ids[start:start + page_tokens])
        if (start + page_tokens) % align_tokens == 0:
            yield h
