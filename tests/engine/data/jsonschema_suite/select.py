"""Writes cases.json: the JSON-Schema-Test-Suite's draft 2020-12 cases that a generation
grammar can be held to, for tests/engine/test_grammar_compliance.py.

    .venv/bin/python tests/engine/data/jsonschema_suite/select.py SUITE [--commit HASH]

SUITE is the suite's `tests/draft2020-12` folder in a checkout, or the suite's git
directory (a bare clone; the folder is then read from HEAD with `git show`). The files in
`optional/` are left out. A file is *applicable* when its keyword is one llguidance turns into
grammar (its docs/json_schema.md, "Supported JSON schema features"), or an annotation or
reference a grammar can follow; each of its cases is compiled with pdmesh's own path
(`Grammars.check`, the gateway's 400) and goes to `cases` when it compiles, to `refused`
(with the keyword the error names) when it does not. The cases of the other files are
`skipped`, with their file's keyword; the test checks that pdmesh refuses them too, so that
none of them is served without being checked here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

SUITE_REPO = "json-schema-org/JSON-Schema-Test-Suite"
SUITE_DIR = "tests/draft2020-12"
HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "cases.json"
# The files whose keyword a grammar enforces (type, enum, const, object, array, string and
# number keywords, anyOf / oneOf / allOf, local $ref / $defs / $anchor, format, boolean
# schemas), and those of annotations that change nothing (content, default).
APPLICABLE = frozenset({
    "additionalProperties", "allOf", "anchor", "anyOf", "boolean_schema", "const", "content",
    "default", "defs", "enum", "exclusiveMaximum", "exclusiveMinimum", "format",
    "infinite-loop-detection", "items", "maxItems", "maxLength", "maxProperties", "maximum",
    "minItems", "minLength", "minProperties", "minimum", "multipleOf", "oneOf", "pattern",
    "patternProperties", "prefixItems", "properties", "ref", "required", "type"})
# Why each other file is not: keywords llguidance does not implement, or schemas fetched
# from elsewhere.
SKIPPED = {
    "contains": "contains", "maxContains": "contains", "minContains": "contains",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dynamicRef": "$dynamicRef", "if-then-else": "if/then/else", "not": "not",
    "propertyNames": "propertyNames", "refRemote": "remote $ref",
    "unevaluatedItems": "unevaluatedItems", "unevaluatedProperties": "unevaluatedProperties",
    "uniqueItems": "uniqueItems", "vocabulary": "$vocabulary (remote metaschema)"}


def read_suite(source: Path) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """{file name: its cases} of the draft's folder (optional/ left out), and the commit
    when `source` is a git directory or inside a checkout."""
    import subprocess  # here, not above: this file's own name is `select`

    if (source / "HEAD").is_file() and (source / "objects").is_dir():  # a git directory
        def git(*args: str) -> str:
            return subprocess.run(["git", f"--git-dir={source}", *args], check=True,
                                  capture_output=True, text=True).stdout

        names = git("ls-tree", "--name-only", f"HEAD:{SUITE_DIR}").split()
        files = {name: json.loads(git("show", f"HEAD:{SUITE_DIR}/{name}"))
                 for name in names if name.endswith(".json")}
        return files, git("rev-parse", "HEAD").strip()
    files = {path.name: json.loads(path.read_text(encoding="utf-8"))
             for path in sorted(source.glob("*.json"))}
    found = subprocess.run(["git", "-C", str(source), "rev-parse", "--show-toplevel",
                            "HEAD"], capture_output=True, text=True)
    top, _, commit = found.stdout.strip().partition("\n")
    in_checkout = found.returncode == 0 and Path(top) / SUITE_DIR == source.resolve()
    return files, commit if in_checkout else None  # not another repository's commit


def refusal_keyword(error: str, stem: str) -> str:
    """The keyword a compile error of llguidance (or pdmesh) names, in a few words."""
    if "Unimplemented keys:" in error:
        keys = json.loads(error.split("Unimplemented keys:", 1)[1].strip().split("\n")[0])
        return ", ".join(keys)
    if "Unknown format:" in error:
        return "format: " + error.split("Unknown format:", 1)[1].strip().split()[0]
    if "oneOf constraints are not supported" in error:
        return "oneOf (not provably exclusive)"
    if "Unsatisfiable schema" in error:
        return "unsatisfiable schema (false, empty enum)"
    if "not present in a registry" in error:
        return "remote $ref"
    if "Expected positive integer for" in error:
        return error.split("for '", 1)[1].split("'")[0] + " (a decimal value)"
    if "are not disjoint" in error:
        return "patternProperties (overlapping patterns)"
    if "'multipleOf' has too many digits" in error:
        return "multipleOf (too many digits)"
    if "must be an object" in error:
        return "boolean schema (top level)"
    return stem


def select(files: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The cases.json document (the `suite` entry filled in by the caller)."""
    from pdmesh.services.engine.grammar import GrammarError, Grammars
    from pdmesh.services.engine.tokenizer import ByteTokenizer
    from pdmesh.services.protocol import messages as m

    grammars = Grammars(ByteTokenizer())
    cases: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for name, file_cases in sorted(files.items()):
        stem = name.removesuffix(".json")
        if stem not in APPLICABLE and stem not in SKIPPED:
            raise SystemExit(f"{name}: a file neither APPLICABLE nor SKIPPED; decide which")
        for case in file_cases:
            where = {"file": name, "case": case["description"]}
            if stem in SKIPPED:
                skipped.append({**where, "keyword": SKIPPED[stem], "schema": case["schema"]})
                continue
            try:
                grammars.check(m.Structured(kind="json", spec=json.dumps(case["schema"])))
            except GrammarError as exc:
                error = str(exc)
                refused.append({**where, "keyword": refusal_keyword(error, stem),
                                "error": error.split("\n")[0][:200],
                                "schema": case["schema"]})
                continue
            cases.append({**where, "schema": case["schema"], "tests": [
                {"test": t["description"], "data": t["data"], "valid": t["valid"]}
                for t in case["tests"]]})
    return {
        "counts": {
            "cases": len(cases), "instances": sum(len(c["tests"]) for c in cases),
            "refused": len(refused), "skipped": len(skipped),
            "refused_by_keyword": dict(sorted(Counter(r["keyword"] for r in refused).items())),
            "skipped_by_keyword": dict(sorted(Counter(s["keyword"] for s in skipped).items())),
        },
        "cases": cases, "refused": refused, "skipped": skipped}


