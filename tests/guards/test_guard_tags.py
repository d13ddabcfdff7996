"""The guards of check_guards.py still fit the tree: tags, tests, transforms and the README.

Static checks only (a few seconds): no guard is removed and no guard's test runs here; the
full check is `.venv/bin/python tests/guards/check_guards.py`. The second half shows that
each check fails on a broken variant (a tag removed or doubled, a misnamed test, a transform
that no longer fits, a README out of step).
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.guards import check_guards as cg

README = cg.REPO / "tests" / "README.md"
TEST = "tests/transports/test_auth.py::test_frames_without_the_key_change_nothing"


@pytest.fixture(scope="module")
def tags() -> dict[str, list[cg.Site]]:
    return cg.find_tags()


def test_every_guard_tag_is_on_exactly_one_line_and_every_tag_is_a_guards(tags):
    assert cg.tag_problems(cg.MUTATIONS, tags) == []


def test_every_test_a_guard_names_exists():
    assert cg.node_id_problems(cg.MUTATIONS) == []


def test_every_mutation_applies_and_changes_the_program(tags):
    assert cg.apply_problems(cg.MUTATIONS, tags) == []


def test_the_readme_threat_table_names_every_guard_and_no_other():
    assert cg.readme_problems(cg.MUTATIONS, README.read_text()) == []


def test_every_edit_is_a_transform_of_a_tagged_statement():
    kinds = (cg.Replace, cg.Condition, cg.Expr, cg.Before, cg.Prepend)
    assert len(cg.MUTATIONS) == 109
    assert [e for m in cg.MUTATIONS for e in m.edits if not isinstance(e, kinds)] == []


# --- each check can fail -------------------------------------------------------------------

def test_tags_are_real_comments_and_one_comment_may_name_several():
    source = ('x = "# guard: in-a-string"\n'
              "y = 1  # why it is so  # guard: one, two.site\n")
    assert cg.tags_in_text(source, ".py") == {"one": [2], "two.site": [2]}
    c_source = "a = b;  /* guard: c-block */\nc = d;  // guard: c-line\n"
    assert cg.tags_in_text(c_source, ".c") == {"c-block": [1], "c-line": [2]}


SNIPPET = """\
def f(a, b):  # guard: prepend
    \"\"\"Doc.\"\"\"
    if (a  # guard: condition
            and b):
        total = g(a,  # guard: replace
                  b)
        return h(a, b)  # guard: expr, before
    return 0
"""


@pytest.mark.parametrize(("edit", "expected"), [
    (cg.Prepend("prepend", "return 1"), '    """Doc."""\n    return 1\n    if (a'),
    (cg.Condition("condition", "False"), "    if (False):\n        total"),
    (cg.Replace("replace", "total = 0"), "        total = 0\n        return h"),
    (cg.Delete("replace"), "        pass\n        return h"),
    (cg.Expr("expr", "h(a, b)", "0"), "        return (0)  # guard"),
    (cg.Before("before", "x = 1\nraise E"), "        x = 1\n        raise E\n        return h"),
], ids=["prepend", "condition", "replace", "delete", "expr", "before"])
def test_each_transform_acts_on_the_tagged_statement_at_its_indentation(edit, expected):
    line = cg.tags_in_text(SNIPPET, ".py")[edit.tag][0]
    assert expected in edit.apply(SNIPPET, line, ".py")


def test_a_tag_on_a_comment_line_is_refused():
    source = "if a:\n    # guard: x\n    b = 1\n"
    with pytest.raises(cg.GuardError, match="comment"):
        cg.Delete("x").apply(source, 2, ".py")


def test_a_removed_doubled_or_unknown_tag_is_reported(tags):
    removed = {k: v for k, v in tags.items() if k != "fence"}
    assert any("'fence'" in p and "nowhere" in p
               for p in cg.tag_problems(cg.MUTATIONS, removed))
    doubled = {**tags, "epoch": [*tags["epoch"], cg.Site("transports/core.py", 1)]}
    assert any("'epoch'" in p and "transports/core.py:1" in p
               for p in cg.tag_problems(cg.MUTATIONS, doubled))
    unknown = {**tags, "no-such-guard": [cg.Site("kvstore/pool.py", 1)]}
    assert any("unknown tag 'no-such-guard'" in p
               for p in cg.tag_problems(cg.MUTATIONS, unknown))
    # A site tag belongs to its own guard (or is another guard's own tag).
    stray = [dataclasses.replace(cg.MUTATIONS[0], edits=(cg.Delete("admission-decides"),
                                                         cg.Delete("fence.elsewhere")))]
    assert any("'fence.elsewhere'" in p for p in cg.tag_problems(stray, tags))


def test_a_misnamed_test_is_reported():
    m = dataclasses.replace(cg.MUTATIONS[0], tests=(
        TEST,                                                       # exists
        TEST + "[tcp]",                                             # parametrised: allowed
        "tests/transports/test_auth.py::test_frames_without_a_key",  # no such function
        "tests/transports/test_no_such_file.py",                    # no such file
        "tests/no_such_folder"))
    problems = cg.node_id_problems([m])
    assert len(problems) == 3, problems


def test_a_transform_that_no_longer_fits_is_reported(tags):
    def problems(*edits: cg.Edit) -> list[str]:
        return cg.apply_problems([cg.Mutation("fence", "", edits, (TEST,))], tags)

    assert problems(cg.Replace("fence", "return")) == []
    assert "holds 0 expressions" in problems(cg.Expr("fence", "no_such_name", "x"))[0]
    assert "not an if or while" in problems(cg.Condition("fence", "False"))[0]
    assert "changes nothing" in problems(
        cg.Replace("fence", 'self.fail(slot, Reason.FENCED, "fenced by the receiver")'))[0]
    assert "unparseable" in problems(cg.Replace("fence", "return ("))[0]
    assert "not a def header" in problems(cg.Prepend("fence", "return"))[0]
    assert "must be on exactly one line" in problems(cg.Delete("no-such-tag"))[0]
    # An elif's node runs to the end of its chain: only its condition may change.
    assert "elif" in cg.apply_problems(
        [cg.Mutation("progress-liveness", "", (cg.Delete("progress-liveness"),), (TEST,))],
        tags)[0]


def test_a_readme_out_of_step_is_reported():
    def readme(*guards: str, extra_row: str = "") -> str:
        rows = "".join(f"| a threat | a test | a check (guard `{g}`) |\n" for g in guards)
        return (f"# tests\n\n{cg.THREATS_HEADING}\n\n| threat | test | guard it exercises |\n"
                f"|---|---|---|\n{rows}{extra_row}\n## Next\n")

    names = [m.name for m in cg.MUTATIONS]
    assert cg.readme_problems(cg.MUTATIONS, readme(*names)) == []
    assert cg.readme_problems(cg.MUTATIONS, readme(*names[1:])) == [
        f"guard {names[0]!r} is named nowhere in tests/README.md's threat table"]
    assert cg.readme_problems(cg.MUTATIONS, readme(*names, "frame-hmac")) == [
        "tests/README.md names guard 'frame-hmac', which check_guards.py does not have"]
    assert "has 2 columns" in cg.readme_problems(
        cg.MUTATIONS, readme(*names, extra_row="| a threat | a test |\n"))[0]
