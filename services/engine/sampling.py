"""Sampling: greedy at temperature 0, otherwise seeded per request (reproducible).

The logits processors follow vLLM's meaning and order: `logit_bias` added first, then
repetition, frequency and presence penalties (greedy included), a structured output's
grammar mask (grammar.py), `min_tokens` masking of eos and `stop_token_ids` (unless the
grammar allows nothing else), then temperature, top-k, top-p and min-p. Logprobs are the
raw model's (before any processor), as vLLM's default `raw_logprobs`. Each step depends
only on (logits, seed, token index, tokens generated so far), so the mesh and the reference
engine agree token for token.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pdmesh.services.engine.grammar import Constraint, Grammars
from pdmesh.services.protocol import messages as m

MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI's top_logprobs bound

TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    penalty_prompt_ids: tuple[int, ...] = ()  # prompt ids the repetition penalty covers
    start_index: int = 0  # tokens of this request generated before (a resumed request)
    prior_output_ids: tuple[int, ...] = ()  # those tokens, for the penalties' counts
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), OpenAI's logit_bias

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}")
        if self.start_index < 0:
            raise ValueError("start_index must be >= 0")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias: token ids >= 0, biases in -100..100")

    @classmethod
    def from_wire(cls, s: m.Sampling, max_tokens: int) -> SamplingParams:
        """The parameters a `messages.Sampling` carries (one conversion for every worker)."""
        return cls(temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                   max_tokens=max_tokens, top_k=s.top_k, min_p=s.min_p,
                   repetition_penalty=s.repetition_penalty,
                   presence_penalty=s.presence_penalty,
                   frequency_penalty=s.frequency_penalty, min_tokens=s.min_tokens,
                   ignore_eos=s.ignore_eos, stop_token_ids=tuple(s.stop_token_ids),
                   logprobs=s.logprobs, penalty_prompt_ids=tuple(s.penalty_prompt_ids),
                   start_index=s.start_index, prior_output_ids=tuple(s.prior_output_ids),
                   logit_bias=tuple(sorted(s.logit_bias.items())))

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


class Sampler:
    """Per-request sampler. One instance per request: it owns that request's RNG and the
    tokens it has generated, so the tokens depend only on (logits, seed, token index,
    history), never on what else is batched.

    The RNG is re-seeded from (seed, index) for every token, so a request whose first token
    was sampled on a prefill worker continues on a decode worker exactly as it would have in
    one process: `sample()` records what it samples, and decode `accept()`s every token it
    emits, which records the first one (sampled on prefill) and says when to stop. For the
    same reason a request resumed on other workers from prompt + its delivered tokens
    (`start_index`, `prior_output_ids`) samples what the first workers would have.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int] = (),
                 constraint: Constraint | None = None) -> None:
        self.params = params
        # A structured output's grammar state (None: unconstrained); it follows every token
        # recorded, a resumed request's delivered ones already replayed into it.
        self.constraint = constraint
        self._allowed: Any = None  # the grammar's mask for the next token, once prepared
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator()
        self.eos = frozenset(eos_token_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        # How many tokens this request has generated so far (a resumed request counts on
        # from its first workers' tokens, which also start the penalties' counts).
        self.index = params.start_index
        self.counts: Counter[int] = Counter(params.prior_output_ids)
        self.last_logprobs: tuple[int, TokenLogprobs] | None = None
        self._just_sampled: int | None = None

    @classmethod
    def for_request(cls, sampling: m.Sampling, max_tokens: int,
                    eos_token_ids: Iterable[int] = (),
                    grammars: Grammars | None = None) -> Sampler:
        """The request's sampler; ValueError (grammar.GrammarError among them) for sampling
        it cannot follow: a structured output needs the model's `grammars`."""
        params = SamplingParams.from_wire(sampling, max_tokens)
        constraint = None
        if sampling.structured is not None:
            if grammars is None:
                raise ValueError("structured outputs are not served here")
            constraint = grammars.constraint(sampling.structured, sampling.prior_output_ids)
        return cls(params, eos_token_ids, constraint)

    def skip(self, n: int) -> None:
        """Account for `n` tokens sampled elsewhere whose ids do not matter here."""
        self.index += n

    def _record(self, token: int) -> None:
        self.index += 1
        self.counts[token] += 1
        if self.constraint is not None:
            self._allowed = None
            self.constraint.advance(token)

    def prepare(self) -> None:
        """Compute the grammar's mask for the next token now (a no-op unconstrained): the
        decode loop calls it while the engine thread runs the step, so that the mask costs
        the batch nothing."""
        if self.constraint is not None and self._allowed is None:
            self._allowed = self.constraint.allowed()

    def accept(self, token: int) -> bool:
        """Note a generated token; True when it ends the generation: eos (unless
        `ignore_eos`) or one of `stop_token_ids`. A token this sampler has just sampled is
        already recorded; any other (the first one, sampled on prefill) is recorded now."""
        if self._just_sampled == token:
            self._just_sampled = None
        else:
            self._record(token)
        return token in self.stop_ids or (token in self.eos and not self.params.ignore_eos)

    def take_logprobs(self, token: int) -> list[TokenLogprobs]:
        """The logprobs of `token` if this sampler sampled it last (else none), once."""
        last, self.last_logprobs = self.last_logprobs, None
        return [last[1]] if last is not None and last[0] == token else []

    def sample(self, logits: torch.Tensor) -> int:
        """Next token from logits [vocab], recorded (penalties, RNG index)."""
        p = self.params
        raw = logits.detach().to("cpu", torch.float32)
        logits = self._process(raw)
        if p.temperature == 0.0:
            # numpy's argmax: torch's meaning (the first maximum; a NaN counts as one) in one
            # thread; torch splits a vocabulary-long reduction over its OpenMP team, ~20x
            # slower on 2 busy cores (and this pick lies between two decode steps).
            token = int(logits.numpy().argmax())
        else:
            # Mix seed and index (splitmix-style) so nearby seeds give unrelated streams.
            self.generator.manual_seed((self.seed * 0x9E3779B97F4A7C15 + self.index)
                                       % (1 << 63))
            token = self._draw(logits)
        if p.logprobs is not None:
            self.last_logprobs = (token, self._logprobs(raw, token, p.logprobs))
        self._record(token)
        self._just_sampled = token
        return token

    def _process(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.logit_bias:
            vocab = logits.shape[-1]
            ids = [t for t, _ in p.logit_bias if t < vocab]
            if ids:
                logits = logits.clone()
                logits[torch.tensor(ids, dtype=torch.long)] += torch.tensor(
                    [b for t, b in p.logit_bias if t < vocab], dtype=logits.dtype)
        if p.penalized and (self.counts or p.penalty_prompt_ids):
            logits = logits.clone()
            if p.repetition_penalty != 1.0:
                vocab = logits.shape[-1]
                seen = torch.tensor(sorted(t for t in set(p.penalty_prompt_ids) | set(
                    self.counts) if 0 <= t < vocab), dtype=torch.long)
                vals = logits[seen]
                logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                           vals * p.repetition_penalty)
            if self.counts and (p.frequency_penalty or p.presence_penalty):
                ids = torch.tensor(list(self.counts), dtype=torch.long)
                freq = torch.tensor(list(self.counts.values()), dtype=torch.float32)
                logits[ids] -= p.frequency_penalty * freq + p.presence_penalty
        if self.constraint is not None:
            logits = self.constrain(logits)
        if self.index < p.min_tokens:
            banned = (set() if p.ignore_eos else set(self.eos)) | set(self.stop_ids)
            banned = {t for t in banned if 0 <= t < logits.shape[-1]}
            if banned:
                held = logits.clone()
                held[torch.tensor(sorted(banned), dtype=torch.long)] = -math.inf
                if self.constraint is None or bool(torch.isfinite(held).any()):
                    logits = held  # (a complete structured output may only end)
        return logits

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with every token the grammar does not allow now at -inf."""
        assert self.constraint is not None
        prepared, self._allowed = self._allowed, None
        allowed = torch.from_numpy(prepared if prepared is not None
                                   else self.constraint.allowed())
        vocab = logits.shape[-1]
        if allowed.shape[0] < vocab:  # logits over padding rows: never allowed
            allowed = torch.cat([allowed, torch.zeros(vocab - allowed.shape[0],
                                                      dtype=torch.bool)])
        return logits.masked_fill(~allowed[:vocab], -math.inf)

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        probs = torch.softmax(logits / p.temperature, dim=-1)
        if p.top_k <= 0 and p.min_p == 0.0 and p.top_p >= 1.0:
            return int(torch.multinomial(probs, 1, generator=self.generator))
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if p.top_k > 0:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            keep &= cumulative - sorted_probs < p.top_p  # always keeps the top one
        if p.min_p > 0.0:
            keep &= sorted_probs >= p.min_p * sorted_probs[0]
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs, 1, generator=self.generator)
        return int(order[choice])

    @staticmethod
    def _logprobs(raw: torch.Tensor, token: int, k: int) -> TokenLogprobs:
        logp = torch.log_softmax(raw, dim=-1)
        top: list[tuple[int, float]] = []
        if k > 0:
            values, ids = torch.topk(logp, k)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return float(logp[token]), top
