"""Show that each isolation guard is load-bearing: remove it, run its test, expect a failure.

    .venv/bin/python tests/guards/check_guards.py            # all 75 (~21 min on 2 cores)
    .venv/bin/python tests/guards/check_guards.py fence epoch  # some of them

Guards are found by tag, not by their text. A guarded statement carries a comment at the end
of one of its code lines, `# guard: <tag>` (in C `/* guard: <tag> */` or `// guard: <tag>`);
one comment may name several tags, separated by commas. A guard's first edit acts on the tag
that is its own name; an edit elsewhere acts on a site tag `<name>.<site>` (`stream-pause.run`)
or on another guard's own tag, where removing this guard means removing that one too.
Every tag is on exactly one line of the tree (tests/guards/test_guard_tags.py checks it).

An edit is a tag and a transform of the statement the tagged line belongs to (the innermost
statement whose lines include it, found with `ast`, so multi-line statements work):

    Replace(tag, code)     the whole statement becomes `code` (re-indented to the statement's)
    Delete(tag)            the statement becomes `pass`
    Condition(tag, expr)   the test of the `if`/`elif`/`while` becomes `expr`
    Expr(tag, old, new)    the one sub-expression equal to `old` (compared as syntax trees,
                           not as text) that lies on the tagged line becomes `(new)`; in C the
                           tagged line must hold `old` exactly once
    Before(tag, code)      `code` goes in front of the statement
    Prepend(tag, code)     `code` becomes the first statement (after the docstring) of the
                           function whose `def` header holds the tag

Nothing is located by searching for source text: an edit that cannot find its tag, or a
transform that does not fit the tagged statement, fails loudly (STALE) before any test runs.
Each mutation applies its edits, runs the named tests with pytest, and restores the files in
`finally`. A guard passes when its tests FAIL with the guard removed (they pass on the
untouched tree: `make test`). A developer tool, not part of the suite: it edits the working
tree while it runs.
"""

from __future__ import annotations

import ast
import functools
import io
import os
import re
import subprocess
import sys
import textwrap
import time
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TAG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*(?:\.[a-z0-9]+(?:-[a-z0-9]+)*)?")
_PY_TAG = re.compile(r"#\s*guard:(?P<names>[^#]*)$")
_C_TAG = re.compile(r"/\*\s*guard:(?P<block>.*?)\*/|//\s*guard:(?P<line>.*)$")
C_SUFFIXES = (".c", ".h")
_SKIP_DIRS = {"build", "dist", "node_modules", "__pycache__"}


class GuardError(Exception):
    """A mutation that cannot be applied: its tag is missing or its transform does not fit."""


@dataclass(frozen=True)
class Site:
    path: str  # relative to the repository root
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


# --- tags ----------------------------------------------------------------------------------

def _split_names(raw: str) -> list[str]:
    return [name.strip() for name in raw.split(",") if name.strip()] or [raw.strip()]


@functools.lru_cache(maxsize=256)
def tags_in_text(text: str, suffix: str) -> dict[str, list[int]]:
    """Every tag in one file's text and the lines it is on (Python: real comments only).
    Cached, as `_parse` is: the static checks look at each original file many times."""
    found: dict[str, list[int]] = {}
    if "guard:" not in text:
        return found
    if suffix == ".py":
        comments = [(tok.start[0], tok.string) for tok in
                    tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT]
        for line, comment in comments:
            match = _PY_TAG.search(comment)
            if match:
                for name in _split_names(match["names"]):
                    found.setdefault(name, []).append(line)
    else:
        for line, code in enumerate(text.splitlines(), 1):
            for match in _C_TAG.finditer(code):
                for name in _split_names(match["block"] or match["line"] or ""):
                    found.setdefault(name, []).append(line)
    return found


