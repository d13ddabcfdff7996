"""Prompt lengths in the served model's tokens, the ShareGPT dataset input and the
--base-url forms, without a server (a real `tokenizers` BPE trained here, not one token
per byte, stands for the served model's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from pdmesh.loadtest.client import api_base, server_root
from pdmesh.loadtest.dataset import sharegpt_requests
from pdmesh.loadtest.tokens import ByteCounter, LocalCounter, fit
from pdmesh.loadtest.workload import (
    LengthDist,
    WorkloadSpec,
    build_requests,
    random_text,
    shared_prefix,
)


@pytest.fixture(scope="module")
def bpe() -> LocalCounter:
    """A BPE whose tokens span several characters of the workload's printable text."""
    rng = np.random.default_rng(0)
    corpus = [random_text(rng, 200) for _ in range(300)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["[UNK]"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))

    class Encoder:
        def encode(self, text: str) -> list[int]:
            return tok.encode(text).ids

    return LocalCounter(Encoder(), "test-bpe")


async def test_prompts_are_sized_in_the_served_tokens(bpe: LocalCounter) -> None:
    spec = WorkloadSpec(num_requests=24, input_len=LengthDist("uniform", 200, 50, 400),
                        output_len=LengthDist("fixed", 32), seed=3, context_length=512,
                        over_capacity_fraction=0.25, shared_prefix_len=64,
                        shared_prefix_share=0.5)
    built = build_requests(spec)
    chars_per_token = sum(len(r.prompt) for r in built) / sum(
        (await bpe.count([r.prompt for r in built])))
    assert chars_per_token > 1.1  # counting bytes would be off by more than 10 %
    fitted = await fit(built, spec, bpe, shared_prefix(spec))
    counts = await bpe.count([r.prompt for r in fitted])
    assert [r.num_tokens for r in fitted] == counts == [r.prompt_len for r in fitted]
    for before, after in zip(built, fitted, strict=True):
        if after.expect_reject:
            assert after.prompt_len > 512
        else:
            wanted = len(before.prompt)
            assert wanted - max(1, wanted // 50) <= after.prompt_len <= wanted
            assert after.prompt_len + after.max_tokens + spec.bos_allowance <= 512
    # Same seed, same prompts: the sizing is as deterministic as the generation.
    again = await fit(build_requests(spec), spec, bpe, shared_prefix(spec))
    assert [r.prompt for r in again] == [r.prompt for r in fitted]


async def test_byte_counting_changes_nothing() -> None:
    spec = WorkloadSpec(num_requests=8, input_len=LengthDist("uniform", 100, 20, 200),
                        output_len=LengthDist("fixed", 8), context_length=256,
                        over_capacity_fraction=0.25)
    built = build_requests(spec)
    fitted = await fit(built, spec, ByteCounter(), "")
    assert [r.prompt for r in fitted] == [r.prompt for r in built]
    assert [r.prompt_len for r in fitted] == [len(r.prompt) for r in built]


async def test_sharegpt_records_become_requests(tmp_path: Path) -> None:
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story."},
                                      {"from": "gpt", "value": "Once upon a time."}]},
        {"id": "short", "conversations": [{"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello there!"}]},
        {"id": "one turn", "conversations": [{"from": "human", "value": "Anyone?"}]},
        {"id": "long", "conversations": [{"from": "human", "value": "x" * 1500},
                                         {"from": "gpt", "value": "ok, fine."}]},
        {"id": "b", "conversation": [{"from": "human", "value": "What is two plus two?"},
                                     {"from": "gpt", "value": "Four."}]},
        "not a record",
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    reqs = await sharegpt_requests(path, 10, seed=1, num_tenants=2, counter=ByteCounter())
    assert sorted(r.prompt for r in reqs) == ["Tell me a story.", "What is two plus two?"]
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt["Tell me a story."].max_tokens == len("Once upon a time.")
    assert by_prompt["What is two plus two?"].max_tokens == len("Four.")
    assert all(r.fixed_text and r.prompt_len == len(r.prompt) for r in reqs)
    assert [r.tenant for r in reqs] == [0, 1]
    fixed = await sharegpt_requests(path, 1, seed=1, num_tenants=1, counter=ByteCounter(),
                                    output_len=7)
    assert len(fixed) == 1 and fixed[0].max_tokens == 7
    path.write_text("{}")
    with pytest.raises(ValueError, match="JSON list"):
        await sharegpt_requests(path, 1, seed=1, num_tenants=1, counter=ByteCounter())


@pytest.mark.parametrize("given", ["http://h:8000", "http://h:8000/", "http://h:8000/v1",
                                   "http://h:8000/v1/"])
def test_base_url_forms(given: str) -> None:
    assert api_base(given) == "http://h:8000/v1"
    assert server_root(given) == "http://h:8000"
