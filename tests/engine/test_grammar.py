"""Structured outputs in the sampler (services/engine/grammar.py, sampling.py): every token
sampled under a grammar is one it allows, the reply satisfies the constraint, the state
crosses the prefill/decode split and a resume, and bad specs are refused clearly."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdmesh.services.engine.grammar import GrammarError, Grammars
from pdmesh.services.engine.sampling import Sampler
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m

TOK = ByteTokenizer()
GRAMMARS = Grammars(TOK)
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": -9, "maximum": 99},
    "s": {"type": "string", "maxLength": 5},
    "e": {"enum": ["on", "off"]},
    "a": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
    "required": ["n", "s", "e", "a"], "additionalProperties": False}


def _structured(kind: str, value: object) -> m.Structured:
    return m.Structured(kind=kind, spec=value if isinstance(value, str) else json.dumps(value))


def _generate(sampling: m.Sampling, seed_logits: int, max_tokens: int = 300,
              split: int | None = None) -> list[int]:
    """Sample from random logits until stop; with `split`, the first `split` tokens on one
    sampler (prefill's, or the first workers') and the rest on a fresh one that accepts
    them (decode) or is resumed from them (start_index + prior_output_ids)."""
    gen = torch.Generator().manual_seed(seed_logits)
    sampler = Sampler.for_request(sampling, max_tokens, TOK.eos_token_ids, GRAMMARS)
    out: list[int] = []
    while len(out) < max_tokens:
        if split is not None and len(out) == split:
            sampler = Sampler.for_request(
                m.Sampling(**{**{f: getattr(sampling, f) for f in sampling.__struct_fields__},
                              "start_index": split, "prior_output_ids": list(out)}),
                max_tokens, TOK.eos_token_ids, GRAMMARS)
        logits = torch.randn(TOK.vocab_size, generator=gen)
        token = sampler.sample(logits)
        out.append(token)
        if sampler.accept(token):
            break
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("seed", range(6))
def test_sampled_json_satisfies_the_schema(temperature: float, seed: int) -> None:
    sampling = m.Sampling(temperature=temperature, seed=seed,
                          structured=_structured("json", SCHEMA))
    out = _generate(sampling, seed)
    assert out[-1] == ByteTokenizer.EOS, "the grammar's end must end the reply"
    jsonschema.validate(json.loads(TOK.decode(out)), SCHEMA)


def test_without_the_mask_random_logits_are_not_json() -> None:
    """The test above can fail: the same random logits unconstrained are no JSON."""
    out = _generate(m.Sampling(temperature=0.0), 0, max_tokens=60)
    with pytest.raises(ValueError):
        json.loads(TOK.decode(out))


@pytest.mark.parametrize("kind,value,pattern", [
    ("regex", r"[a-c]{2}-\d{1,3}", r"[a-c]{2}-\d{1,3}"),
    ("choice", ["north", "south"], r"north|south"),
    ("grammar", 'start: "<" item ("|" item)* ">"\nitem: /[xy]{1,2}/', r"<[xy]{1,2}(\|[xy]{1,2})*>"),
])
def test_regex_choice_and_grammar(kind: str, value: object, pattern: str) -> None:
    for seed in range(4):
        out = _generate(m.Sampling(temperature=1.0, seed=seed,
                                   structured=_structured(kind, value)), seed, 64)
        assert out[-1] == ByteTokenizer.EOS
        assert re.fullmatch(pattern, TOK.decode(out)), TOK.decode(out)


@pytest.mark.parametrize("split", [1, 3, 10])
def test_the_grammar_state_crosses_the_split_and_a_resume(split: int) -> None:
    """Prefill samples the first token and decode goes on (split 1), or a request resumed
    on other workers from its delivered tokens: the same tokens as one sampler's run."""
    sampling = m.Sampling(temperature=0.9, seed=42, structured=_structured("json", SCHEMA))
    whole = _generate(sampling, 3)
    assert _generate(sampling, 3, split=split) == whole


def test_decode_accepts_prefills_first_token_into_its_grammar() -> None:
    sampling = m.Sampling(structured=_structured("choice", ["yes", "no"]))
    prefill = Sampler.for_request(sampling, 8, TOK.eos_token_ids, GRAMMARS)
    decode = Sampler.for_request(sampling, 8, TOK.eos_token_ids, GRAMMARS)
    logits = torch.zeros(TOK.vocab_size)
    logits[ord("n")] = 5.0
    first = prefill.sample(logits)
    assert first == ord("n")
    decode.accept(first)  # decode's sampler records prefill's token: the grammar follows
    allowed = decode.constraint.allowed()
    assert allowed[ord("o")] and not allowed[ord("e")]


def test_prepared_mask_is_the_same_mask() -> None:
    sampling = m.Sampling(structured=_structured("json", SCHEMA))
    a = Sampler.for_request(sampling, 64, TOK.eos_token_ids, GRAMMARS)
    b = Sampler.for_request(sampling, 64, TOK.eos_token_ids, GRAMMARS)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        logits = torch.randn(TOK.vocab_size, generator=gen)
        b.prepare()  # as the decode loop does while the engine step runs
        ta, tb = a.sample(logits), b.sample(logits)
        assert ta == tb
        if a.accept(ta) | b.accept(tb):
            break


@pytest.mark.parametrize("structured,needle", [
    (m.Structured(kind="regex", spec="(a"), "does not compile"),
    (m.Structured(kind="json", spec="{"), "does not compile"),
    (m.Structured(kind="json", spec="[]"), "must be an object"),
    (m.Structured(kind="choice", spec='["", "x"]'), "non-empty"),
    (m.Structured(kind="grammar", spec="start: nothing_defined"), "does not compile"),
    (m.Structured(kind="xml", spec="<a/>"), "unknown structured output kind"),
    (m.Structured(kind="regex", spec="a" * 70000), "over"),
])
def test_bad_specs_are_refused_with_a_reason(structured: m.Structured, needle: str) -> None:
    with pytest.raises(GrammarError, match=needle):
        GRAMMARS.check(structured)
    with pytest.raises(GrammarError, match=needle):  # a worker's sampler: the same reason
        Sampler.for_request(m.Sampling(structured=structured), 8, TOK.eos_token_ids, GRAMMARS)


def test_a_constrained_request_needs_the_models_grammars() -> None:
    with pytest.raises(ValueError, match="not served"):
        Sampler.for_request(m.Sampling(structured=_structured("regex", "a")), 8,
                            TOK.eos_token_ids)