def source_files(root: Path) -> Iterable[Path]:
    """Python and C sources, outside hidden folders (.venv, .git) and build outputs."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in _SKIP_DIRS
                                                 or d.endswith(".egg-info")))
        for name in sorted(files):
            if name.endswith(".py") or name.endswith(C_SUFFIXES):
                yield Path(folder, name)


def find_tags(root: Path = REPO) -> dict[str, list[Site]]:
    """Every tag in the tree (Python and C sources) and the sites it is on."""
    index: dict[str, list[Site]] = {}
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        for name, lines in tags_in_text(path.read_text(), path.suffix).items():
            index.setdefault(name, []).extend(Site(rel, line) for line in lines)
    return index


# --- transforms ----------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _parse(text: str) -> ast.Module:
    return ast.parse(text)  # never modified: callers only read it


def _blocks(stmt: ast.stmt) -> Iterable[list[ast.stmt]]:
    for field in ("body", "orelse", "finalbody"):
        block = getattr(stmt, field, None)
        if isinstance(block, list):
            yield block
    for holder in [*getattr(stmt, "handlers", ()), *getattr(stmt, "cases", ())]:
        yield holder.body


def statement_at(tree: ast.Module, line: int) -> ast.stmt:
    """The innermost statement whose lines include `line`."""
    found, block = None, tree.body
    while True:
        inner = next((s for s in block if s.lineno <= line <= s.end_lineno), None)
        if inner is None:
            break
        found, block = inner, [s for b in _blocks(inner) for s in b]
    if found is None:
        raise GuardError(f"line {line} is in no statement")
    return found


def _col(text: str, byte_offset: int) -> int:
    """ast columns count UTF-8 bytes; str slicing counts characters."""
    return len(text.encode()[:byte_offset].decode())


def _indented(code: str, indent: str) -> list[str]:
    body = textwrap.dedent(code).strip("\n")
    return [(indent + ln if ln.strip() else "") + "\n" for ln in body.split("\n")]


def _starting_indent(lines: list[str], stmt: ast.stmt) -> str:
    first = lines[stmt.lineno - 1]
    indent = first[:len(first) - len(first.lstrip())]
    if _col(first, stmt.col_offset) != len(indent):
        raise GuardError(f"the statement on line {stmt.lineno} does not start its line")
    return indent


def _no_elif(lines: list[str], stmt: ast.stmt) -> None:
    if isinstance(stmt, ast.If) and lines[stmt.lineno - 1].lstrip().startswith("elif"):
        raise GuardError(f"line {stmt.lineno} is an elif branch (its node runs to the end "
                         "of the chain): use Condition")


def _replace_span(lines: list[str], node: ast.AST, text: str) -> list[str]:
    first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
    joined = (first[:_col(first, node.col_offset)] + text
              + last[_col(last, node.end_col_offset):])
    return [*lines[:node.lineno - 1], *joined.splitlines(keepends=True), *lines[node.end_lineno:]]


@dataclass(frozen=True)
class Edit:
    tag: str

    def apply(self, text: str, line: int, suffix: str) -> str:
        if suffix != ".py":
            raise GuardError(f"{type(self).__name__} edits Python only")
        lines = text.splitlines(keepends=True)
        if lines[line - 1].lstrip().startswith("#"):
            # A comment line inside a block would name the whole block's statement.
            raise GuardError(f"line {line} is a comment: a tag ends a line of code")
        return "".join(self.edit(lines, statement_at(_parse(text), line), line))

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        raise NotImplementedError


@dataclass(frozen=True)
class Replace(Edit):
    """The whole tagged statement becomes `code`."""

    code: str

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        _no_elif(lines, stmt)
        indent = _starting_indent(lines, stmt)
        last = lines[stmt.end_lineno - 1]
        rest = last[_col(last, stmt.end_col_offset):].strip()
        if rest and not rest.startswith("#"):
            raise GuardError(f"the statement ending on line {stmt.end_lineno} shares it")
        return [*lines[:stmt.lineno - 1], *_indented(self.code, indent),
                *lines[stmt.end_lineno:]]


def Delete(tag: str) -> Replace:
    """The tagged statement is removed (it becomes `pass`, valid in any block)."""
    return Replace(tag, "pass")


@dataclass(frozen=True)
class Condition(Edit):
    """The test of the tagged `if`/`elif`/`while` becomes `test`."""

    test: str

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        if not isinstance(stmt, (ast.If, ast.While)):
            raise GuardError(f"line {line} is in a {type(stmt).__name__}, not an if or while")
        if not stmt.lineno <= line <= stmt.test.end_lineno:
            raise GuardError(f"line {line} is not on the condition of line {stmt.lineno}")
        return _replace_span(lines, stmt.test, self.test)


@dataclass(frozen=True)
class Expr(Edit):
    """The sub-expression equal to `old` on the tagged line becomes `(new)`."""

    old: str
    new: str

    def apply(self, text: str, line: int, suffix: str) -> str:
        if suffix == ".py":
            return super().apply(text, line, suffix)
        lines = text.splitlines(keepends=True)
        if lines[line - 1].count(self.old) != 1:
            raise GuardError(f"line {line} does not hold {self.old!r} exactly once")
        lines[line - 1] = lines[line - 1].replace(self.old, self.new)
        return "".join(lines)

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        try:
            wanted = ast.dump(ast.parse(self.old, mode="eval").body)
        except SyntaxError as exc:
            raise GuardError(f"{self.old!r} is not an expression: {exc}") from None
        hits = [n for n in ast.walk(stmt) if isinstance(n, ast.expr)
                and n.lineno <= line <= n.end_lineno and ast.dump(n) == wanted]
        if len(hits) != 1:
            raise GuardError(f"line {line} holds {len(hits)} expressions {self.old!r}, not 1")
        return _replace_span(lines, hits[0], f"({self.new})")


@dataclass(frozen=True)
class Before(Edit):
    """`code` goes in front of the tagged statement, at its indentation."""

    code: str

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        _no_elif(lines, stmt)
        indent = _starting_indent(lines, stmt)
        return [*lines[:stmt.lineno - 1], *_indented(self.code, indent),
                *lines[stmt.lineno - 1:]]


@dataclass(frozen=True)
class Prepend(Edit):
    """`code` becomes the first statement (after the docstring) of the tagged function."""

    code: str

    def edit(self, lines: list[str], stmt: ast.stmt, line: int) -> list[str]:
        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise GuardError(f"line {line} is in a {type(stmt).__name__}, not a def header")
        if line >= stmt.body[0].lineno:
            raise GuardError(f"line {line} is in the body of {stmt.name}, not its header")
        body = stmt.body
        doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
               and isinstance(body[0].value.value, str))
        indent = _starting_indent(lines, body[0])
        at = body[1].lineno - 1 if doc and len(body) > 1 else (
            body[0].end_lineno if doc else body[0].lineno - 1)
        return [*lines[:at], *_indented(self.code, indent), *lines[at:]]


# --- mutations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Mutation:
    """Apply `edits` (the first acts on the tag `name`) and run `tests`, which must fail."""

    name: str
    guard: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


def the_site(tags: dict[str, list[Site]], tag: str) -> Site:
    sites = tags.get(tag, [])
    if len(sites) != 1:
        where = ", ".join(map(str, sites)) or "nowhere"
        raise GuardError(f"tag {tag!r} must be on exactly one line, is on {where}")
    return sites[0]


def _enclosing_def(tree: ast.Module, line: int) -> ast.AST:
    """The innermost function whose lines include `line` (the module outside any)."""
    found, block = tree, tree.body
    while inner := next((s for s in block if s.lineno <= line <= s.end_lineno), None):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found = inner
        block = [s for b in _blocks(inner) for s in b]
    return found


def _changed(before: str, after: str, line: int) -> bool:
    """Whether an edit at `line` of `before` gave a different, parseable program; raises
    SyntaxError. Edits touch only the function holding that line and keep its indentation,
    so parsing and comparing that function alone is exact, and a few lines, not a whole
    module, are parsed per mutation (keeps the static checks fast)."""
    tree = _parse(before)
    old = _enclosing_def(tree, line)
    if old is tree:
        return ast.dump(ast.parse(after)) != ast.dump(tree)
    shift = after.count("\n") - before.count("\n")
    region = after.splitlines(keepends=True)[old.lineno - 1:old.end_lineno + shift]
    if old.col_offset:  # any indentation opens an `if` block: a method parses as it stands
        parsed = ast.parse("if 1:\n" + "".join(region)).body[0].body
    else:
        parsed = ast.parse("".join(region)).body
    if len(parsed) != 1 or type(parsed[0]) is not type(old) or parsed[0].name != old.name:
        raise SyntaxError(f"the edit runs past the end of {old.name}")
    return ast.dump(old) != ast.dump(parsed[0])


def mutate(m: Mutation, tags: dict[str, list[Site]],
           root: Path = REPO) -> dict[str, tuple[str, str]]:
    """{path: (original, mutated)} for every file `m` edits; raises GuardError."""
    files: dict[str, tuple[str, str]] = {}
    for edit in m.edits:
        path = the_site(tags, edit.tag).path
        original, text = files.get(path) or ((root / path).read_text(),) * 2
        suffix = Path(path).suffix
        # The tag is looked up again in this file's text: an earlier edit may have moved it.
        lines = tags_in_text(text, suffix).get(edit.tag, [])
        if len(lines) != 1:
            raise GuardError(f"{m.name}: tag {edit.tag!r} lost by an earlier edit of {path}")
        try:
            new = edit.apply(text, lines[0], suffix)
        except GuardError as exc:
            raise GuardError(f"{m.name}: {path}:{lines[0]} ({edit.tag}): {exc}") from None
        if suffix == ".py":
            try:
                changed = _changed(text, new, lines[0])
            except SyntaxError as exc:
                raise GuardError(f"{m.name}: {edit.tag} leaves {path} unparseable: "
                                 f"{exc}") from None
        else:
            changed = new != text
        if not changed:
            raise GuardError(f"{m.name}: {edit.tag} changes nothing in {path}")
        files[path] = (original, new)
    return files


ISO = "tests/isolation/"
FAMILIES = "tests/engine/test_families.py::test_logits_and_greedy_tokens_equal_transformers"
MUTATIONS = [
    # The policy's later checks (prefill and decode gates) would still reject, so the
    # mutation removes the decision itself: every request goes straight to the workers.
    # The gateway applies the same context rule before any control message (guard
    # gateway-context): a layer in front of this one, removed with it.
    Mutation("admission-decides", "admission decides before any worker hears of it (I1)",
             (Replace("admission-decides",
                      "decision = Admitted(prefill=prefills[0], decode=decodes[0])"),
              Replace("gateway-context", "over = None")),
             (ISO + "test_admission_guards.py::"
              "test_over_capacity_prompt_is_rejected_before_any_worker_hears_of_it",)),
    Mutation("capacity-audit", "start-up audit clamps context to the real pool (I5)",
             (Condition("capacity-audit", "True"),),
             (ISO + "test_admission_guards.py::test_capacity_audit_clamps_to_the_real_pool",)),
    Mutation("decode-gate", "decode refuses what its pool/context cannot hold",
             (Prepend("decode-gate", 'return ""'),),
             (ISO + "test_admission_guards.py::"
              "test_admission_bypassed_the_workers_still_refuse",)),
    # Five checks stop the 1-token stub (commit token count, commit coverage, the per-frame
    # token count, the sender's check of the ACK's echo, the commit digest over every
    # expected page, which a missing page fails too); the mutation removes all of them.
    Mutation("commit-verification", "commit needs the announced token count and every page "
             "(the incident's 1-token stub)",
             (Condition("commit-verification", "False"),
              Condition("commit-verification.pages", "False"),
              Condition("commit-verification.frame", "False"),
              Expr("commit-verification.ack", "h.token_count == plan.num_tokens", "True"),
              Condition("commit-digest", "False")),
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[stub_transfer]",)),
    # Per-page checks and the commit digest back each other up: disable the hash itself.
    Mutation("checksum", "XXH3-64 checksums of every page (and the commit digest)",
             (Expr("checksum", "xxhash.xxh3_64_intdigest", "lambda data: 0"),),
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[corrupt_payload]",)),
    Mutation("commit-digest", "a COMMIT commits only if its digest matches every page's "
             "checksum as landed (the only check of DEFERRED pages: ucx's)",
             (Condition("commit-digest", "False"),),
             ("tests/transports/test_deferred_checksums.py::"
              "test_a_deferred_page_that_differs_from_the_senders_fails_the_commit",)),
    # The commit's own epoch check still fails a wholly stale transfer on the mesh; the
    # conformance test also asserts no stale byte touched the pages.
    Mutation("epoch", "frames must name the live lease's epoch",
             (Condition("epoch", "False"),),
             ("tests/transports/test_conformance.py::test_stale_epoch",)),
    Mutation("fence", "fence: no byte lands in a lease after abort (late write)",
             (Replace("fence", "return"),),
             (ISO + "test_late_write.py::test_late_frames_never_land_in_the_next_lease",)),
    # A slot that already failed (deadline, duplicate connection) while a posted UCX receive
    # into its pages is still in flight: fence() must wait for that write.
    Mutation("fence-inflight", "fence waits for a failed slot's write in flight (late write)",
             (Replace("fence-inflight", "slot = None"),),
             ("tests/transports/test_fence_race.py::"
              "test_table_fence_waits_for_a_write_in_flight_of_a_failed_slot",
              "tests/transports/test_fence_race.py::"
              "test_late_payload_never_lands_in_the_next_lease")),
    Mutation("lease-read-check", "pool read check: owner + epoch + written length (I2)",
             (Expr("lease-read-check", "lease.epoch", "epochs"),),
             ("tests/kvstore",)),
    Mutation("lease-read-check-fast", "the pool's one-comparison epoch check says yes only "
             "when every page carries the lease's epoch (I2)",
             (Replace("lease-read-check-fast", "return True"),),
             ("tests/kvstore",)),
    Mutation("lease-read-check-inline", "the read check's fast path passes only a lease "
             "whose every page carries its epoch (I2)",
             (Expr("lease-read-check-inline", "epochs.tobytes() == cached[1][:8 * count]",
                   "True"),),
             ("tests/kvstore",)),
    Mutation("lease-read-check-inline-written", "the read check's fast path passes only "
             "tokens this lease wrote in this epoch (I2)",
             (Expr("lease-read-check-inline-written",
                   "num_tokens <= self._prefix_written.get(lease.lease_id, 0)", "True"),),
             ("tests/kvstore",)),
    # A decode step checks all its requests at once (check_decode_batch): one gather of
    # every page's epoch, compared with each lease's epoch repeated.
    Mutation("decode-batch-epochs", "a decode step's batched check passes only leases whose "
             "every page read or written carries their epoch (I2)",
             (Replace("decode-batch-epochs", "batch_failed = False"),
              Replace("decode-batch-epochs.concat", "batch_failed = False")),
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("decode-batch-written", "a decode step appends only at a lease's written "
             "length, so it reads only tokens written in this epoch (I2, the incident)",
             (Expr("decode-batch-written", "written.get(lease.lease_id, -1) == position",
                   "True"),),
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("decode-batch-capacity", "a decode step writes only inside the lease's pages",
             (Expr("decode-batch-capacity", "0 <= position < len(lease.page_ids) * size",
                   "True"),),
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("decode-mark-epoch", "marking a decode step's token written checks that its "
             "page carries the lease's epoch (I2)",
             (Expr("decode-mark-epoch", "epochs[page_id] == lease.epoch", "True"),),
             ("tests/kvstore/test_decode_batch_checks.py",)),
    Mutation("lease-write-check", "pool write check of a decode step's one token: the page "
             "carries the lease's epoch (I2)",
             (Delete("lease-write-check"),),
             ("tests/kvstore",)),
    # Admission frees the reservation of a request whose dispatch it cannot send on the
    # reserve subject it may publish to; the old Release on prefill's subject was refused.
    Mutation("payload-cancel", "a reservation whose dispatch exceeds NATS's max_payload is "
             "freed at once under NATS auth (I6)",
             (Replace("payload-cancel", """
                await self.rt.publish(m.release_subject(h.decision.decode.worker_id), m.Release(
                    request_id=h.choice.request_id,
                    reservation_id=h.reservation.reservation_id,
                    outcome=m.Outcome(code=m.Code.INVALID, detail=str(exc))))"""),),
             (ISO + "test_admission_payload.py",)),
    # The native decode attention reads K/V in place through each request's page table:
    # hand every request the last request's pages (a cross-request read, the incident's
    # class of bug) and the oracle tests must see it.
    Mutation("native-page-table", "native decode attention reads only the request's own "
             "pages (I3, I4)",
             (Expr("native-page-table", "self.gather", "[self.gather[-1]] * len(self.gather)"),),
             ("tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched",
              "tests/engine/test_isolation.py::test_disaggregated_equals_reference")),
    # The native K/V append writes through raw addresses: each row's must be its own slot.
    Mutation("native-kv-append", "a decode row's K and V land in its own request's slot "
             "(I3)",
             (Expr("native-kv-append", "slots", "slots[:, :1]"),),
             ("tests/engine/test_native_pointwise.py::"
              "test_the_k_v_append_targets_are_each_rows_own_slot",
              "tests/engine/test_native_pointwise.py::"
              "test_a_decode_step_writes_only_its_rows_own_slots",
              "tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched")),
    Mutation("native-linear-rows", "a decode row's matmul outputs are its own row's (I4: "
             "no request gets another's values)",
             (Expr("native-linear-rows", "sums[a * x_rows + b]", "sums[a * x_rows]"),),
             ("tests/engine/test_native_linear.py::"
              "test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads",
              "tests/engine/test_isolation.py::"
              "test_paged_decode_logits_bits_equal_reference_alone_and_batched")),
    Mutation("native-linear-q-rows", "a decode row's quantized matmul outputs are its own "
             "row's (I4: no request gets another's values)",
             (Expr("native-linear-q-rows", "x + r * blocks + b", "x + b"),),
             ("tests/engine/test_quantized.py::"
              "test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads",
              "tests/engine/test_quantized.py::"
              "test_a_model_on_its_blocks_decodes_each_row_as_alone")),
    Mutation("fingerprint-quantized", "the engine fingerprint names decode on quantized blocks "
             "(another path, other bits)",
             (Expr("fingerprint-quantized", '"native-step-q" if quantized else "native-step"',
                   '"native-step"'),),
             ("tests/engine/test_quantized.py::"
              "test_a_model_on_its_blocks_decodes_each_row_as_alone",)),
    # Each model family's own detail, removed, makes its checkpoint answer otherwise than
    # transformers does on the same file (tests/engine/test_families.py).
    Mutation("rope-freq-factors", "Llama 3.1's RoPE frequency rescaling is applied",
             (Delete("rope-freq-factors"),),
             (FAMILIES + "[llama3-safetensors-native]", FAMILIES + "[llama3-gguf-native]")),
    Mutation("qkv-bias-torch", "Qwen2's q/k/v biases are added (prefill, torch decode)",
             (Delete("qkv-bias-torch"),),
             (FAMILIES + "[qwen2-safetensors-torch]",)),
    Mutation("qkv-bias-native", "Qwen2's q/k/v biases are added (native decode step)",
             (Expr("qkv-bias-native", "+= w[6][j]", "+= 0.0f"),),
             (FAMILIES + "[qwen2-safetensors-native]",)),
    Mutation("window-prefill", "a prefill chunk attends within Mistral's sliding window",
             (Delete("window-prefill"),),
             (FAMILIES + "[mistral-safetensors-native]",)),
    Mutation("window-decode-torch", "a torch decode row attends within the sliding window",
             (Expr("window-decode-torch", "keys.shape[2] - window", "0"),),
             (FAMILIES + "[mistral-safetensors-torch]",)),
    Mutation("window-decode-native", "a native decode row attends within the sliding window",
             (Expr("window-decode-native", "window > 0 &&", "0 &&"),),
             ("tests/engine/test_native_attention.py::"
              "test_a_sliding_window_attends_to_the_last_keys_the_same_in_any_layout",
              FAMILIES + "[mistral-safetensors-native]")),
    Mutation("pre-split-regex", "a GGUF is tokenized with its own pre-split regex",
             (Expr("pre-split-regex", "REGEX_SPLITS[pre]", "QWEN2_SPLIT"),),
             ("tests/engine/test_families.py::"
              "test_gguf_tokenizer_equals_transformers[llama-bpe]",)),
    # Prefill's Release and the gateway's Abort (guard abort-on-disconnect) both free decode
    # at once: remove both.
    Mutation("release-on-reject", "a rejection on one side frees the other at once (I6)",
             (Delete("release-on-reject"), Condition("abort-on-disconnect", "False")),
             (ISO + "test_admission_guards.py::"
              "test_asymmetric_prefill_rejection_frees_decode_within_a_second",)),
    Mutation("ticket-signature", "tickets are Ed25519-signed by admission",
             (Condition("ticket-signature", "False"),),
             ("tests/protocol/test_tickets.py",
              ISO + "test_admission_guards.py::test_forged_ticket_is_refused_by_decode")),
    # The authenticated data plane, the dispatch grant, robust listeners.
    Mutation("frame-mac", "every data-plane header is MACed under the reservation's key; "
             "a frame without it changes nothing",
             (Condition("frame-mac", "False"),),
             ("tests/transports/test_auth.py::test_frames_without_the_key_change_nothing",)),
    Mutation("ack-mac", "the sender releases its pages only on an authenticated ACK",
             (Condition("ack-mac", "False"),),
             ("tests/transports/test_auth.py::"
              "test_sender_rejects_an_unauthenticated_ack_and_oversized_reply",)),
    Mutation("reply-bound", "a reply header cannot size an allocation on the sender",
             (Condition("reply-bound", "False"),),
             ("tests/transports/test_auth.py::"
              "test_sender_rejects_an_unauthenticated_ack_and_oversized_reply",)),
    Mutation("drain-bound", "UCX drains no more than live transfers allow",
             (Condition("drain-bound", "False"),),
             ("tests/transports/test_auth.py::test_ucx_drains_no_more_than_live_transfers_allow",)),
    Mutation("dispatch-grant", "prefill refuses a dispatch whose prompt or reservation "
             "differs from what admission granted",
             (Condition("dispatch-grant", "False"),),
             ("tests/protocol/test_tickets.py",)),
    Mutation("accept-loop", "the TCP accept loop survives accept errors (EMFILE)",
             (Expr("accept-loop", "OSError", "ZeroDivisionError"),),
             ("tests/transports/test_listener.py::"
              "test_accept_loop_survives_running_out_of_file_descriptors",)),
    Mutation("header-timeout", "an unbound inbound link must send a header in time",
             (Expr("header-timeout", "timed(self._recv_header(link, None), self.header_timeout_s)",
                   "self._recv_header(link, None)"),),
             ("tests/transports/test_listener.py::"
              "test_idle_connection_flood_is_bounded_in_count_and_time",)),
    Mutation("unbound-cap", "at most max_unbound_links unbound inbound links",
             (Condition("unbound-cap", "False"),),
             ("tests/transports/test_listener.py::"
              "test_idle_connection_flood_is_bounded_in_count_and_time",)),
    Mutation("ready-data-plane", "a worker whose data plane cannot accept reports not ready",
             (Replace("ready-data-plane", "return True"),),
             ("tests/transports/test_listener.py::"
              "test_worker_reports_not_ready_while_its_data_plane_cannot_accept",)),
    Mutation("dead-worker", "gateway ends a stream whose decode worker died",
             (Condition("dead-worker", "False"),),
             (ISO + "test_worker_loss.py::test_decode_killed_mid_stream",
              "tests/gateway/test_loop_liveness.py::"
              "test_a_worker_that_stops_heartbeating_still_fails_its_request")),
    Mutation("fingerprint-pairing", "admission pairs only a prefill and a decode of one "
             "engine fingerprint (two builds would compute different bits)",
             (Expr("fingerprint-pairing", "v.fingerprint", "''"),),
             ("tests/admission/test_fingerprint_pairing.py::"
              "test_a_decode_of_another_fingerprint_is_never_chosen_however_free",
              "tests/admission/test_fingerprint_pairing.py::"
              "test_admission_on_nats_pairs_only_equal_fingerprints")),
    Mutation("avoid-workers", "a resumed request is never placed on a worker its submit "
             "avoids (the workers it lost)",
             (Expr("avoid-workers", "e.beat.worker_id not in avoid", "True"),),
             ("tests/admission/test_avoid_workers.py::"
              "test_a_resumed_request_is_placed_only_on_other_workers",)),
    Mutation("handoff-waits-step", "a drain's hand-off tells the gateway about a request "
             "the engine's step held too (the closing drain would cancel the loop that does)",
             (Replace("handoff-waits-step", "return len(self.requests)"),),
             ("tests/decode/test_hand_off.py::"
              "test_every_request_held_at_the_drain_timeout_is_handed_to_its_gateway",)),
    Mutation("resume-carries-state", "a resumed choice samples on from its sampler's token "
             "index (and counts): the continuation is the stream the lost workers would have "
             "given",
             (Expr("resume-carries-state", "sampling.start_index + len(done)",
                   "sampling.start_index"),),
             ("tests/gateway/test_drain_resume.py::"
              "test_a_lost_workers_choice_resumes_from_the_tokens_it_delivered",
              ISO + "test_worker_loss.py::test_decode_killed_mid_stream")),
    Mutation("resume-avoids-lost", "a choice is never resumed onto the worker it lost",
             (Condition("resume-avoids-lost", "False"),),
             ("tests/gateway/test_drain_resume.py::"
              "test_a_choice_is_not_resumed_onto_the_worker_it_lost",)),
    Mutation("liveness-hears-draining", "a draining worker is alive: its streams finish "
             "there (they are not resumed elsewhere as if it had died)",
             (Delete("liveness-hears-draining"),),
             (ISO + "test_drain.py::test_sigterm_lets_the_stream_finish_then_exits_0",)),
    Mutation("abort-on-disconnect", "a client that leaves aborts its request across the mesh",
             (Condition("abort-on-disconnect", "False"),),
             ("tests/gateway/test_disconnect.py",)),
    # The prefix-cache tests of every layer (the pool's cache first: it fails fastest).
    Mutation("prefix-salt", "prefix-cache keys are per tenant salt (I7)",
             (Expr("prefix-salt", "self._roots.get(cache_salt)",
                   "next(iter(self._roots.values()), None)"),),
             ("tests/kvstore/test_prefix_cache.py", "tests/engine/test_prefix.py",
              "tests/admission/test_prefix_routing.py", ISO + "test_prefix_tenants.py",
              "tests/loadtest/test_bench_prefix.py")),
    Mutation("first-token-range", "the commit's first token is range-checked before any "
             "batch",
             (Condition("first-token-range", "False"),),
             (ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[first_token_out_of_range]",
              ISO + "test_data_plane_faults.py::"
              "test_faulty_transfer_fails_only_that_request[first_token_negative]")),
    Mutation("first-token-grammar", "a structured output's first token is checked against "
             "its grammar before any batch",
             (Condition("first-token-grammar", "False"),),
             (ISO + "test_data_plane_faults.py::"
              "test_first_token_outside_the_grammar_fails_only_that_request",)),
    Mutation("tail-zero", "no earlier tenant's KV leaves prefill in a last page's tail",
             (Delete("tail-zero"),),
             ("tests/prefill/test_tail.py",)),
    # Publishing first (as before) loses the lease when the publish raises.
    Mutation("release-before-telling", "decode frees a lease before it publishes the end",
             (Before("release-before-telling", """
                await self.rt.publish(m.tokens_subject(dreq.request_id), event or m.StreamFailed(
                    request_id=dreq.request_id, outcome=outcome))"""),),
             ("tests/decode/test_release_before_telling.py",)),
    # Decode frees a lease without fencing its reservation first: every reply is still
    # right, and the run's protocol trace (checked by run_mesh) shows the step the model
    # does not allow.
    Mutation("decode-fences", "decode fences a reservation before it frees the lease",
             (Delete("decode-fences"),),
             ("tests/test_ptrace.py::test_a_mesh_traces_every_process",)),
    Mutation("quarantine", "a lease whose fence cannot finish never returns to the free list",
             (Expr("quarantine", "self.pool.quarantine", "self.pool.release"),),
             ("tests/decode/test_release_before_telling.py::"
              "test_a_lease_whose_fence_cannot_finish_is_quarantined_not_reused",)),
    Mutation("unreachable-set-aside", "admission routes around a worker prefill cannot reach",
             (Expr("unreachable-set-aside", "not self.is_set_aside(e.beat, now)", "True"),),
             ("tests/admission/test_registry.py",)),
    Mutation("dev-credentials", "a production start refuses the dev keys and dev tenants",
             (Condition("dev-credentials", "False"),),
             ("tests/ops/test_launcher.py::test_dev_credentials_are_refused_unless_allowed",
              "tests/gateway/test_dev_keys.py::"
              "test_a_copy_of_the_dev_tenants_file_is_refused_without_allow")),
    Mutation("gateway-context", "an over-context prompt is refused before any control "
             "message (no submit over NATS's max payload)",
             (Replace("gateway-context", "over = None"),),
             ("tests/gateway/test_long_prompt.py",)),
    Mutation("nats-auth", "pdmesh up's NATS requires credentials",
             (Replace("nats-auth", """
                self.nats = await self._spawn("nats", [
                    nats_server_binary(), "-a", "127.0.0.1", "-p", str(port),
                    "-m", str(monitor)], os.environ.copy())"""),),
             (ISO + "test_nats_auth.py::test_nats_refuses_a_client_without_credentials",
              ISO + "test_nats_auth.py::test_a_reader_cannot_watch_the_control_plane")),
    Mutation("nats-permissions", "each NATS identity may use only its role's subjects",
             (Replace("nats-permissions", """
                users.append(f"    {{ user: {json.dumps(ident.user)}, "
                             f"password: {json.dumps(ident.password)},\\n"
                             f"      }}")"""),),
             (ISO + "test_nats_auth.py::test_a_reader_cannot_watch_the_control_plane",
              ISO + "test_nats_auth.py::"
              "test_the_gateway_cannot_dispatch_and_no_one_forges_a_heartbeat")),
    Mutation("route-auth", "a NATS node without the route password gets no route",
             (Replace("route-auth", """
                return ("cluster {\\n  name: \\"pdmesh\\"\\n"
                        f"  listen: {json.dumps(f'{listen_host}:{port}')}\\n"
                        f"{tls}  routes: {json.dumps(routes)}\\n}}\\n")"""),),
             (ISO + "test_nats_auth.py::test_cluster_routes_need_the_route_password",)),
    Mutation("tls-first", "a service with a CA never sends its password in clear",
             (Expr("tls-first", "tls is not None", "False"),),
             ("tests/ops/test_certs.py::test_a_service_with_a_ca_never_talks_to_nats_in_clear",)),
    Mutation("colocated-token-range", "a colocated worker rechecks token ids like prefill",
             (Condition("colocated-token-range", "False"),),
             ("tests/colocated/test_gate.py",)),
    Mutation("progress-liveness", "decode frees a reservation whose prefill stopped progressing",
             (Condition("progress-liveness", "False"),),
             ("tests/decode/test_progress_liveness.py::"
              "test_a_reservation_without_progress_is_freed_after_the_stall_limit",)),
    Mutation("stream-read-check", "a streamed send reads a page only after the pool's read check",
             (Delete("stream-read-check"),),
             ("tests/prefill/test_tail.py::"
              "test_a_streamed_send_gets_no_page_before_the_pool_says_it_is_written",)),
    # The same check after each chunk's compute: removed with it.
    Mutation("abort-stops-prefill", "an abort stops the prefill at the next chunk boundary",
             (Expr("abort-stops-prefill", "life.is_terminal", "False"),
              Delete("abort-stops-prefill.after-chunk")),
             ("tests/prefill/test_long_prompts.py::"
              "test_an_abort_mid_prefill_stops_it_within_a_chunk_and_frees_the_leases",)),
    Mutation("stream-pause", "a streamed transfer's link waits across a PAUSE only while "
             "its slot is live (elsewhere the progress timeout holds)",
             (Replace("stream-pause", "paused = False"),
              Replace("stream-pause.run", "paused = False")),
             ("tests/transports/test_streaming.py::"
              "test_pages_released_in_steps_arrive_and_commit_verified",
              "tests/transports/test_streaming.py::"
              "test_fence_between_chunks_stops_the_sender_and_nothing_lands_after",
              "tests/transports/test_streaming.py::"
              "test_receiver_deadline_ends_a_paused_transfer_and_tells_the_sender")),
    Mutation("nixl-staging-copy", "nixl: a page is copied out of staging only while its "
             "transfer is live (a late one-sided write never reaches a page)",
             (Condition("nixl-staging-copy", "True"),),
             ("tests/transports/test_fence_race.py::"
              "test_late_payload_never_lands_in_the_next_lease",)),
    Mutation("nixl-staging-retire", "nixl: a staging region is lent again only after its "
             "sender's release (its writes have ended)",
             (Condition("nixl-staging-retire", "True"),),
             ("tests/transports/test_nixl.py::"
              "test_a_region_is_lent_again_only_after_its_senders_release",)),
    Mutation("nixl-link-proof", "nixl: a staging region (and its NIXL metadata) is lent only "
             "to a sender that proves it holds a live reservation's key",
             (Replace("nixl-link-proof", 'reason, detail = Reason.OK, ""'),),
             ("tests/transports/test_nixl.py::"
              "test_a_peer_without_a_live_reservations_key_gets_no_staging_region",)),
    Mutation("ucx-service-futures", "service processes run ucxx with its futures (an idle "
             "worker's posted UCX receive is not polled by the event loop)",
             (Delete("ucx-service-futures"),),
             ("tests/isolation/test_ucx_mesh.py::"
              "test_idle_workers_do_not_spin_after_transfers[ucx]",)),
    Mutation("reserve-cancel", "a reservation admission gave up on is cancelled on that "
             "decode worker alone (a broadcast Abort also ended the request where the retry "
             "placed it)",
             (Replace("reserve-cancel", """
                await self.rt.publish(m.ABORT_SUBJECT, m.Abort(
                    request_id=choice.request_id,
                    outcome=m.Outcome(code=m.Code.RESERVE_FAILED, detail=str(exc))))"""),),
             ("tests/isolation/test_worker_loss.py::"
              "test_a_decode_answering_after_the_reserve_timeout_costs_the_request_nothing",)),
    Mutation("reserve-cancel-quiet", "decode frees a cancelled reservation without a failure "
             "on the request's token stream (admission answers the client)",
             (Delete("reserve-cancel-quiet"),),
             ("tests/isolation/test_worker_loss.py::"
              "test_a_decode_answering_after_the_reserve_timeout_costs_the_request_nothing",)),
    Mutation("ucx-error-mode", "UCX endpoints without peer error handling only where every "
             "transport survives a lost peer (on InfiniBand an unhandled error can abort "
             "the process)",
             (Replace("ucx-error-mode", 'return "none"'),),
             ("tests/transports/test_ucx_error_mode.py::"
              "test_auto_is_none_only_where_every_ucx_transport_survives_a_lost_peer",)),
    Mutation("loop-turns", "a receiver gives its event loop turns even when the link always "
             "has the next bytes (decode's streams and fence() are not held for a whole "
             "transfer)",
             (Delete("loop-turns"),),
             ("tests/transports/test_loop_turns.py::"
              "test_a_receiver_whose_link_is_always_full_gives_the_loop_turns",)),
    # Containment: a worker reaches only the requests it serves.
    Mutation("private-inbox", "each NATS identity may read its own replies only",
             (Replace("private-inbox", 'inbox = "_INBOX.>"'),),
             (ISO + "test_containment.py::test_no_identity_reads_another_identitys_replies",
              ISO + "test_containment_mesh.py::"
              "test_a_second_prefills_credentials_cannot_touch_a_request_it_does_not_serve")),
    Mutation("stream-mac", "only a request's own workers, holding its stream key, can write "
             "its stream or end or keep alive its reservation",
             (Replace("stream-mac", "return True"),),
             (ISO + "test_containment.py::"
              "test_a_worker_that_does_not_serve_a_request_cannot_write_its_answer",
              "tests/decode/test_progress_liveness.py::"
              "test_progress_and_release_without_the_request_mac_change_nothing")),
    Mutation("heartbeat-subject", "a heartbeat is believed only for the worker and role its "
             "subject names",
             (Condition("heartbeat-subject", "False"),),
             (ISO + "test_containment.py::"
              "test_a_heartbeat_naming_another_worker_is_not_believed",)),
    Mutation("gateway-max-tokens", "the gateway gives the client no more than max_tokens, "
             "whatever decode sends",
             (Condition("gateway-max-tokens", "False"),),
             (ISO + "test_containment.py::test_the_gateway_holds_decode_to_max_tokens",)),
    Mutation("gateway-stop", "the gateway ends the stream at a stop token, whatever decode "
             "sends after it",
             (Condition("gateway-stop", "False"),),
             (ISO + "test_containment.py::test_the_gateway_ends_the_stream_at_a_stop_token",)),
    Mutation("first-token-agrees", "decode's first token must be the one prefill sampled",
             (Condition("first-token-agrees", "False"),),
             (ISO + "test_containment.py::test_decode_must_start_with_the_token_prefill_sampled",)),
    Mutation("first-report-wait", "decode's first token waits for prefill's report of it "
             "when logprobs were asked for (the token is checked against it, its logprobs "
             "are the reply's)",
             (Condition("first-report-wait", "False"),),
             (ISO + "test_containment.py::test_decode_must_start_with_the_token_prefill_sampled"
              "[report-late]",
              ISO + "test_containment.py::"
              "test_a_first_token_report_after_decodes_token_still_gives_its_logprobs")),
    Mutation("progress-advances", "progress keeps a reservation only while it advances (or "
             "the request is still queued)",
             (Condition("progress-advances", "True"),),
             ("tests/decode/test_progress_liveness.py::"
              "test_progress_that_does_not_advance_frees_the_reservation",)),
    # The gateway's event loop: no request body stalls it, a stall blames no worker.
    Mutation("tokenizer-off-loop", "tokenization runs in the tokenizer threads, never on the "
             "gateway's event loop",
             (Replace("tokenizer-off-loop",
                      "future = concurrent.futures.Future()\nfuture.set_result(fn(*args))"),),
             ("tests/gateway/test_loop_tokenize.py::"
              "test_long_tokenizations_do_not_stall_another_tenants_stream[slow-bytes]",)),
    Mutation("tokenizer-budget", "a tenant's text queued in the tokenizer is bounded (429)",
             (Condition("tokenizer-budget", "False"),),
             ("tests/gateway/test_loop_tokenize.py::"
              "test_a_tenant_over_its_share_of_the_tokenizer_gets_429_and_others_keep_theirs",)),
    Mutation("tokenizer-tenant-threads", "one tenant occupies at most two tokenizer threads",
             (Delete("tokenizer-tenant-threads"),),
             ("tests/gateway/test_loop_tokenize.py::"
              "test_a_tenant_over_its_share_of_the_tokenizer_gets_429_and_others_keep_theirs",)),
    # Tenants share the mesh: KV share and fair order at admission, concurrency and rates
    # at the gateway, fair starts at prefill.
    Mutation("kv-share", "a tenant holds at most its kv_share of the live decode KV",
             (Condition("kv-share", "True"),),
             ("tests/admission/test_tenant_share.py::"
              "test_a_tenant_without_max_tokens_cannot_take_the_pool_from_another",
              "tests/admission/test_tenant_share.py::test_past_its_share_a_tenant_gets_429_naming_the_limit")),
    Mutation("fair-line", "only the fair line's first eligible submit takes capacity",
             (Condition("fair-line", "False"),),
             ("tests/admission/test_tenant_share.py::"
              "test_admission_serves_the_tenant_that_waited_with_less_first",)),
    Mutation("group-cancel", "a submit's choices reserved before one that failed are let "
             "go at once (all or nothing)",
             (Delete("group-cancel"),),
             ("tests/admission/test_tenant_share.py::"
              "test_choices_reserved_before_one_that_fails_are_let_go_at_once",)),
    Mutation("tenant-concurrency", "a tenant has at most max_concurrent choices in flight "
             "at a gateway",
             (Condition("tenant-concurrency", "False"),),
             ("tests/gateway/test_tenant_limits.py::"
              "test_concurrency_counts_choices_and_refuses_nothing_it_holds",
              "tests/gateway/test_tenant_limits.py::"
              "test_the_gateway_answers_429_with_retry_after_naming_the_limit")),
    Mutation("tenant-rate", "a tenant's requests and tokens per second are bounded",
             (Condition("tenant-rate", "False"),),
             ("tests/gateway/test_tenant_limits.py::"
              "test_rates_are_one_second_buckets_and_a_refusal_costs_nothing",
              "tests/gateway/test_tenant_limits.py::"
              "test_the_gateway_answers_429_with_retry_after_naming_the_limit")),
    Mutation("prefill-fair", "prefill starts waiting prompts fairly between tenants",
             (Replace("prefill-fair", "job = self._waiting[0]"),),
             ("tests/prefill/test_scheduler.py::"
              "test_waiting_prompts_start_fairly_between_tenants",)),
    # The edge: the public port serves only the API, bounded; no secret at rest or in logs.
    Mutation("metrics-off-api", "the gateway's per-tenant metrics are not on its API port",
             (Condition("metrics-off-api", "False"),),
             ("tests/gateway/test_edge_metrics.py::"
              "test_an_unauthenticated_scrape_of_the_api_port_gets_nothing_per_tenant",)),
    Mutation("edge-header-timeout", "a connection that trickles its headers is closed",
             (Delete("edge-header-timeout"),),
             ("tests/gateway/test_edge_limits.py::"
              "test_idle_and_trickling_connections_neither_block_a_request_nor_flood_the_log",)),
    Mutation("edge-client-cap", "one client address holds at most its share of connections",
             (Condition("edge-client-cap", "False"),),
             ("tests/gateway/test_edge_limits.py::"
              "test_caps_answer_at_once_and_slow_bodies_and_idle_keepalives_end",)),
    Mutation("edge-parse-sanitize", "a parser error's answer never quotes the request",
             (Replace("edge-parse-sanitize", "status, text = 400, str(exc)"),),
             ("tests/gateway/test_edge_errors.py::"
              "test_parser_errors_are_json_without_the_requests_bytes",)),
    Mutation("secrets-tighten", "a secrets directory others may read is made 0700",
             (Condition("secrets-tighten", "False"),),
             ("tests/ops/test_secrets_at_rest.py::"
              "test_a_rerun_tightens_a_loose_secrets_directory_and_kept_keys",)),
    Mutation("redact-filter", "log records are redacted (URL passwords, keys, secrets)",
             (Replace("redact-filter", "record.msg = record.msg"),),
             ("tests/runtime/test_redact.py::"
              "test_the_filter_masks_message_arguments_and_exceptions",)),
    Mutation("liveness-listening", "a gateway whose own loop stalled blames no worker",
             (Condition("liveness-listening", "False"),),
             ("tests/gateway/test_loop_liveness.py::"
              "test_a_pause_of_the_whole_machine_blames_no_worker",)),
    Mutation("nixl-staging-per-reservation", "nixl: links proving one reservation share the "
             "one staging region lent on that proof (one key holder cannot retire them all)",
             (Condition("nixl-staging-per-reservation", "False"),),
             ("tests/transports/test_nixl_staging.py::"
              "test_links_proving_one_reservation_share_one_staging_region",)),
    Mutation("nixl-staging-ready", "nixl: a receiver with no staging region to lend reports "
             "not ready (`accepting`), and ready again once one is free",
             (Replace("nixl-staging-ready", "return self._listening"),),
             ("tests/transports/test_nixl_staging.py::"
              "test_a_receiver_without_a_region_to_lend_is_not_ready_and_refuses_as_unreachable",)),
    Mutation("nixl-refusal-unreachable", "nixl: a send refused for want of a staging region "
             "fails `unreachable` (prefill reports the receiver to admission)",
             (Expr("nixl-refusal-unreachable", "PeerUnreachable", "TransferError"),),
             ("tests/transports/test_nixl_staging.py::"
              "test_a_receiver_without_a_region_to_lend_is_not_ready_and_refuses_as_unreachable",)),
    Mutation("transport-unreachable", "a send that cannot connect to the receiver fails "
             "`unreachable` (TransferError.unreachable)",
             (Replace("transport-unreachable", "return False"),),
             ("tests/transports/test_nixl_staging.py::"
              "test_unreachable_is_a_connect_failure_or_a_refusal_for_want_of_staging",)),
    # The KV tiers (I9). Without the tag check the entry is still decrypted (AES-GCM's own
    # counter mode, the tag not checked): an altered payload would be loaded as it is, and
    # another tenant's entry under this tenant's name would be parsed.
    Mutation("tier-mac", "a sealed KV tier entry is used only if it authenticates under "
             "the tenant's key at its store name (I9)",
             (Replace("tier-mac",
                      "from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, "
                      "modes\n"
                      "plaintext = Cipher(algorithms.AES(keys.aead_key), modes.CTR("
                      "nonce + bytes([0, 0, 0, 2]))).decryptor().update(sealed[:-16])"),),
             ("tests/kvstore/tiers/test_entry.py::test_an_altered_byte_is_refused_mac",
              "tests/kvstore/tiers/test_entry.py::"
              "test_another_tenants_entry_planted_under_this_tenants_name_is_refused_mac",
              "tests/kvstore/tiers/test_disk.py::"
              "test_another_tenants_file_planted_under_this_tenants_name_is_refused_mac",
              "tests/kvstore/tiers/test_remote.py::"
              "test_an_altered_entry_in_the_store_is_refused_mac")),
    Mutation("tier-tokens", "an authentic KV tier entry is used only for the block index, "
             "parent digest and token ids the request itself has (I9)",
             (Condition("tier-tokens", "False"),),
             ("tests/kvstore/tiers/test_entry.py::"
              "test_the_right_tenants_entry_for_other_tokens_is_refused_tokens",)),
    Mutation("tier-stale", "a KV tier entry of another model or geometry, or created "
             "before its tenant's purge, is refused (I9, I10)",
             (Condition("tier-stale", "False"),),
             ("tests/kvstore/tiers/test_entry.py::"
              "test_another_model_geometry_or_version_is_refused_stale",
              "tests/kvstore/tiers/test_entry.py::"
              "test_an_entry_created_before_the_salts_purge_time_is_refused_stale",
              "tests/kvstore/tiers/test_stack.py::"
              "test_blocks_put_before_a_purge_never_come_back")),
    Mutation("tier-host-tokens", "host memory returns a block only for the parent digest "
             "and token ids kept beside it (I9)",
             (Condition("tier-host-tokens", "False"),),
             ("tests/kvstore/tiers/test_host.py::test_a_block_held_under_the_asked_digest_"
              "for_other_ids_or_parent_is_not_returned",)),
]


# --- static checks (tests/guards/test_guard_tags.py runs them; `main` before any run) -------

def tag_problems(mutations: list[Mutation], tags: dict[str, list[Site]]) -> list[str]:
    """Each edit's tag on exactly one line, tags named by their guard, no tag unused."""
    problems, names = [], [m.name for m in mutations]
    problems += [f"two guards named {n!r}" for n in sorted(set(names)) if names.count(n) > 1]
    used = set()
    for m in mutations:
        if not m.edits or m.edits[0].tag != m.name:
            problems.append(f"{m.name}: its first edit must act on the tag {m.name!r}")
        for edit in m.edits:
            used.add(edit.tag)
            base, _, site = edit.tag.partition(".")
            if not (site and base == m.name) and edit.tag not in names:
                problems.append(f"{m.name}: tag {edit.tag!r} is neither {m.name!r}.<site> "
                                "nor another guard's own tag")
            try:
                the_site(tags, edit.tag)
            except GuardError as exc:
                problems.append(f"{m.name}: {exc}")
    for tag, sites in sorted(tags.items()):
        if tag not in used:
            where = ", ".join(map(str, sites))
            why = "not a valid tag name" if not TAG.fullmatch(tag) else "no guard uses it"
            problems.append(f"unknown tag {tag!r} at {where} ({why})")
    return problems


