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
import os
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
# Any JSON object (`response_format: json_object`, a tool without parameters), spelled out
# so that its values, at any depth, get the bounds above: JSON Schema's `{"type":
# "object"}` leaves them untyped, and an untyped number has no bound. Inside another schema
# use ANY_JSON_OBJECT_REF and put ANY_JSON_DEFS in that schema's root `$defs` (a `$ref`
# points from the root of the document it is in).
_VALUE = "#/$defs/pdmesh_json_value"
ANY_JSON_DEFS: dict[str, Any] = {"pdmesh_json_value": {"anyOf": [
    {"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
    {"type": "array", "items": {"$ref": _VALUE}},
    {"type": "object", "additionalProperties": {"$ref": _VALUE}}]}}
ANY_JSON_OBJECT_REF: dict[str, Any] = {"type": "object", "additionalProperties": {"$ref": _VALUE}}
ANY_JSON_OBJECT: dict[str, Any] = {**ANY_JSON_OBJECT_REF, "$defs": ANY_JSON_DEFS}
ANY_JSON_OBJECT_SPEC = json.dumps(ANY_JSON_OBJECT, separators=(",", ":"))
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
# Loops: a small model inside a JSON string or array can repeat the same tokens
# (`"revised", "revised", ...`, `Lanpa-1.0.0/Lanpa-1.0.0/...`, a sentence again and again)
# until max_tokens: the grammar holds it inside the string, where free text would have
# ended. Once the latest tokens repeat a period of p <= LOOP_MAX_PERIOD tokens over
# max(loop_span, 2p) tokens (a long period must come round twice), the token that would
# continue the period is masked, and the reply closes: from there on, wherever the
# grammar allows a token that only closes the open string (its closing quote) or the open
# array or object (`]`, `}`), or ends the reply, only those may be sampled.
LOOP_MAX_PERIOD = 64
LOOP_SPAN_MIN = 32
LOOP_SPAN_DEFAULT = 32  # PDMESH_STRUCTURED_LOOP_TOKENS; 0: no loop guard


def loop_span_from_env() -> int:
    """PDMESH_STRUCTURED_LOOP_TOKENS: tokens of an exact repetition before the loop guard
    masks its continuation (0 turns the guard off); ValueError on a bad value."""
    raw = os.environ.get("PDMESH_STRUCTURED_LOOP_TOKENS", "").strip()
    if not raw:
        return LOOP_SPAN_DEFAULT
    try:
        span = int(raw)
    except ValueError:
        raise ValueError(f"PDMESH_STRUCTURED_LOOP_TOKENS={raw!r}: a whole number of "
                         "tokens (0: off)") from None
    if span != 0 and not LOOP_SPAN_MIN <= span <= 4096:
        raise ValueError(f"PDMESH_STRUCTURED_LOOP_TOKENS={span}: 0 (off) or "
                         f"{LOOP_SPAN_MIN}..4096")
    return span


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
            # As JSON text: llguidance's conversion of a Python dict refuses integers of
            # 2**64 and more (`"maximum": 1e20` written out), which JSON carries.
            return str(llg.LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_numbers(schema)), defaults=JSON_DEFAULTS))
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

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 loop_span: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        # Every worker of a mesh must agree (a resumed request's masks are recomputed).
        self.loop_span = loop_span_from_env() if loop_span is None else loop_span
        self.eos = sorted(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._ll: Any = None
        self._closers: _Closers | None = None

    @property
    def ll_tokenizer(self) -> Any:
        """Built on first use (a fraction of a second), then shared."""
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos)
            return self._ll

    @property
    def closers(self) -> _Closers:
        """The vocabulary's closing tokens (the loop guard's, built on first use)."""
        ll = self.ll_tokenizer
        with self._lock:
            if self._closers is None:
                self._closers = _Closers(ll, self.vocab_size, self.eos)
            return self._closers

    def warm(self) -> None:
        """Build the vocabulary view now (a worker does at start, off its event loop, so
        that the first constrained request does not pay for it there)."""
        _ = self.closers if self.loop_span else self.ll_tokenizer

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


