"""The soak's canary workload: one request plan per index, derived only from (seed, index).

Every prompt carries its tenant's canary marker, e.g. `<<CANARY:alice:7f3a9c01b2d4#12>>`,
at its start and then repeated every `MARKER_EVERY` characters inside a seeded filler, so
any reply that carries another tenant's marker (its 12 hex digits) is evidence of a
cross-tenant leak. Prompts are printable ASCII: one token per character for the `tiny`
model's byte-level tokenizer, which is what lengths are measured in.

Each index gets one kind: `normal`, `over_capacity` (prompt longer than the served context:
must get HTTP 400 `context_length_exceeded`), `abort` (the client disconnects after a chunk
or two), or `fault` (the request carries `X-Pdmesh-Fault: <name>`). A `bypass_admission`
fault always comes with an over-capacity prompt: it skips admission's length check, so the
workers' own gates must still refuse it. A share of valid prompts repeats an earlier prompt
of the same tenant (prefix-cache hits; the oracle's cache answers those).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pdmesh.loadtest.workload import random_text

MARKER_EVERY = 160  # characters of filler between two copies of the marker
CHAT_TEMPLATE_OVERHEAD = 64  # generous upper bound of the chat template's added characters
Kind = Literal["normal", "over_capacity", "abort", "fault"]
# Faults of services/faults.py that end quickly (no deadline waited out); the default list.
DEFAULT_FAULTS = ("corrupt_payload", "corrupt_header", "drop_frame", "duplicate_frame",
                  "reorder_frames", "commit_first", "truncate", "reset", "stale_epoch",
                  "foreign_reservation", "stub_transfer", "prefill_reject", "bypass_admission")
OVER_CAPACITY_FAULTS = frozenset({"bypass_admission"})

_STREAM_KIND, _STREAM_LEN, _STREAM_BODY, _STREAM_REPEAT, _STREAM_MISC = 21, 22, 23, 24, 25


@dataclass(frozen=True)
class Tenant:
    index: int
    name: str
    api_key: str
    marker_id: str  # 12 hex digits, unique per (seed, tenant)

    def marker(self, prompt_index: int) -> str:
        return f"<<CANARY:{self.name}:{self.marker_id}#{prompt_index}>>"


DEV_KEY_PREFIX = "sk-dev-"  # the bundled dev tenants' keys: `sk-dev-<name>`


def tenant_name(api_key: str, index: int) -> str:
    """`sk-dev-alice` (a development key, whose name is public) -> `alice`; any other key
    -> `t<index>`, so that no part of a key is written where its tenant is named (results,
    canary markers)."""
    tail = api_key.removeprefix(DEV_KEY_PREFIX)
    if (api_key.startswith(DEV_KEY_PREFIX) and tail.isascii() and tail.isalpha()
            and tail.islower() and len(tail) <= 24):
        return tail
    return f"t{index}"


def make_tenants(api_keys: list[str], seed: int) -> list[Tenant]:
    if not api_keys:
        raise ValueError("at least one API key is needed")
    tenants = []
    names: set[str] = set()
    for i, key in enumerate(api_keys):
        name = tenant_name(key, i)
        if name in names:
            name = f"{name}{i}"
        names.add(name)
        digest = hashlib.sha256(f"pdmesh-soak:{seed}:{i}:{name}".encode()).hexdigest()
        tenants.append(Tenant(i, name, key, digest[:12]))
    if len({t.marker_id for t in tenants}) != len(tenants):
        raise ValueError("marker ids collide; pick another seed")
    return tenants


@dataclass(frozen=True)
class SoakWorkload:
    """Everything that decides the plans of a run (same values -> same prompts)."""

    tenants: tuple[Tenant, ...]
    context_length: int  # served context (GET /v1/models max_model_len)
    seed: int = 0
    min_len: int = 64
    max_len: int = 1024
    min_tokens: int = 8
    max_tokens: int = 24
    over_capacity_fraction: float = 0.1
    abort_fraction: float = 0.1
    fault_fraction: float = 0.15
    faults: tuple[str, ...] = DEFAULT_FAULTS
    repeat_fraction: float = 0.2
    chat_fraction: float = 0.25
    non_stream_fraction: float = 0.2

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("at least one tenant is needed")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("need 1 <= min_len <= max_len")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError("need 1 <= min_tokens <= max_tokens")
        fractions = ("over_capacity_fraction", "abort_fraction", "fault_fraction",
                     "repeat_fraction", "chat_fraction", "non_stream_fraction")
        for name in fractions:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be within [0, 1]")
        if self.over_capacity_fraction + self.abort_fraction + self.fault_fraction > 1.0:
            raise ValueError("over-capacity + abort + fault fractions must not exceed 1")
        if self.fault_fraction > 0 and not self.faults:
            raise ValueError("fault_fraction > 0 needs at least one fault name")
        room = self.context_length - self.max_tokens - 1 - CHAT_TEMPLATE_OVERHEAD
        if room < self.min_len:
            raise ValueError(f"served context {self.context_length} leaves no room for a "
                             f"{self.min_len}-token prompt + {self.max_tokens} tokens")


@dataclass(frozen=True)
class RequestPlan:
    index: int
    tenant: Tenant
    kind: Kind
    prompt: str
    prompt_index: int  # the index whose prompt this is (== index unless repeated)
    max_tokens: int
    endpoint: str = "completions"  # or "chat"
    stream: bool = True
    fault: str = ""
    abort_after_chunks: int = 0  # abort: disconnect after this many text chunks
    over_capacity: bool = False  # the prompt is longer than the served context

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def needs_oracle(self) -> bool:
        return not self.over_capacity


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, *stream])


def canary_prompt(tenant: Tenant, prompt_index: int, num_chars: int, seed: int) -> str:
    """The tenant's marker, then seeded filler with the marker repeated every MARKER_EVERY
    characters; exactly `num_chars` characters long."""
    mark = tenant.marker(prompt_index)
    filler = random_text(_rng(seed, _STREAM_BODY, prompt_index), num_chars)
    parts: list[str] = []
    size = 0
    pos = 0
    while size < num_chars:
        parts.append(mark + " ")
        take = MARKER_EVERY
        parts.append(filler[pos:pos + take] + " ")
        pos += take
        size += len(mark) + take + 2
    prompt = "".join(parts)[:num_chars]
    assert len(prompt) == num_chars
    return prompt


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    if lo == hi:
        return lo
    return int(min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


def _valid_length(wl: SoakWorkload, prompt_index: int) -> tuple[int, int]:
    """(prompt characters, max_tokens) of the valid prompt number `prompt_index`."""
    rng = _rng(wl.seed, _STREAM_LEN, prompt_index)
    max_tokens = int(rng.integers(wl.min_tokens, wl.max_tokens + 1))
    length = _log_uniform(rng, wl.min_len, wl.max_len)
    # Leave room for the chat template, so one prompt fits both endpoints.
    limit = wl.context_length - max_tokens - 1 - CHAT_TEMPLATE_OVERHEAD
    return max(1, min(length, limit)), max_tokens


def plan_request(wl: SoakWorkload, index: int) -> RequestPlan:
    """The request number `index` (tenants round-robin)."""
    tenant = wl.tenants[index % len(wl.tenants)]
    rng = _rng(wl.seed, _STREAM_KIND, index)
    u = rng.random()
    kind: Kind
    if u < wl.over_capacity_fraction:
        kind = "over_capacity"
    elif u < wl.over_capacity_fraction + wl.abort_fraction:
        kind = "abort"
    elif u < wl.over_capacity_fraction + wl.abort_fraction + wl.fault_fraction:
        kind = "fault"
    else:
        kind = "normal"
    fault = str(wl.faults[int(rng.integers(0, len(wl.faults)))]) if kind == "fault" else ""
    misc = _rng(wl.seed, _STREAM_MISC, index)
    endpoint = "chat" if misc.random() < wl.chat_fraction else "completions"
    stream = kind == "abort" or misc.random() >= wl.non_stream_fraction
    abort_after = int(misc.integers(1, 3)) if kind == "abort" else 0
    over = kind == "over_capacity" or fault in OVER_CAPACITY_FAULTS
    if over:
        ctx = wl.context_length
        num_chars = int(misc.integers(ctx + 1, ctx + max(1, ctx // 4) + 1))
        max_tokens = int(misc.integers(wl.min_tokens, wl.max_tokens + 1))
        prompt = canary_prompt(tenant, index, num_chars, wl.seed)
        return RequestPlan(index, tenant, kind, prompt, index, max_tokens, endpoint, stream,
                           fault, abort_after, over_capacity=True)
    prompt_index = index
    repeat = _rng(wl.seed, _STREAM_REPEAT, index)
    num_tenants = len(wl.tenants)
    if index >= num_tenants and repeat.random() < wl.repeat_fraction:
        back = int(repeat.integers(1, min(8, index // num_tenants) + 1))
        prompt_index = index - back * num_tenants  # an earlier prompt of the same tenant
    num_chars, max_tokens = _valid_length(wl, prompt_index)
    prompt = canary_prompt(tenant, prompt_index, num_chars, wl.seed)
    return RequestPlan(index, tenant, kind, prompt, prompt_index, max_tokens, endpoint, stream,
                       fault, abort_after)
