"""The JSON-Schema-Test-Suite (draft 2020-12) against the grammar pdmesh compiles for a
`json_schema` response format: each schema through `Grammars.constraint`, each instance fed
byte by byte through the tiny model's byte-level vocabulary, reading the mask the sampler
applies; the grammar must take the whole text as a complete reply exactly when the suite
calls the instance valid. The cases are in data/jsonschema_suite/cases.json (written by
select.py there, which also names the suite's commit).

An instance is written as the grammar writes JSON: json.dumps's separators (JSON_DEFAULTS,
no other whitespace), non-ASCII characters as UTF-8 rather than \\u escapes (what a
model samples; llguidance matches `pattern`, `const` and lengths against the characters),
and an object's keys in the order the schema declares them (llguidance fixes the order of
declared properties; undeclared ones follow). Where the grammar and the suite disagree on
purpose, DEVIATIONS says why: "under" is a valid instance the grammar refuses (a
restriction on what can be generated), "over" an invalid one it lets through (output that
would fail validation). Every other disagreement fails, and so does a listed one that is
gone.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from pdmesh.services.engine.grammar import GrammarError, Grammars, grammar_text
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m
from tests.support.grammar import takes

DATA = json.loads((Path(__file__).parent / "data" / "jsonschema_suite" / "cases.json")
                  .read_text(encoding="utf-8"))
# The schema's meaning alone: no loop guard (byte tokens make the suite's repeated items,
# `[{"foo": null}, {"foo": null}, ...]`, look like a loop of many tokens).
GRAMMARS = Grammars(ByteTokenizer(), loop_span=0)

Key = tuple[str, str, str]  # (file, case description, test description)
_SPELLING = "a number in const / enum is generated in one spelling: {} only, not {}"
_FORMAT = "format is enforced (llguidance), where 2020-12 makes it an annotation by default"
DEVIATIONS: dict[Key, tuple[str, str]] = {
    # under-accepting: valid instances the grammar refuses
    ("const.json", "const with object", "same object with different property order is valid"):
        ("under", "an object in const / enum is generated with its own key order only"),
    ("const.json", "const with 0 does not match other zero-like types", "float zero is valid"):
        ("under", _SPELLING.format("0", "0.0")),
    ("const.json", "const with 1 does not match true", "float one is valid"):
        ("under", _SPELLING.format("1", "1.0")),
    ("const.json", "const with -2.0 matches integer and float types", "float -2.0 is valid"):
        ("under", _SPELLING.format("-2", "-2.0")),
    ("const.json", "float and integers are equal up to 64-bit representation limits",
     "float is valid"):
        ("under", _SPELLING.format("9007199254740992", "9007199254740992.0")),
    ("enum.json", "enum with 0 does not match false", "float zero is valid"):
        ("under", _SPELLING.format("0", "0.0")),
    ("enum.json", "enum with [0] does not match [false]", "[0.0] is valid"):
        ("under", _SPELLING.format("[0]", "[0.0]")),
    ("enum.json", "enum with 1 does not match true", "float one is valid"):
        ("under", _SPELLING.format("1", "1.0")),
    ("enum.json", "enum with [1] does not match [true]", "[1.0] is valid"):
        ("under", _SPELLING.format("[1]", "[1.0]")),
    ("type.json", "integer type matches integers",
     "a float with zero fractional part is an integer"):
        ("under", "an integer is generated without a fraction: 1, not 1.0"),
    **{("format.json", f"{name} format", f"invalid {name} string is only an annotation by "
        "default"): ("under", _FORMAT)
       for name in ("email", "ipv4", "ipv6", "hostname", "date", "date-time", "time", "uri",
                    "uuid", "duration")},
    # over-accepting (invalid instances the grammar lets through): none
}


def _property_order(schema: Any) -> dict[str, int]:
    """Each property name's rank in the order llguidance generates them: the names of every
    `properties` map in the order the schema is written (merged schemas keep it), then those
    only `required` names."""
    declared: list[str] = []
    required: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "properties" and isinstance(value, dict):
                    declared.extend(value)
                elif key == "required" and isinstance(value, list):
                    required.extend(v for v in value if isinstance(v, str))
                walk(value)

    walk(schema)
    order: dict[str, int] = {}
    for name in declared + required:
        order.setdefault(name, len(order))
    return order


def _ordered(data: Any, order: dict[str, int]) -> Any:
    """`data` with each object's keys in `order` (keys it does not rank last, as they were)."""
    if isinstance(data, list):
        return [_ordered(item, order) for item in data]
    if isinstance(data, dict):
        keys = sorted(data, key=lambda k: order.get(k, len(order)))  # stable: the rest as is
        return {k: _ordered(data[k], order) for k in keys}
    return data