def _defines(scope: list[ast.stmt], names: list[str]) -> bool:
    name, rest = names[0], names[1:]
    for node in scope:
        if rest and isinstance(node, ast.ClassDef) and node.name == name:
            return _defines(node.body, rest)
        if (not rest and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name == name and name.startswith("test")):
            return True
    return False


def node_id_problems(mutations: list[Mutation], root: Path = REPO) -> list[str]:
    """Each named test is a folder, a file, or a test function defined in that file."""
    problems = []
    for m in mutations:
        if not m.tests:
            problems.append(f"{m.name}: names no test")
        for node_id in m.tests:
            path, *names = node_id.split("::")
            target = root / path
            if not path.startswith("tests/") or not target.exists():
                problems.append(f"{m.name}: {node_id}: no such test file or folder")
            elif names and (target.suffix != ".py" or not _defines(
                    ast.parse(target.read_text()).body,
                    [*names[:-1], names[-1].split("[", 1)[0]])):
                problems.append(f"{m.name}: {node_id}: no such test in {path}")
    return problems


def apply_problems(mutations: list[Mutation], tags: dict[str, list[Site]],
                   root: Path = REPO) -> list[str]:
    """Each mutation applies: its edits give different, parseable source (no test runs)."""
    problems = []
    for m in mutations:
        try:
            mutate(m, tags, root)
        except GuardError as exc:
            problems.append(str(exc))
    return problems


