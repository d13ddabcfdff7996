"""The output oracle (I4) for the tests: `pdmesh.services.engine.oracle`, the one oracle of the
project (the reference engine's greedy answer), as the functions the tests call."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.services.engine.models import LoadedModel
from pdmesh.services.engine.oracle import reference
from pdmesh.services.protocol import messages as m


def tiny() -> LoadedModel:
    return reference("tiny").loaded


def expected_ids(prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Greedy tokens the reference engine generates (eos included when it stops early)."""
    return reference("tiny").ids(prompt_ids, max_tokens)


def expected_text(prompt: str, max_tokens: int) -> str:
    return reference("tiny").expected(prompt, max_tokens).text


def expected_run(prompt_ids: Sequence[int], max_tokens: int, sampling: m.Sampling
                 ) -> tuple[list[int], list[tuple[float, list[tuple[int, float]]]]]:
    """Tokens and logprobs the mesh must give for any wire `Sampling` (seeded, penalties,
    min_tokens, ignore_eos, stop_token_ids): the reference engine with the mesh's sampler."""
    return reference("tiny").run(prompt_ids, max_tokens, sampling)
