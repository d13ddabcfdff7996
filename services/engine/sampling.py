"""Sampling: greedy at temperature 0, otherwise seeded per request (reproducible)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


class Sampler:
    """Per-request sampler. One instance per request: it owns that request's RNG, so the
    tokens depend only on (logits, seed, token index), never on what else is batched.

    The RNG is re-seeded from (seed, index) for every token, so a request whose first token
    was sampled on a prefill worker continues on a decode worker exactly as it would have in
    one process: decode builds its sampler and calls `skip(1)`.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator()
        self.index = 0  # how many tokens this request has sampled so far

    def skip(self, n: int) -> None:
        """Account for `n` tokens sampled elsewhere (the first token, on prefill)."""
        self.index += n

    def sample(self, logits: torch.Tensor) -> int:
        """Next token from logits [vocab]."""
        index = self.index
        self.index += 1
        logits = logits.detach().to("cpu", torch.float32)
        if self.params.temperature != 0.0:
            # Mix seed and index (splitmix-style) so nearby seeds give unrelated streams.
            self.generator.manual_seed((self.seed * 0x9E3779B97F4A7C15 + index) % (1 << 63))
        if self.params.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            keep = cumulative - sorted_probs < self.params.top_p  # always keeps the top one
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))
