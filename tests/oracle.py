"""The output oracle (I4) for the tests: `pdmesh.loadtest.oracle`, the one oracle of the
project (the reference engine's greedy answer), as the functions the tests call."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.loadtest.oracle import reference
from pdmesh.services.engine.models import LoadedModel


def tiny() -> LoadedModel:
    return reference("tiny").loaded


def expected_ids(prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens the reference engine generates (eos included when it stops early)."""
    return reference("tiny").ids(prompt_ids, max_tokens)


def expected_text(prompt: str, max_tokens: int) -> str:
    return reference("tiny").expected(prompt, max_tokens).text