THREATS_HEADING = "## Threats, tests and guards"
_MENTION = re.compile(r"\bguards?\s+((?:`[^`]+`(?:,\s*|\s+and\s+)?)+)")


def readme_guard_mentions(text: str) -> set[str]:
    """Names written as guard `name` / guards `a`, `b` anywhere in the text."""
    return {name for group in _MENTION.findall(text) for name in re.findall(r"`([^`]+)`", group)}


def threat_table_guard_column(text: str) -> tuple[str, list[str]]:
    """The threat table's third column, joined; and any malformed rows."""
    _, found, rest = text.partition(THREATS_HEADING)
    rows = [ln for ln in rest.split("\n## ", 1)[0].splitlines() if ln.startswith("|")]
    if not found or len(rows) < 3:
        return "", [f"no threat table under {THREATS_HEADING!r}"]
    cells = [ln.strip().strip("|").split("|") for ln in rows[2:]]  # after header, rule
    bad = [f"threat table row {i} has {len(c)} columns, not 3: {rows[i + 2][:60]}"
           for i, c in enumerate(cells) if len(c) != 3]
    return "\n".join(c[2] for c in cells if len(c) == 3), bad


def readme_problems(mutations: list[Mutation], text: str) -> list[str]:
    """Every guard is named in the threat table's guard column; every name there is a guard."""
    names = {m.name for m in mutations}
    column, problems = threat_table_guard_column(text)
    in_table = readme_guard_mentions(column)
    problems += [f"guard {n!r} is named nowhere in tests/README.md's threat table"
                 for n in sorted(names - in_table)]
    problems += [f"tests/README.md names guard {n!r}, which check_guards.py does not have"
                 for n in sorted(readme_guard_mentions(text) - names)]
    return problems


