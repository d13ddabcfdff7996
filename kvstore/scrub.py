"""What happens to a page's bytes when it goes back to the pool.

NONE is the default (speed; isolation then rests on the lease checks alone), ZERO wipes the
page, POISON fills it with a recognizable value so that any read of freed memory is obvious
in tests and debugging (attention over -12345.0 keys produces garbage at once).
"""

from __future__ import annotations

import enum

import torch

POISON_VALUE = -12345.0


class ScrubPolicy(enum.Enum):
    NONE = "none"
    ZERO = "zero"
    POISON = "poison"

    @classmethod
    def parse(cls, value: str | ScrubPolicy) -> ScrubPolicy:
        if isinstance(value, ScrubPolicy):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown scrub policy {value!r} (expected one of {names})") from None


def scrub_pages(tensor: torch.Tensor, page_index: torch.Tensor, policy: ScrubPolicy) -> None:
    """Apply `policy` to the pages `page_index` (1-D long tensor) of the pool `tensor`."""
    if policy is ScrubPolicy.NONE or page_index.numel() == 0:
        return
    fill = 0.0 if policy is ScrubPolicy.ZERO else POISON_VALUE
    tensor.index_fill_(0, page_index, fill)