class _Closers:
    """Per token of the vocabulary: its bytes, and whether it only closes: a JSON string
    (an unescaped `"` when appended inside one, followed by nothing but `]` and `}`), or
    arrays and objects (nothing but `]` and `}`). A token that opens anything (`", "`,
    `],`) is no closer. eos is both (it ends a complete reply)."""

    def __init__(self, ll: Any, vocab_size: int, eos: list[int]) -> None:
        self.bytes: list[bytes] = []
        self.string = np.zeros(vocab_size, dtype=bool)
        self.container = np.zeros(vocab_size, dtype=bool)
        for t in range(vocab_size):
            raw = b"" if t >= ll.vocab_size or ll.is_special_token(t) else ll.decode_bytes([t])
            self.bytes.append(raw)
            end = _string_end(raw, False)
            self.string[t] = end >= 0 and not raw[end + 1:].strip(b"]}")
            self.container[t] = bool(raw) and not raw.strip(b"]}")
        self.string[eos] = self.container[eos] = True


def _string_end(raw: bytes, escaped: bool) -> int:
    """Index of the `"` that closes a JSON string in `raw` (read from inside the string,
    after a backslash when `escaped`), or -1."""
    for i, byte in enumerate(raw):
        if escaped:
            escaped = False
        elif byte == 0x5C:  # backslash
            escaped = True
        elif byte == 0x22:  # quote
            return i
    return -1


class Constraint:
    """One request's grammar state: the tokens it may sample next, and each it did."""

    def __init__(self, grammars: Grammars, grammar: str, kind: str = "grammar") -> None:
        self.vocab_size = grammars.vocab_size
        self.eos = grammars.eos
        # The loop guard holds JSON only: a regex or a grammar (free text in it too, as in
        # a tool-calling reply) is sampled as its author wrote it.
        self.loop_span = grammars.loop_span if kind == "json" else 0
        # Loop guard state: the last tokens, and per period p (1..LOOP_MAX_PERIOD) how many
        # of the latest tokens equal the token p before them; for JSON, where the reply
        # stands (inside a string, after a backslash) and whether it is closing.
        self._tail: list[int] = []
        self._runs = [0] * (LOOP_MAX_PERIOD + 1)
        # The run a period p needs: the loop covers max(loop_span, 2p) tokens.
        self._need = [max(self.loop_span, 2 * p) - p for p in range(LOOP_MAX_PERIOD + 1)]
        self._continuations: set[int] = set()  # what allowed() masks now
        self.loops = 0  # tokens after which a loop's continuation was masked
        self._closers = grammars.closers if self.loop_span else None
        self._in_string = self._escaped = False
        self.closing = False
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
        for token in self._continuations:
            if mask[token] and mask.sum() > 1:  # never mask the only way on
                mask[token] = False
        if self.closing and self._closers is not None and not self._escaped:
            closers = self._closers.string if self._in_string else self._closers.container
            closing = mask & closers
            if closing.any():
                mask = closing
        return mask

    def _loop_continuations(self) -> set[int]:
        """The tokens that would extend an exact repetition of a period p of at most
        LOOP_MAX_PERIOD tokens that already covers max(loop_span, 2p) tokens (empty:
        none)."""
        tail, runs, need = self._tail, self._runs, self._need
        return {tail[-p] for p in range(1, LOOP_MAX_PERIOD + 1) if runs[p] >= need[p]}

    def advance(self, token: int) -> None:
        """The request generated `token`: GrammarError if the grammar did not allow it."""
        if self.matcher.is_stopped():
            return  # eos taken: nothing follows
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed here: "
                               f"{self.matcher.get_error()}")
        if self._closers is not None:
            self._follow_json(self._closers.bytes[token] if token < self.vocab_size else b"")
        if self.loop_span:
            tail = self._tail
            for p in range(1, LOOP_MAX_PERIOD + 1):
                self._runs[p] = (self._runs[p] + 1
                                 if len(tail) >= p and tail[-p] == token else 0)
            tail.append(token)
            if len(tail) > 2 * LOOP_MAX_PERIOD:
                del tail[:LOOP_MAX_PERIOD]
            # Set here, once a token, so that a replay restores it and allowed() (called
            # again for the same position) only reads it.
            self._continuations = self._loop_continuations()
            if self._continuations:
                self.loops += 1
                self.closing = self._closers is not None

    def _follow_json(self, raw: bytes) -> None:
        """Whether the reply now stands inside a string (and after a backslash)."""
        while raw:
            if self._in_string:
                end = _string_end(raw, self._escaped)
                if end < 0:
                    escaped = self._escaped
                    for byte in raw:
                        escaped = not escaped and byte == 0x5C
                    self._escaped = escaped
                    return
                self._in_string, self._escaped, raw = False, False, raw[end + 1:]
            else:
                start = raw.find(b'"')
                if start < 0:
                    return
                self._in_string, raw = True, raw[start + 1:]

    @property
    def complete(self) -> bool:
        """The output so far is a whole sentence of the grammar."""
        return bool(self.matcher.is_accepting())