def dump(document: dict[str, Any]) -> str:
    """JSON with one case (or refused / skipped schema) a line: small, and a change to the
    suite shows as a change to its lines."""
    lines = ["{"]
    for i, (key, value) in enumerate(document.items()):
        end = "," if i < len(document) - 1 else ""
        if isinstance(value, list):
            rows = [json.dumps(row, ensure_ascii=False) for row in value]
            lines.append(f" {json.dumps(key)}: [")
            lines += [f"  {row}," for row in rows[:-1]] + [f"  {row}" for row in rows[-1:]]
            lines.append(f" ]{end}")
        else:
            text = json.dumps(value, ensure_ascii=False, indent=1).replace("\n", "\n ")
            lines.append(f" {json.dumps(key)}: {text}{end}")
    return "\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", type=Path, help=f"the suite's {SUITE_DIR} folder, or its "
                        "git directory")
    parser.add_argument("--commit", help="the suite's commit (found by git when not given)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    files, commit = read_suite(args.suite)
    commit = args.commit or commit
    if not commit:
        raise SystemExit("the suite's commit is unknown: pass --commit")
    import llguidance

    document = {"suite": {"repo": SUITE_REPO, "commit": commit, "dir": SUITE_DIR,
                          "llguidance": llguidance.__version__}, **select(files)}
    args.output.write_text(dump(document), encoding="utf-8")
    counts = document["counts"]
    print(f"{args.output}: {counts['cases']} cases ({counts['instances']} instances), "
          f"{counts['refused']} refused, {counts['skipped']} skipped")


if __name__ == "__main__":
    # Run as a script, this folder leads sys.path, where this file would stand in for the
    # standard library's `select` (which subprocess and asyncio import): drop it first.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    main()
