"""Workload generation: length distributions, prompt text, tenants, over-long share."""

import numpy as np
import pytest

from pdmesh.loadtest.workload import (
    PRINTABLE,
    LengthDist,
    WorkloadSpec,
    build_prompt,
    build_requests,
    build_warmup_requests,
    marker,
)


def _spec(**kwargs):
    base = dict(num_requests=200, input_len=LengthDist("fixed", 100),
                output_len=LengthDist("fixed", 8), seed=7)
    return WorkloadSpec(**{**base, **kwargs})


def test_fixed_lengths_are_exact():
    rng = np.random.default_rng(0)
    assert LengthDist("fixed", 42).sample(rng, 5).tolist() == [42] * 5


def test_uniform_lengths_stay_in_range_and_cover_it():
    values = LengthDist("uniform", 100, 10, 20).sample(np.random.default_rng(1), 2000)
    assert values.min() == 10 and values.max() == 20
    assert abs(values.mean() - 15) < 0.5


def test_normal_lengths_are_clipped_and_centred():
    dist = LengthDist("normal", 1000, 900, 1100, 100.0)
    values = dist.sample(np.random.default_rng(2), 5000)
    assert values.min() >= 900 and values.max() <= 1100
    assert abs(np.median(values) - 1000) < 10
    assert values.dtype == np.int64


@pytest.mark.parametrize("bad", [dict(kind="zipf"), dict(min=0), dict(min=5, max=4),
                                 dict(std=-1.0), dict(mean=0)])
def test_invalid_length_distributions_are_refused(bad):
    with pytest.raises(ValueError):
        LengthDist(**{"kind": "uniform", "mean": 10, "min": 1, "max": 20, **bad})


def test_prompt_has_exact_length_printable_ascii_and_marker():
    prompt = build_prompt(300, tenant=3, index=17, seed=5)
    assert len(prompt) == len(prompt.encode()) == 300  # one byte = one token
    assert set(prompt.encode()) <= set(PRINTABLE.tolist())
    assert prompt.startswith(marker(3, 17, 5))
    assert len(build_prompt(5, 0, 0, 0)) == 5  # shorter than the marker: truncated


def test_requests_are_deterministic_per_seed_and_distinct_per_index():
    a, b = build_requests(_spec()), build_requests(_spec())
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert len({r.prompt for r in a}) == len(a)
    c = build_requests(_spec(seed=8))
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))


def test_tenants_are_round_robin_with_their_marker():
    requests = build_requests(_spec(num_tenants=3, num_requests=9))
    assert [r.tenant for r in requests] == [0, 1, 2] * 3
    assert all(f"t{r.tenant:02d} r{r.index:06d}" in r.prompt for r in requests)


def test_shared_prefix_goes_to_the_chosen_share():
    requests = build_requests(_spec(shared_prefix_len=40, shared_prefix_share=0.25))
    prefix = max((r.prompt[:40] for r in requests),
                 key=lambda p: sum(r.prompt.startswith(p) for r in requests))
    assert sum(r.prompt.startswith(prefix) for r in requests) == 50
    assert all(len(r.prompt) == 100 for r in requests)


def test_over_capacity_share_is_exact_and_valid_prompts_fit_the_context():
    spec = _spec(input_len=LengthDist("uniform", 500, 100, 1000), over_capacity_fraction=0.05,
                 context_length=512, output_len=LengthDist("fixed", 16))
    requests = build_requests(spec)
    over = [r for r in requests if r.expect_reject]
    assert len(over) == 10
    assert all(r.prompt_len > 512 for r in over)
    valid = [r for r in requests if not r.expect_reject]
    assert all(r.prompt_len + r.max_tokens + spec.bos_allowance <= 512 for r in valid)
    assert max(r.prompt_len for r in valid) == 512 - 16 - 1  # clamped, not dropped


def test_over_capacity_needs_a_context_length():
    with pytest.raises(ValueError):
        _spec(over_capacity_fraction=0.1)


def test_output_longer_than_context_is_refused():
    with pytest.raises(ValueError):
        build_requests(_spec(context_length=8, output_len=LengthDist("fixed", 16)))


def test_warmup_requests_are_valid_and_distinct_from_measured_ones():
    spec = _spec(over_capacity_fraction=0.5, context_length=512)
    warm = build_warmup_requests(spec, 4)
    measured = {r.prompt for r in build_requests(spec)}
    assert all(r.warmup and not r.expect_reject for r in warm)
    assert not measured & {r.prompt for r in warm}
