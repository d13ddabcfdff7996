"""Workload generation: prompts of known token counts, lengths, tenants, over-long share.

Prompts are first built as N printable ASCII characters for N tokens (exact for the pdmesh
`tiny` model's byte-level tokenizer), then `loadtest/tokens.py` counts them with the served
model's tokenizer and resizes them (`resize`) until the counts are right. Every prompt text
derives only from the seed, the request index and its length (and the shared prefix from
the seed alone), so two runs with the same seed send byte-identical prompts; that is what
makes mesh-vs-colocated comparisons and integrity checks meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

# The 95 printable ASCII characters: one byte, one token each for a byte-level tokenizer.
PRINTABLE = np.frombuffer(bytes(range(0x20, 0x7F)), dtype=np.uint8)
LENGTH_DISTS = ("fixed", "uniform", "normal")

# Random streams, so that changing one parameter does not reshuffle unrelated choices.
_STREAM_INPUT_LENS = 1
_STREAM_OUTPUT_LENS = 2
_STREAM_OVER = 3
_STREAM_PREFIX_CHOICE = 4
_STREAM_PREFIX_TEXT = 5
_STREAM_PROMPT = 6
_STREAM_WARMUP = 7


@dataclass(frozen=True)
class LengthDist:
    """A length distribution in tokens: `fixed` (= mean), `uniform` [min, max] or `normal`
    (mean, std) clipped to [min, max]."""

    kind: str = "fixed"
    mean: int = 128
    min: int = 1
    max: int = 1 << 30
    std: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_DISTS:
            raise ValueError(f"length distribution must be one of {LENGTH_DISTS}: {self.kind!r}")
        if self.mean < 1 or self.min < 1 or self.min > self.max or self.std < 0:
            raise ValueError(f"invalid length distribution {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.mean, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.min, self.max + 1, size=n, dtype=np.int64)
        values = np.rint(rng.normal(self.mean, self.std, size=n))
        return np.clip(values, self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that decides the requests of one run (same spec + seed -> same prompts)."""

    num_requests: int
    input_len: LengthDist
    output_len: LengthDist
    seed: int = 0
    num_tenants: int = 1
    shared_prefix_len: int = 0
    shared_prefix_share: float = 0.0
    over_capacity_fraction: float = 0.0
    context_length: int | None = None
    # Tokens the server may add (BOS); valid prompts keep prompt + max_tokens + this <= context.
    bos_allowance: int = 1

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.num_tenants < 1 or self.shared_prefix_len < 0:
            raise ValueError(f"invalid workload {self}")
        for name in ("shared_prefix_share", "over_capacity_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.over_capacity_fraction > 0 and not self.context_length:
            raise ValueError("over_capacity_fraction > 0 needs the target's context_length")


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `prompt_len` is its prompt's token count: as counted by the
    served model's tokenizer (`num_tokens`), else one token per byte."""

    index: int
    tenant: int
    prompt: str
    max_tokens: int
    expect_reject: bool = False
    warmup: bool = False
    num_tokens: int | None = None  # counted with the target's tokenizer
    shared: bool = False  # starts with the workload's shared prefix
    seed: int = 0  # the workload's seed (resize rebuilds the same text)
    fixed_text: bool = False  # a dataset prompt: counted, never resized

    @property
    def prompt_len(self) -> int:
        return self.num_tokens if self.num_tokens is not None else len(self.prompt)


def resize(req: RequestSpec, num_chars: int, prefix: str) -> RequestSpec:
    """The same request with its prompt rebuilt at `num_chars` characters (uncounted)."""
    prompt = build_prompt(max(1, num_chars), req.tenant, req.index, req.seed,
                          prefix if req.shared else "", req.warmup)
    return replace(req, prompt=prompt, num_tokens=None)


def shared_prefix(spec: WorkloadSpec) -> str:
    return random_text(_rng(spec.seed, _STREAM_PREFIX_TEXT), spec.shared_prefix_len)


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


def random_text(rng: np.random.Generator, num_chars: int) -> str:
    return PRINTABLE[rng.integers(0, len(PRINTABLE), size=num_chars)].tobytes().decode("ascii")


def marker(tenant: int, index: int, seed: int, warmup: bool = False) -> str:
    """A unique, recognisable marker per tenant/request (the canary in the prompt)."""
    kind = "w" if warmup else "r"
    return f"<<pdmesh t{tenant:02d} {kind}{index:06d} s{seed}>> "


def build_prompt(num_chars: int, tenant: int, index: int, seed: int, prefix: str = "",
                 warmup: bool = False) -> str:
    """`prefix` (shared) + marker + seeded body, exactly `num_chars` characters long."""
    mark = marker(tenant, index, seed, warmup)
    prefix = prefix[: max(0, min(len(prefix), num_chars - len(mark)))]
    head = (prefix + mark)[:num_chars]
    stream = _STREAM_WARMUP if warmup else _STREAM_PROMPT
    body = random_text(_rng(seed, stream, index), num_chars - len(head))
    prompt = head + body
    assert len(prompt) == num_chars
    return prompt


def max_valid_input_len(spec: WorkloadSpec, max_tokens: int) -> int | None:
    if spec.context_length is None:
        return None
    return spec.context_length - max_tokens - spec.bos_allowance


def build_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    """The measured requests, in issue order; tenants assigned round-robin."""
    n = spec.num_requests
    input_lens = spec.input_len.sample(_rng(spec.seed, _STREAM_INPUT_LENS), n)
    output_lens = spec.output_len.sample(_rng(spec.seed, _STREAM_OUTPUT_LENS), n)
    over_rng = _rng(spec.seed, _STREAM_OVER)
    num_over = round(spec.over_capacity_fraction * n)
    over = set(over_rng.choice(n, size=num_over, replace=False).tolist()) if num_over else set()
    num_shared = round(spec.shared_prefix_share * n) if spec.shared_prefix_len else 0
    shared = set(
        _rng(spec.seed, _STREAM_PREFIX_CHOICE).choice(n, size=num_shared, replace=False).tolist()
    )
    prefix = shared_prefix(spec)
    requests = []
    for i in range(n):
        max_tokens = int(output_lens[i])
        if i in over:
            ctx = spec.context_length
            assert ctx is not None
            # Strictly above the context even before any BOS: must be rejected with 400.
            prompt_len = int(over_rng.integers(ctx + 1, ctx + max(1, ctx // 4) + 1))
        else:
            prompt_len = int(input_lens[i])
            limit = max_valid_input_len(spec, max_tokens)
            if limit is not None:
                if limit < 1:
                    raise ValueError(
                        f"output length {max_tokens} leaves no room for a prompt within "
                        f"context {spec.context_length}"
                    )
                prompt_len = min(prompt_len, limit)
        tenant = i % spec.num_tenants
        prompt = build_prompt(prompt_len, tenant, i, spec.seed, prefix if i in shared else "")
        requests.append(RequestSpec(i, tenant, prompt, max_tokens, expect_reject=i in over,
                                    shared=i in shared, seed=spec.seed))
    return requests


def build_warmup_requests(spec: WorkloadSpec, num_warmup: int) -> list[RequestSpec]:
    """Valid-only requests like the measured ones but with their own markers and texts."""
    rng = _rng(spec.seed, _STREAM_WARMUP)
    input_lens = spec.input_len.sample(rng, num_warmup)
    output_lens = spec.output_len.sample(rng, num_warmup)
    requests = []
    for i in range(num_warmup):
        max_tokens = int(output_lens[i])
        prompt_len = int(input_lens[i])
        limit = max_valid_input_len(spec, max_tokens)
        if limit is not None:
            prompt_len = max(1, min(prompt_len, limit))
        tenant = i % spec.num_tenants
        prompt = build_prompt(prompt_len, tenant, i, spec.seed, warmup=True)
        requests.append(RequestSpec(i, tenant, prompt, max_tokens, warmup=True,
                                    seed=spec.seed))
    return requests
