"""A request resumed from prompt + its first k tokens (`Sampling.start_index`,
`prior_output_ids`) samples on exactly as the uninterrupted request would: the property the
gateway's failover rests on (gateway/generation.py), checked on the reference engine for
greedy, seeded and penalized sampling at several split points."""

from __future__ import annotations

import msgspec
import pytest

from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.protocol import messages as m
from tests.support.oracle import expected_run, tiny

PROMPT = [5, 17, 99, 3, 42, 7, 250, 18, 64, 11, 9, 200, 21]
N = 40
SAMPLINGS = {
    "greedy": m.Sampling(temperature=0.0),
    "seeded": m.Sampling(temperature=0.9, seed=1234),
    "top_p_k": m.Sampling(temperature=1.1, top_p=0.8, top_k=50, seed=7),
    "penalized": m.Sampling(temperature=0.8, seed=99, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2,
                            penalty_prompt_ids=sorted(set(PROMPT))),
    "min_tokens": m.Sampling(temperature=0.7, seed=5, min_tokens=30),
}


def _penalized(s: m.Sampling) -> bool:
    return (s.repetition_penalty != 1.0 or s.presence_penalty != 0.0
            or s.frequency_penalty != 0.0)


@pytest.mark.parametrize("name", sorted(SAMPLINGS))
def test_a_resumed_request_continues_the_uninterrupted_one(name: str) -> None:
    sampling = SAMPLINGS[name]
    whole, logprobs = expected_run(PROMPT, N, msgspec.structs.replace(sampling, logprobs=2))
    assert len(whole) >= 12, whole  # long enough to split
    for k in (1, 5, len(whole) // 2, len(whole) - 1):
        done = whole[:k]
        resumed = msgspec.structs.replace(
            sampling, logprobs=2, start_index=k,
            prior_output_ids=done if _penalized(sampling) else [])
        rest, rest_logprobs = expected_run([*PROMPT, *done], N - k, resumed)
        assert rest == whole[k:], (name, k)
        for (lp, top), (want_lp, want_top) in zip(rest_logprobs, logprobs[k:], strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert [i for i, _ in top] == [i for i, _ in want_top]


def test_without_the_carried_state_a_resume_would_diverge() -> None:
    """The check above can fail: resuming a seeded request without its token index (the
    RNG's stream position) gives other tokens."""
    sampling = SAMPLINGS["seeded"]
    whole, _ = expected_run(PROMPT, N, sampling)
    k = len(whole) // 2
    rest, _ = expected_run([*PROMPT, *whole[:k]], N - k, sampling)
    assert rest != whole[k:]


def test_the_sampler_starts_at_its_index_and_counts() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, presence_penalty=1.0,
                            start_index=3, prior_output_ids=(8, 8, 2))
    sampler = Sampler(params, eos_token_ids=tiny().tokenizer.eos_token_ids)
    assert sampler.index == 3
    assert sampler.counts == {8: 2, 2: 1}
    with pytest.raises(ValueError, match="start_index"):
        SamplingParams(start_index=-1)
