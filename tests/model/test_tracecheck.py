"""The trace checker (tracecheck.py) refuses each step the model does not allow: a correct
trace of one request passes, and each rule fails on the same trace with one step wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model import tracecheck

L, R, P = "11111111-1111-4111-8111-111111111111", "cmpl-a", "pool-decode"
L2, R2 = "22222222-2222-4222-8222-222222222222", "cmpl-b"


def _decode(lease: str = L, req: str = R, epoch: int = 1, page: int = 0) -> list[dict]:
    """Decode's lines for one request served in full (1 page of 16 tokens, 5 written)."""
    return [
        {"ev": "lease", "pool": P, "lease": lease, "req": req, "epoch": epoch,
         "pages": [page], "shared": [], "tokens": 9, "page_tokens": 16},
        {"ev": "expect", "lease": lease, "epoch": epoch, "pages": 1},
        {"ev": "reserve_in", "req": req, "lease": lease, "epoch": epoch},
        {"ev": "accept", "lease": lease, "epoch": epoch, "index": 0},
        {"ev": "land", "lease": lease, "epoch": epoch, "index": 0},
        {"ev": "commit", "lease": lease, "epoch": epoch, "ok": True, "reason": ""},
        {"ev": "written", "pool": P, "lease": lease, "epoch": epoch, "page": page,
         "tokens": 5},
        {"ev": "read", "pool": P, "lease": lease, "epoch": epoch, "tokens": 5},
        {"ev": "fence", "lease": lease, "ok": True},
        {"ev": "free", "pool": P, "lease": lease, "epoch": epoch, "pages": [page],
         "cause": "length"},
        {"ev": "tell", "req": req, "kind": "finished", "code": "length"},  # as published
    ]


def _admission(req: str = R, lease: str = L) -> list[dict]:
    return [{"ev": "decide", "req": req, "verdict": "admit", "reason": "", "attempt": 0},
            {"ev": "reserve", "req": req, "lease": lease, "worker": "d", "epoch": 1},
            {"ev": "dispatch", "req": req, "lease": lease, "worker": "p"}]


def _run(decode: list[dict], admission: list[dict] | None = None,
         stop: bool = True) -> list[tracecheck.Violation]:
    def framed(events: list[dict]) -> list[dict]:
        out = [{"ev": "start"}, *events] + ([{"ev": "stop"}] if stop else [])
        return [{**e, "_line": i} for i, e in enumerate(out, 1)]
    files = {"decode:1": framed(decode),
             "admission:2": framed(_admission() if admission is None else admission)}
    return tracecheck.check(files)


def _move(events: list[dict], ev: str, before: str) -> list[dict]:
    """The same lines with the (first) `ev` line moved right before the `before` line."""
    line = next(e for e in events if e["ev"] == ev)
    rest = [e for e in events if e is not line]
    at = next(i for i, e in enumerate(rest) if e["ev"] == before)
    return rest[:at] + [line] + rest[at:]


def _rules(violations: list[tracecheck.Violation]) -> set[str]:
    return {v.rule for v in violations}


def test_a_correct_trace_passes() -> None:
    assert _run(_decode() + _decode(L2, R2, epoch=2), _admission()) == []


@pytest.mark.parametrize(("events", "rule"), [
    (_move(_decode(), "tell", before="fence"), "TELL"),           # told before release
    (_move(_decode(), "free", before="fence"), "FENCE"),          # freed before its fence
    (_move(_decode(), "written", before="commit"), "I2"),         # written before commit
    (_move(_decode(), "read", before="written"), "I2"),           # reads what is unwritten
    ([e for e in _decode() if e["ev"] != "land"], "COVERAGE"),    # commit, page not landed
    (_move(_decode(), "land", before="tell"), "I3"),              # lands after free
    (_move(_decode(), "fence", before="land"), "I3"),             # fence with a write in flight
    (_decode() + [dict(_decode()[3], epoch=2)], "LIVE"),          # a frame after the commit
    (_decode()[:1] + _decode(L2, R2, epoch=2), "DISTINCT"),       # page 0 in two live leases
    (_decode()[:1] + _decode(L2, R2, epoch=1)[:1], "DISTINCT"),   # an epoch reused
], ids=["tell-first", "free-before-fence", "written-early", "read-unwritten",
        "no-coverage", "land-after-free", "fence-inflight", "frame-after-commit",
        "page-twice", "epoch-reused"])
def test_each_wrong_step_is_refused(events: list[dict], rule: str) -> None:
    assert rule in _rules(_run(events)), _run(events)


