"""The shape of a KV pool, fixed at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolSpec:
    """Geometry of one worker's KV pool.

    A page holds `page_size` tokens of K and V for every layer; pages are the unit of
    allocation and of transfer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"PoolSpec.{name} must be a positive int, got {value!r}")

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Shape of one page: [num_layers, 2 (K/V), page_size, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        return (self.num_pages, *self.page_shape)

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Number of pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)
