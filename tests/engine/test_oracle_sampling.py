"""The sampler the oracle and the workers share, on hand-made logits: each vLLM field
means what vLLM says it means (the live tests then show the mesh equals the oracle)."""

from __future__ import annotations

import math

import pytest
import torch

from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.protocol import messages as m

EOS = 4


def sampler(**fields: object) -> Sampler:
    return Sampler.for_request(m.Sampling(**fields), max_tokens=8, eos_token_ids=[EOS])


def logits(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_repetition_penalty_covers_prompt_and_output() -> None:
    s = sampler(repetition_penalty=2.0, penalty_prompt_ids=[0])
    # token 0 (in the prompt) 3.0 -> 1.5 loses to token 1 (2.0)
    assert s.sample(logits(3.0, 2.0, 0.0, 0.0, -1.0)) == 1
    # token 1 is now in the output: 2.0 -> 1.0 loses to token 2 (1.2)
    assert s.sample(logits(2.2, 2.0, 1.2, 0.0, -1.0)) == 2  # 1.1, 1.0 < 1.2
    # negative logits are multiplied: token 0 at -1 -> -2 loses to token 3 at -1.5
    s = sampler(repetition_penalty=2.0, penalty_prompt_ids=[0])
    assert s.sample(logits(-1.0, -3.0, -3.0, -1.5, -9.0)) == 3


def test_frequency_and_presence_penalties_count_output_only() -> None:
    s = sampler(frequency_penalty=1.0, penalty_prompt_ids=[1])
    assert s.sample(logits(0.0, 5.0, 3.5, 0.0, 0.0)) == 1
    assert s.sample(logits(0.0, 5.0, 3.5, 0.0, 0.0)) == 1  # 5 - 1 = 4 > 3.5
    assert s.sample(logits(0.0, 5.0, 3.5, 0.0, 0.0)) == 2  # 5 - 2 = 3 < 3.5
    p = sampler(presence_penalty=1.0)
    assert [p.sample(logits(0.0, 5.0, 3.5, 0.0, 0.0)) for _ in range(3)] == [1, 1, 1]


def test_min_tokens_masks_eos_and_stop_ids_then_they_stop() -> None:
    s = sampler(min_tokens=2, stop_token_ids=[3])
    row = logits(0.0, 1.0, 0.0, 9.0, 8.0)  # stop id 3 best, eos next
    assert s.sample(row) == 1 and not s.accept(1)
    assert s.sample(row) == 1 and not s.accept(1)
    assert s.sample(row) == 3 and s.accept(3)


def test_ignore_eos_keeps_going() -> None:
    assert sampler().accept(EOS)
    assert not sampler(ignore_eos=True).accept(EOS)
    assert sampler(ignore_eos=True, stop_token_ids=[EOS]).accept(EOS)


def test_first_token_accepted_from_prefill_continues_the_same_stream() -> None:
    fields = {"temperature": 1.0, "seed": 11, "frequency_penalty": 0.7}
    row = torch.linspace(-1, 1, 50)
    one = sampler(**fields)
    alone = [one.sample(row) for _ in range(6)]
    decode = sampler(**fields)
    decode.accept(alone[0])  # sampled on prefill: recorded here
    rest = []
    for _ in range(5):
        token = decode.sample(row)
        decode.accept(token)  # decode accepts what it sampled: not counted twice
        rest.append(token)
    assert rest == alone[1:]


def test_top_k_and_min_p_limit_the_draw() -> None:
    row = torch.linspace(0, 1, 50)  # nearly flat: a free draw lands anywhere
    top = {sampler(temperature=1.0, seed=s, top_k=2).sample(row) for s in range(40)}
    assert top == {48, 49}
    probs = torch.softmax(row, -1)
    kept = {sampler(temperature=1.0, seed=s, min_p=0.99).sample(row) for s in range(40)}
    assert all(probs[t] >= 0.99 * probs.max() for t in kept)


def test_logprobs_are_the_raw_distribution() -> None:
    s = sampler(logprobs=2, repetition_penalty=1.5, penalty_prompt_ids=[0])
    row = logits(2.0, 1.0, 0.0, -1.0, -2.0)
    token = s.sample(row)
    ((lp, top),) = s.take_logprobs(token)
    raw = torch.log_softmax(row, -1)
    assert math.isclose(lp, float(raw[token]), rel_tol=1e-6)
    assert [i for i, _ in top] == [0, 1]
    assert s.take_logprobs(token) == []  # once


@pytest.mark.parametrize("bad", [{"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0.0},
                                 {"min_tokens": -1}, {"logprobs": 21}])
def test_bad_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]
