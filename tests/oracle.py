"""The output oracle (I4): what the single-process reference engine says for a prompt."""

from __future__ import annotations

import functools

from services.engine.models import LoadedModel, load_model
from services.engine.reference import ReferenceEngine
from services.engine.sampling import SamplingParams


@functools.cache
def tiny() -> LoadedModel:
    return load_model("tiny")


@functools.cache
def _engine() -> ReferenceEngine:
    return ReferenceEngine(tiny())


def expected_ids(prompt_ids: tuple[int, ...] | list[int], max_tokens: int) -> list[int]:
    """Greedy tokens the reference engine generates (eos included when it stops early)."""
    return _engine().generate(list(prompt_ids), SamplingParams(temperature=0.0,
                                                              max_tokens=max_tokens))


def expected_text(prompt: str, max_tokens: int) -> str:
    tok = tiny().tokenizer
    ids = [t for t in expected_ids(tuple(tok.encode(prompt)), max_tokens)
           if t not in tok.eos_token_ids]
    return tok.decode(ids)
