"""The output oracle (invariant I4): what the single-process reference engine says.

With greedy decoding a prompt has exactly one right output: what the reference engine (no
pool, no pages, no transfer) generates for it, token for token. This is the one oracle:
the tests use it (through `tests/support/oracle.py`), `pdmesh soak` checks every served reply with
it (`Oracle`: in a worker thread, cached per prompt), and the soak's test double answers
with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdmesh.services.engine.grammar import Grammars
from pdmesh.services.engine.models import LoadedModel, load_model
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.sampling import Sampler, SamplingParams, TokenLogprobs
from pdmesh.services.protocol import messages as m


@dataclass(frozen=True)
class Expected:
    """The oracle's answer for one prompt."""

    text: str
    finish_reason: str  # "stop" (eos) or "length"
    num_tokens: int  # generated tokens, eos included


class ReferenceOracle:
    """Greedy answers of the reference engine for one model."""

    def __init__(self, model: str = "tiny") -> None:
        self.loaded: LoadedModel = load_model(model)
        self.tokenizer = self.loaded.tokenizer
        self.engine = ReferenceEngine(self.loaded)
        self.max_context = self.loaded.config.max_context
        self.grammars = Grammars(self.tokenizer, self.loaded.config.vocab_size)

    def prompt_ids(self, prompt: str, endpoint: str = "completions") -> list[int]:
        """The ids the gateway feeds the model for `prompt` sent to that endpoint."""
        if endpoint == "chat":
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def ids(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Greedy tokens generated (eos included when it stops early)."""
        return self.engine.generate(list(prompt_ids),
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens))

    def run(self, prompt_ids: Sequence[int], max_tokens: int, sampling: m.Sampling
            ) -> tuple[list[int], list[TokenLogprobs]]:
        """Tokens (and, with `sampling.logprobs`, their logprobs) the mesh must produce for
        any wire `Sampling` (penalties, min_tokens, ignore_eos, stop_token_ids, seeds):
        the same sampler and stop rule as prefill + decode, on the reference engine."""
        prompt = list(prompt_ids)
        total = len(prompt) + max_tokens
        if total > self.max_context:
            raise ValueError(f"prompt + max_tokens = {total} > max_context {self.max_context}")
        sampler = Sampler.for_request(sampling, max_tokens, self.tokenizer.eos_token_ids,
                                      self.grammars)
        engine = self.engine
        cache = engine.new_cache(total)
        logits = engine.prefill(cache, prompt)
        out: list[int] = []
        logprobs: list[TokenLogprobs] = []
        while True:
            token = sampler.sample(logits)
            out.append(token)
            logprobs.extend(sampler.take_logprobs(token))
            if sampler.accept(token) or len(out) >= max_tokens:
                return out, logprobs
            logits = engine.decode([cache], [token], [len(prompt) + len(out) - 1])[0]

    def prompt_logprobs(self, prompt_ids: Sequence[int], k: int
                        ) -> list[TokenLogprobs]:
        """Each prompt token's logprob after the first (and the top `k`): what the mesh
        reports for an echo with logprobs."""
        return self.engine.prompt_logprobs(list(prompt_ids), k)

    def answer(self, prompt_ids: Sequence[int], max_tokens: int,
               sampling: m.Sampling | None = None) -> Expected:
        """The reply for these ids: greedy by default, else exactly as `sampling` says."""
        ids = (self.ids(prompt_ids, max_tokens) if sampling is None
               else self.run(prompt_ids, max_tokens, sampling)[0])
        eos = self.tokenizer.eos_token_ids
        stops = eos if sampling is None else (
            set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos)))
        stopped = bool(ids) and ids[-1] in stops
        return Expected(self.tokenizer.decode([t for t in ids if t not in eos]),
                        "stop" if stopped else "length", len(ids))

    def expected(self, prompt: str, max_tokens: int, endpoint: str = "completions"
                 ) -> Expected:
        return self.answer(self.prompt_ids(prompt, endpoint), max_tokens)


_references: dict[str, ReferenceOracle] = {}
_references_lock = threading.Lock()


def reference(model: str = "tiny") -> ReferenceOracle:
    """The process's one `ReferenceOracle` of `model` (loaded on first use)."""
    with _references_lock:
        if model not in _references:
            _references[model] = ReferenceOracle(model)
        return _references[model]


class Oracle:
    """Reference answers computed in one worker thread and cached per prompt, so that an
    event loop can wait for them while the server under test answers.

    `threads` sets torch's intra-op threads for this process (1 leaves the other cores to
    the mesh under test; more threads on a loaded 2-core machine are slower, not faster)."""

    def __init__(self, model: str = "tiny", threads: int = 1, max_cached: int = 50_000) -> None:
        if threads > 0:
            torch.set_num_threads(threads)
        self.reference = reference(model)
        self.max_context = self.reference.max_context
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="soak-oracle")
        self._cache: dict[tuple[str, str, int], concurrent.futures.Future[Expected]] = {}
        self._lock = threading.Lock()
        self._max_cached = max_cached
        self.computed = 0
        self.cache_hits = 0

    def _compute(self, prompt: str, max_tokens: int, endpoint: str) -> Expected:
        expected = self.reference.expected(prompt, max_tokens, endpoint)
        self.computed += 1
        return expected

    def submit(self, prompt: str, max_tokens: int, endpoint: str = "completions"
               ) -> concurrent.futures.Future[Expected]:
        key = (endpoint, prompt, max_tokens)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self.cache_hits += 1
                return fut
            fut = self._pool.submit(self._compute, prompt, max_tokens, endpoint)
            if len(self._cache) < self._max_cached:
                self._cache[key] = fut
            return fut

    @staticmethod
    async def wait(fut: concurrent.futures.Future[Expected], timeout_s: float
                   ) -> Expected | None:
        """The answer of a `submit`, or None when the oracle failed or took too long."""
        if fut.cancelled():
            return None
        try:
            # shield: a timeout here must not cancel the cached computation.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout_s)
        except (TimeoutError, ValueError, RuntimeError, concurrent.futures.CancelledError):
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