def text_of(schema: Any, data: Any) -> str:
    """`data` as the grammar for `schema` writes it."""
    return json.dumps(_ordered(data, _property_order(schema)), separators=(", ", ": "),
                      ensure_ascii=False)


@functools.cache
def accepted() -> dict[Key, bool]:
    """Whether the grammar takes each instance, through a fresh constraint each as a request
    has (the schema's grammar text is built once: `Grammars` caches it)."""
    out: dict[Key, bool] = {}
    for case in DATA["cases"]:
        structured = m.Structured(kind="json", spec=json.dumps(case["schema"]))
        for test in case["tests"]:
            out[case["file"], case["case"], test["test"]] = takes(
                GRAMMARS.constraint(structured), text_of(case["schema"], test["data"]))
    return out


def _valid() -> dict[Key, bool]:
    """The suite's verdict on each instance."""
    return {(case["file"], case["case"], test["test"]): test["valid"]
            for case in DATA["cases"] for test in case["tests"]}


def _shown(key: Key) -> str:
    """The schema and the text of the instance `key` names, for a failure's message."""
    for case in DATA["cases"]:
        for test in case["tests"]:
            if (case["file"], case["case"], test["test"]) == key:
                return (f"schema {json.dumps(case['schema'], ensure_ascii=False)}, "
                        f"text {text_of(case['schema'], test['data'])}")
    return "not in cases.json"


def test_the_grammar_agrees_with_the_suite_but_for_the_deviations() -> None:
    """Exactly the listed instances disagree, each the listed way."""
    valid = _valid()
    found = {key: "over" if took else "under"
             for key, took in accepted().items() if took != valid[key]}
    listed = {key: kind for key, (kind, _) in DEVIATIONS.items()}
    new = {key: kind for key, kind in found.items() if listed.get(key) != kind}
    gone = {key: kind for key, kind in listed.items() if found.get(key) != kind}
    lines = [f"  {kind}-accepting: {key} ({_shown(key)})" for key, kind in new.items()]
    lines += [f"  listed but agrees now: {key}" for key in gone]
    assert not new and not gone, "\n" + "\n".join(lines)


def test_nothing_invalid_is_let_through() -> None:
    """No instance the suite calls invalid can be generated, listed as a deviation or not:
    an over-accepting disagreement is a bug to fix, not a deviation to keep."""
    assert not [key for key, (kind, _) in DEVIATIONS.items() if kind != "under"]
    valid = _valid()
    assert not [key for key, took in accepted().items() if took and not valid[key]]


def test_the_suite_selection_is_whole() -> None:
    """cases.json's counts are its own, each instance is told apart by its key, and every
    deviation names one of them."""
    counts = DATA["counts"]
    assert counts["cases"] == len(DATA["cases"]) > 100
    assert counts["instances"] == len(_valid()) == sum(len(c["tests"]) for c in DATA["cases"])
    assert counts["refused"] == len(DATA["refused"])
    assert counts["skipped"] == len(DATA["skipped"])
    assert sum(counts["refused_by_keyword"].values()) == counts["refused"]
    assert sum(counts["skipped_by_keyword"].values()) == counts["skipped"]
    assert len(_valid()) == len(accepted())
    assert all(key in _valid() for key in DEVIATIONS)


@pytest.mark.parametrize("entry", DATA["refused"] + DATA["skipped"],
                         ids=lambda e: f"{e['file']}:{e['case']}")
def test_a_schema_the_grammar_cannot_hold_is_refused(entry: dict[str, Any]) -> None:
    """A 400 at the gateway (`Grammars.check`) and at a worker (`Grammars.constraint`), a
    GrammarError each time; building the grammar's text raises nothing else."""
    structured = m.Structured(kind="json", spec=json.dumps(entry["schema"]))
    try:
        grammar_text(structured)  # llguidance checks the schema when it compiles the grammar
    except GrammarError:
        pass
    with pytest.raises(GrammarError):
        GRAMMARS.check(structured)
    with pytest.raises(GrammarError):
        GRAMMARS.constraint(structured)
