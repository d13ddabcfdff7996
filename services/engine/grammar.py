"""Structured outputs: a request's grammar, compiled with llguidance, masks every token.

llguidance (the `guidance` backend of vLLM and SGLang) was picked over xgrammar and
outlines-core: it has no Python dependencies (xgrammar's wheel requires transformers, torch
and triton at run time; outlines-core precomputes a whole-vocabulary index per schema), it
computes each mask on the fly from the grammar's state (tens of microseconds a token on
SmolLM2's 49,152-token vocabulary, applied to the logits included: `pdmesh bench
structured`), and it reads JSON schemas, regular expressions, choices and Lark / GBNF
grammars.

Torch-free (the gateway validates requests' grammars with it): masks are NumPy booleans;
`sampling.Sampler` applies them. One `Grammars` per tokenizer builds llguidance's view of
the vocabulary once (about 0.2 s for SmolLM2) and a `Constraint` per request follows the
tokens the request generates (prefill's first, decode's others; a resumed request's
delivered tokens replayed first), so that prefill and decode mask alike and the oracle,
using the same class, produces the same tokens.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from pdmesh.services.protocol import messages as m

MAX_SPEC_BYTES = 64 * 1024  # a grammar, schema or regex larger than this is refused
# JSON: separators as json.dumps writes them (", " and ": "), any other whitespace refused,
# so that a small model cannot spend its tokens on blanks.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ",
                 "key_separator": ": "}
# Numbers where the schema is silent: llguidance has no option that bounds a JSON number's
# digits (a small model can write `3.1111...` until max_tokens), so `bounded_numbers`
# gives every `number` / `integer` without bounds of its own these (llama.cpp's
# json-schema-to-grammar caps both sides of the point at 16 digits). Such a number has no
# exponent (`1e5` is written `100000`).
NUMBER_INTEGER_DIGITS = 15  # |value| <= 10**15 - 1: DBL_DIG, so a double holds it exactly
NUMBER_FRACTION_DIGITS = 10  # multipleOf 1e-10: llguidance refuses 1e-11 (binary noise)
# Strict mode: OpenAI's documented keywords (structured outputs, "Supported schemas"), and
# those the grammar also enforces exactly and that keep a small model's strings finite
# (minLength, maxLength), and annotations with no meaning for validation. Any other keyword
# is a 400 naming it, and every object is closed.
STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "anyOf", "$ref", "$defs", "definitions", "description", "title",
    "pattern", "format", "minLength", "maxLength",  # strings
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",  # numbers
    "minItems", "maxItems",  # arrays
    "$schema", "$comment", "examples", "default"})  # annotations


class GrammarError(ValueError):
    """A structured-output spec that does not compile, or a token it does not allow."""


def _llg() -> Any:
    import llguidance  # imported on first use: unconstrained serving never loads it

    return llguidance


def grammar_text(structured: m.Structured) -> str:
    """llguidance's grammar for `structured`; GrammarError names what is wrong."""
    kind, spec = structured.kind, structured.spec
    if kind not in m.STRUCTURED_KINDS:
        raise GrammarError(f"unknown structured output kind {kind!r} "
                           f"(one of {', '.join(m.STRUCTURED_KINDS)})")
    if len(spec.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"the {kind} spec is over {MAX_SPEC_BYTES} bytes")
    llg = _llg()
    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            return str(llg.LLMatcher.grammar_from_json_schema(bounded_numbers(schema),
                                                              defaults=JSON_DEFAULTS))
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
        return str(llg.grammar_from(kind, spec))
    except GrammarError:
        raise
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise GrammarError(f"the {kind} spec does not compile: {exc}") from None
    except RecursionError:
        raise GrammarError(f"the {kind} spec nests too deeply") from None


def strict_schema(schema: Any, where: str = "schema") -> dict[str, Any]:
    """`schema` as OpenAI's `strict: true` reads it: every object accepts only the properties
    it declares (`additionalProperties` missing is false, in $defs, items and anyOf too);
    GrammarError naming the first keyword outside STRICT_KEYWORDS, or an
    `additionalProperties` that is not false."""
    if not isinstance(schema, dict):
        raise GrammarError(f"strict mode needs a schema object at {where}")
    for key in schema:
        if key not in STRICT_KEYWORDS:
            raise GrammarError(f"strict mode does not support the keyword {key!r} (at "
                               f"{where}); supported: {', '.join(sorted(STRICT_KEYWORDS))}")
    out = dict(schema)
    if out.get("additionalProperties", False) is not False:
        raise GrammarError(f"strict mode needs additionalProperties false (at {where})")
    types = out.get("type")
    if "properties" in out or types == "object" or (isinstance(types, list)
                                                     and "object" in types):
        out["additionalProperties"] = False
    for key in ("properties", "$defs", "definitions"):
        if key in out:
            if not isinstance(out[key], dict):
                raise GrammarError(f"{key} must be an object (at {where})")
            out[key] = {name: strict_schema(sub, f"{where}.{key}.{name}")
                        for name, sub in out[key].items()}
    if "items" in out:
        out["items"] = strict_schema(out["items"], f"{where}.items")
    if "anyOf" in out:
        if not isinstance(out["anyOf"], list):
            raise GrammarError(f"anyOf must be a list (at {where})")
        out["anyOf"] = [strict_schema(sub, f"{where}.anyOf[{i}]")
                        for i, sub in enumerate(out["anyOf"])]
    return out