def test_a_quarantined_page_is_never_leased_again() -> None:
    events = _decode()
    events[-3] = {"ev": "fence", "lease": L, "ok": False}
    events[-2] = {"ev": "quarantine", "pool": P, "lease": L, "epoch": 1, "pages": [0],
                  "cause": "aborted"}
    assert _run(events) == []
    assert _rules(_run(events + _decode(L2, R2, epoch=2)[:1])) == {"QUARANTINE"}
    freed = [dict(e, ev="free") if e["ev"] == "quarantine" else e for e in events]
    assert "FENCE" in _rules(_run(freed))          # freed although the fence raised


def test_a_rejected_request_reaches_no_worker() -> None:
    rejected = [{"ev": "decide", "req": R, "verdict": "reject", "reason": "too_long"}]
    assert _rules(_run(_decode(), rejected)) == {"I1"}
    # One of its n choices is the same request.
    choice = _decode(req=R + "-1")
    assert _rules(_run(choice, rejected)) == {"I1"}
    # Rejected after an admission (a dispatch too large to send): not I1's case.
    assert _run(_decode(), _admission() + rejected) == []


def test_admission_dispatches_only_what_it_holds() -> None:
    cancelled = _admission()
    cancelled.insert(2, {"ev": "cancel", "req": R, "lease": L, "worker": "d"})
    assert _rules(_run(_decode(), cancelled)) == {"I1"}
    assert _rules(_run(_decode(), [e for e in _admission() if e["ev"] != "reserve"])) == {"I1"}


def test_a_lease_left_at_a_clean_stop_is_refused_and_a_killed_process_is_not_judged() -> None:
    unfinished = _decode()[:8]  # read, never fenced or freed
    assert _rules(_run(unfinished)) == {"I6"}
    assert _run(unfinished, stop=False) == []


def test_files_are_read_back_and_a_cut_last_line_is_tolerated(tmp_path: Path) -> None:
    lines = [json.dumps({"ts": i, "p": "decode:7", **e}) for i, e in
             enumerate([{"ev": "start"}, *_decode()])]
    (tmp_path / "decode-7.jsonl").write_text("\n".join(lines) + '\n{"ts": 99, "p": "dec')
    assert tracecheck.check_dir(tmp_path) == []
    (tmp_path / "decode-7.jsonl").write_text(lines[0] + "\n{cut\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match="not JSON"):
        tracecheck.check_dir(tmp_path)
    wrong = _move(_decode(), "tell", before="fence")
    (tmp_path / "decode-7.jsonl").write_text("\n".join(
        json.dumps({"ts": i, "p": "decode:7", **e}) for i, e in enumerate(wrong)) + "\n")
    (v,) = tracecheck.check_dir(tmp_path)
    assert (v.rule, v.process, v.event) == ("TELL", "decode:7", "tell")
    assert tracecheck.main([str(tmp_path)]) == 1


def test_the_models_trace_lines_read_as_the_codes() -> None:
    """verify.py reads a Spin simulation's "T " lines into the checker's input: the model's
    trace of one served request passes, and the same trace with the tell first fails."""
    from tests.model import verify
    served = [
        "T {'p':'admission:2','ev':'decide','req':'R0a0','verdict':'admit'}",
        "T {'p':'decode:1','ev':'lease','pool':'P','lease':'L1','req':'R0a0','epoch':1,"
        "'pages':[0],'shared':[],'tokens':16,'page_tokens':16}",
        "T {'p':'decode:1','ev':'expect','lease':'L1','epoch':1,'pages':1}",
        "T {'p':'admission:2','ev':'reserve','req':'R0a0','lease':'L1'}",
        "T {'p':'admission:2','ev':'dispatch','req':'R0a0','lease':'L1'}",
        "T {'p':'decode:1','ev':'accept','lease':'L1','epoch':1,'index':0}",
        "spin's own output in between",
        "T {'p':'decode:1','ev':'land','lease':'L1','epoch':1,'index':0}",
        "T {'p':'decode:1','ev':'commit','lease':'L1','epoch':1,'ok':1}",
        "T {'p':'decode:1','ev':'written','pool':'P','lease':'L1','epoch':1,'page':0,"
        "'tokens':16}",
        "T {'p':'decode:1','ev':'read','pool':'P','lease':'L1','epoch':1,'tokens':16}",
        "T {'p':'decode:1','ev':'fence','lease':'L1','ok':1}",
        "T {'p':'decode:1','ev':'free','pool':'P','lease':'L1','epoch':1,'pages':[0]}",
        "T {'p':'decode:1','ev':'tell','req':'R0a0','lease':'L1'}",
        "T {'p':'decode:1','ev':'stop'}",
    ]
    files = verify.model_trace("\n".join(served))
    assert sorted(files) == ["admission:2", "decode:1"]
    assert [e["_line"] for e in files["decode:1"]] == list(range(1, 12))
    assert tracecheck.check(files) == []
    tell_first = served[:11] + [served[13], served[11], served[12], served[14]]
    assert _rules(tracecheck.check(verify.model_trace("\n".join(tell_first)))) == {"TELL"}
