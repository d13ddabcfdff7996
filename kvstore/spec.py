"""The shape of a KV pool, fixed at start-up, and `pages_for`, the one page-count rule.

This module imports without torch: torch-free processes (admission, the gateway) and the
control-plane modules share `pages_for` with the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pages_for(num_tokens: int, page_tokens: int) -> int:
    """Number of `page_tokens`-token pages needed to hold `num_tokens` tokens (ceiling)."""
    return -(-num_tokens // page_tokens)


def _float32() -> torch.dtype:
    # Imported on first use, not at module import: see the module docstring.
    import torch

    return torch.float32


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one worker's KV pool.

    A page holds `page_tokens` tokens of K and V for every layer; pages are the unit of
    allocation and of transfer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    num_pages: int
    dtype: torch.dtype = field(default_factory=_float32)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PoolSpec.{name} must be a positive int, got {value!r}")

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page: [num_layers, 2 (K/V), page_tokens, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return (self.num_pages, *self.page_shape)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_tokens

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_tokens

    def pages_for(self, num_tokens: int) -> int:
        """Number of pages needed to hold `num_tokens` tokens."""
        return pages_for(num_tokens, self.page_tokens)