_NUMBER_LIMIT = 10 ** NUMBER_INTEGER_DIGITS - 1
_BOUNDS = {"minimum": ("minimum", "exclusiveMinimum"),
           "maximum": ("maximum", "exclusiveMaximum")}
# Where a subschema sits: one schema, a list of them, or a map of names to them. `not` and
# `if` are left alone (bounding inside them would widen what the schema allows).
_SUB_ONE = ("additionalProperties", "items", "additionalItems", "contains", "then", "else",
            "unevaluatedItems", "unevaluatedProperties")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_numbers(schema: Any) -> Any:
    """`schema` with NUMBER_INTEGER_DIGITS and NUMBER_FRACTION_DIGITS where a `number` or
    `integer` says nothing of its own (no bound on that side, no multipleOf, no enum or
    const), so that no number outruns max_tokens; a copy, the request's schema untouched."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_ONE:
        if isinstance(out.get(key), dict):
            out[key] = bounded_numbers(out[key])
    for key in _SUB_LIST:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(sub) for sub in out[key]]
    for key in _SUB_MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in out[key].items()}
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if not types & {"number", "integer"} or "enum" in out or "const" in out:
        return out
    low, high = _numeric(out, "minimum"), _numeric(out, "maximum")
    if low is None and (high is None or high > -_NUMBER_LIMIT):
        out["minimum"] = -_NUMBER_LIMIT
    if high is None and (low is None or low < _NUMBER_LIMIT):
        out["maximum"] = _NUMBER_LIMIT
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = 10.0 ** -NUMBER_FRACTION_DIGITS
    return out


def _numeric(schema: dict[str, Any], side: str) -> float | None:
    """The schema's own bound on `side` (inclusive or exclusive), None when it has none."""
    for key in _BOUNDS[side]:
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


class Grammars:
    """llguidance's tokenizer for one model's vocabulary, and the requests' constraints."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos = sorted(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._ll: Any = None

    @property
    def ll_tokenizer(self) -> Any:
        """Built on first use (a fraction of a second), then shared."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos)
            return self._ll

    def warm(self) -> None:
        """Build the vocabulary view now (a worker does at start, off its event loop, so
        that the first constrained request does not pay for it there)."""
        _ = self.ll_tokenizer

    def check(self, structured: m.Structured) -> None:
        """Raise GrammarError when `structured` does not compile for this vocabulary."""
        _compiled(self, structured)

    def constraint(self, structured: m.Structured,
                   prior: Iterable[int] = ()) -> Constraint:
        """A fresh constraint for one request, after its `prior` tokens (a resumed request's
        delivered output). The matcher compiles the grammar once and reports what does
        not compile (no separate validation: it would compile it twice)."""
        grammar = _grammar_cached(structured.kind, structured.spec)
        c = Constraint(self, grammar, structured.kind)
        for token in prior:
            c.advance(token)
        return c


@functools.lru_cache(maxsize=256)
def _grammar_cached(kind: str, spec: str) -> str:
    return grammar_text(m.Structured(kind=kind, spec=spec))


def _compiled(grammars: Grammars, structured: m.Structured) -> str:
    grammar = _grammar_cached(structured.kind, structured.spec)
    error = _llg().LLMatcher.validate_grammar(grammar, grammars.ll_tokenizer)
    if error:
        raise GrammarError(f"the {structured.kind} spec does not compile: {error}")
    return grammar


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    llg = _llg()
    core = getattr(tokenizer, "core", None)
    if core is not None:  # a Hugging Face `tokenizers.Tokenizer`
        return llg.LLTokenizer(core.to_str(), n_vocab=vocab_size, eos_token=eos)
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size, eos)),
                           n_vocab=vocab_size, eos_token=eos)


class _ByteVocab:
    """llguidance's view of a byte-level vocabulary (the `tiny` model's): ids 0..255 are the
    bytes, the rest special tokens."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(tokenizer, "BOS", None)
        self.tokens = [bytes([i]) if i < 256 else f"<|special_{i}|>".encode()
                       for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


class Constraint:
    """One request's grammar state: the tokens it may sample next, and each it did."""

    def __init__(self, grammars: Grammars, grammar: str, kind: str = "grammar") -> None:
        self.vocab_size = grammars.vocab_size
        self.eos = grammars.eos
        self.matcher = _llg().LLMatcher(grammars.ll_tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"the {kind} spec does not compile: "
                               f"{self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """Booleans over the vocabulary: True where the grammar allows the token now. Once
        the grammar is complete only eos is allowed; should it allow nothing (an error
        state), eos, so that the request ends rather than sampling outside it."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if not mask.any():
            mask[self.eos] = True
        return mask

    def advance(self, token: int) -> None:
        """The request generated `token`: GrammarError if the grammar did not allow it."""
        if self.matcher.is_stopped():
            return  # eos taken: nothing follows
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: "
                               f"{self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return bool(self.matcher.is_accepting())