def all_problems(mutations: list[Mutation] = MUTATIONS, root: Path = REPO) -> list[str]:
    tags = find_tags(root)
    return (tag_problems(mutations, tags) + node_id_problems(mutations, root)
            + apply_problems(mutations, tags, root)
            + readme_problems(mutations, (root / "tests/README.md").read_text()))


# --- the run -------------------------------------------------------------------------------

def run(m: Mutation, tags: dict[str, list[Site]]) -> tuple[str, float, str]:
    try:
        files = mutate(m, tags)
    except GuardError as exc:
        return "STALE", 0.0, str(exc)
    t0 = time.monotonic()
    try:
        for path, (_, mutated) in files.items():
            (REPO / path).write_text(mutated)
        # The long scenarios (make test-long) run too: a guard may name one.
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                               "no:cacheprovider", "--timeout", "240", *m.tests], cwd=REPO,
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PDMESH_LONG_TESTS": "1",
                                   "PDMESH_CHAOS_TESTS": "1"})
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.monotonic() - t0, "pytest ran past 600 s"
    finally:
        for path, (original, mutated) in files.items():
            # Someone else may have saved the file meanwhile: never overwrite their edit.
            if (REPO / path).read_text() == mutated:
                (REPO / path).write_text(original)
            else:
                print(f"!! {path} changed during the run of {m.name}: left as it is now; "
                      "check that it does not carry the mutation", file=sys.stderr)
    out = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    # The summary line, and the first failure's reason: it should be the guard's absence.
    tail = out[-1:] + [ln[:200] for ln in out if ln.startswith(("FAILED tests/",
                                                                  "ERROR tests/"))][:1]
    # 1: tests failed. 0: they passed. Anything else (usage error, nothing collected, a
    # collection error) shows nothing about the guard.
    verdict = {0: "NOT CAUGHT", 1: "LOAD-BEARING"}.get(proc.returncode,
                                                       f"ERROR rc={proc.returncode}")
    return verdict, time.monotonic() - t0, " | ".join(tail)


def main(argv: list[str]) -> int:
    unknown = sorted(set(argv) - {m.name for m in MUTATIONS})
    if unknown:
        print(f"no such guard: {', '.join(unknown)}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not argv or m.name in argv]
    tags = find_tags()
    problems = tag_problems(MUTATIONS, tags) + node_id_problems(chosen)
    for problem in problems:
        print(f"!! {problem}", file=sys.stderr)
    bad, t0 = 0, time.monotonic()
    for m in chosen:
        verdict, seconds, tail = run(m, tags)
        bad += verdict != "LOAD-BEARING"
        print(f"{m.name:32} {verdict:13} {seconds:6.1f}s  {m.guard}  [{tail}]", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} load-bearing in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return 1 if bad or problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
