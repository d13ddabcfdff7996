"""Check a real run's protocol trace against the model's transition rules (handoff.pml).

Every service started with `--protocol-trace-dir DIR` appends its protocol actions to
`DIR/<role>-<pid>.jsonl` (services/runtime/ptrace.py lists the events). This replays each
process's lines in order and refuses any step the model does not allow:

    python tests/model/tracecheck.py DIR      # exit 1 and one line per violation

Rules, each named after the model's property or transition it mirrors:
  I1          a request whose decision was a rejection (and never an admission) appears in
              no reservation, lease, dispatch or prefill job anywhere in the run; admission
              dispatches only a reservation it holds and has not cancelled.
  DISTINCT    a lease takes only free pages (and cached ones as its shared prefix): no page
              in two live leases; a pool's epochs are never reused.
  QUARANTINE  a quarantined page is never leased, freed or cached again.
  I2          a lease reads only what it wrote in its own epoch (or pinned from the cache),
              up to the written length; a receiving pool marks pages written only after the
              lease's verified commit, and its first read comes after that.
  COVERAGE    a commit is verified only when every expected page landed.
  LIVE        the receiver accepts a frame only for a live expectation of that epoch (the
              epoch and MAC checks), and expects only for a live lease of that epoch.
  I3          a write lands only while its lease is live and before its fence returned (or
              into quarantined pages); a fence returns only with no accepted write in flight.
  FENCE       a receiving pool frees a lease only after its fence returned, and quarantines
              only when the fence did not return.
  TIER        a block loaded from the KV tiers (`tier_load`) is copied only when its entry's
              check passed (`verified`; a refused entry copies nothing: its pages are
              computed), and only into fresh pages of a live lease of this process: its own,
              neither shared nor cached, not yet marked written (the pool's `written` lines
              for them follow the load). A run without tier lines passes it.
  TELL        decode tells the client a request's end (any terminal event it publishes on
              the request's stream, by whatever path) only after its lease was released.
  I6          a process that stopped cleanly (its last line is `stop`) holds no lease of the
              receiving pool (decode's: the model's pool) at the end.
A process killed mid-run has no `stop` and may have cut its last line: I6 and the cut line
are not judged for it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Violation:
    rule: str
    process: str
    line: int
    event: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.process} line {self.line} ({self.event}): {self.detail}"


@dataclass
class _Lease:
    lease: str
    req: str
    epoch: int
    pages: list[int]
    shared: set[int]
    page_tokens: int
    written: dict[int, int] = field(default_factory=dict)
    cached: set[int] = field(default_factory=set)
    live: bool = True
    receiving: bool = False   # an expectation was registered for it (decode's pool)
    committed: bool = False
    fenced: bool = False      # a fence returned
    fence_failed: bool = False
    quarantined: bool = False

    def prefix(self) -> int:
        """Tokens readable from the start: shared pages whole, own pages as written, up to
        the first page not written to its end."""
        total = 0
        for page in self.pages:
            count = self.page_tokens if page in self.shared else self.written.get(page, 0)
            total += count
            if count < self.page_tokens:
                break
        return total


@dataclass
class _Slot:
    epoch: int
    pages: int
    live: bool = True
    accepted: set[int] = field(default_factory=set)
    landed: set[int] = field(default_factory=set)


class _Process:
    """The replay of one process's lines: its pools and its receive table."""

    def __init__(self, name: str, out: list[Violation]) -> None:
        self.name = name
        self.out = out
        self.line = 0
        self.ev = ""
        self.page_state: dict[tuple[str, int], str] = {}   # "leased", "cached", "quar"
        self.page_holder: dict[tuple[str, int], str] = {}
        self.epochs: dict[str, set[int]] = defaultdict(set)
        self.leases: dict[str, _Lease] = {}
        self.lease_pool: dict[str, str] = {}
        self.slots: dict[str, _Slot] = {}
        self.stopped = False

    def bad(self, rule: str, detail: str) -> None:
        self.out.append(Violation(rule, self.name, self.line, self.ev, detail))

    def _lease(self, e: dict, rule: str = "I2") -> _Lease | None:
        lease = self.leases.get(e.get("lease", ""))
        if lease is None:
            self.bad(rule, f"names lease {e.get('lease')} this process never leased")
            return None
        if not lease.live:
            self.bad(rule, f"lease {lease.lease} ({lease.req}) was already released")
            return None
        return lease

    # -- pool ---------------------------------------------------------------------------
    def on_lease(self, e: dict) -> None:
        pool, epoch = e["pool"], int(e["epoch"])
        if epoch in self.epochs[pool]:
            self.bad("DISTINCT", f"epoch {epoch} of pool {pool[:8]} used twice")
        self.epochs[pool].add(epoch)
        shared = {int(p) for p in e.get("shared", [])}
        for page in (int(p) for p in e["pages"]):
            state = self.page_state.get((pool, page))
            if page in shared:
                if state != "cached":
                    self.bad("DISTINCT", f"page {page} pinned as shared but it is {state}")
            elif state == "quar":
                self.bad("QUARANTINE", f"quarantined page {page} leased again to {e['req']}")
            elif state is not None:
                self.bad("DISTINCT", f"page {page} leased to {e['req']} while {state} "
                         f"({self.page_holder.get((pool, page), '')})")
            else:
                self.page_state[(pool, page)] = "leased"
                self.page_holder[(pool, page)] = e["lease"]
        self.leases[e["lease"]] = _Lease(e["lease"], e["req"], epoch,
                                         [int(p) for p in e["pages"]], shared,
                                         int(e.get("page_tokens", 0)))
        self.lease_pool[e["lease"]] = pool

    def _end(self, e: dict, to: str) -> None:
        lease = self._lease(e, "DISTINCT")
        if lease is None:
            return
        pool = self.lease_pool[lease.lease]
        own = sorted(p for p in lease.pages if p not in lease.shared and p not in lease.cached)
        if sorted(int(p) for p in e["pages"]) != own:
            self.bad("DISTINCT", f"{to} of {lease.req} names pages {e['pages']}, its own "
                     f"pages are {own}")
        if lease.receiving:
            if to == "free" and not lease.fenced:
                self.bad("FENCE", f"lease of {lease.req} freed before its fence returned")
            if to == "quar" and lease.fenced and not lease.fence_failed:
                self.bad("FENCE", f"lease of {lease.req} quarantined after a fence returned")
        for page in own:
            if to == "quar":
                self.page_state[(pool, page)] = "quar"
            else:
                self.page_state.pop((pool, page), None)
            self.page_holder.pop((pool, page), None)
        lease.live = False
        lease.quarantined = to == "quar"

    def on_free(self, e: dict) -> None:
        self._end(e, "free")

    def on_quarantine(self, e: dict) -> None:
        self._end(e, "quar")

    def on_cache(self, e: dict) -> None:
        lease = self._lease(e)
        if lease is None:
            return
        page = int(e["page"])
        if page not in lease.pages or page in lease.shared:
            self.bad("I2", f"lease of {lease.req} caches page {page} it does not own")
            return
        lease.cached.add(page)
        self.page_state[(self.lease_pool[lease.lease], page)] = "cached"

    def on_evict(self, e: dict) -> None:
        key = (e["pool"], int(e["page"]))
        if self.page_state.get(key) != "cached":
            self.bad("QUARANTINE" if self.page_state.get(key) == "quar" else "DISTINCT",
                     f"page {e['page']} evicted while {self.page_state.get(key)}")
            return
        del self.page_state[key]

    def on_written(self, e: dict) -> None:
        lease = self._lease(e)
        if lease is None:
            return
        page = int(e["page"])
        if page not in lease.pages or page in lease.shared or page in lease.cached:
            self.bad("I2", f"lease of {lease.req} marks page {page} written, not its own")
        if int(e["epoch"]) != lease.epoch:
            self.bad("I2", f"written in epoch {e['epoch']}, the lease's is {lease.epoch}")
        if lease.receiving and not lease.committed:
            self.bad("I2", f"page {page} of {lease.req} marked written before the verified "
                     "commit")
        lease.written[page] = max(lease.written.get(page, 0), int(e["tokens"]))

    def on_read(self, e: dict) -> None:
        lease = self._lease(e)
        if lease is None:
            return
        if int(e["epoch"]) != lease.epoch:
            self.bad("I2", f"read in epoch {e['epoch']}, the lease's is {lease.epoch}")
        if lease.receiving and not lease.committed:
            self.bad("I2", f"{lease.req} read before its verified commit")
        if int(e["tokens"]) > lease.prefix():
            self.bad("I2", f"{lease.req} reads {e['tokens']} tokens, {lease.prefix()} written "
                     "in its epoch")

    def on_tier_load(self, e: dict) -> None:
        pages = [int(p) for p in e.get("pages", [])]
        block = f"block {e.get('block')} of {e.get('req')}"
        if not e.get("verified"):
            if pages:
                self.bad("TIER", f"{block} copied into pages {pages} though its entry was "
                         "refused")
            return
        if not pages:
            return
        lease = self._lease(e, "TIER")
        if lease is None:
            return
        for page in pages:
            if page not in lease.pages or page in lease.shared or page in lease.cached:
                self.bad("TIER", f"{block} loaded into page {page}, not a fresh page of "
                         f"lease {lease.lease}")
            elif page in lease.written:
                self.bad("TIER", f"{block} loaded into page {page}, already marked written")

    # -- receive table ------------------------------------------------------------------
    def on_expect(self, e: dict) -> None:
        lease = self._lease(e, "LIVE")
        if lease is None:
            return
        if int(e["epoch"]) != lease.epoch:
            self.bad("LIVE", f"expects epoch {e['epoch']}, the lease's is {lease.epoch}")
        lease.receiving = True
        self.slots[lease.lease] = _Slot(int(e["epoch"]), int(e["pages"]))

    def _slot(self, e: dict) -> _Slot | None:
        slot = self.slots.get(e.get("lease", ""))
        if slot is None:
            self.bad("LIVE", f"{self.ev} for reservation {e.get('lease')}, never expected")
        return slot

    def on_accept(self, e: dict) -> None:
        slot = self._slot(e)
        if slot is None:
            return
        if not slot.live:
            self.bad("LIVE", f"frame accepted for {e['lease']} whose expectation ended")
        if int(e["epoch"]) != slot.epoch:
            self.bad("LIVE", f"frame of epoch {e['epoch']} accepted, expected {slot.epoch}")
        index = int(e["index"])
        if not 0 <= index < slot.pages:
            self.bad("LIVE", f"page index {index} outside the {slot.pages} expected")
        slot.accepted.add(index)

    def on_land(self, e: dict) -> None:
        slot = self._slot(e)
        if slot is None:
            return
        index = int(e["index"])
        if index not in slot.accepted - slot.landed:
            self.bad("I3", f"page {index} of {e['lease']} landed with no accepted write")
        slot.landed.add(index)
        lease = self.leases.get(e["lease"])
        if lease is not None and not lease.quarantined:
            if not lease.live:
                self.bad("I3", f"a write landed in {lease.req}'s pages after they were freed")
            elif lease.fenced:
                self.bad("I3", f"a write landed in {lease.req}'s pages after its fence "
                         "returned")

    def on_commit(self, e: dict) -> None:
        slot = self.slots.get(e.get("lease", ""))
        if not e.get("ok"):
            if slot is not None:
                slot.live = False
            return
        if slot is None or not slot.live or int(e["epoch"]) != slot.epoch:
            self.bad("LIVE", f"commit verified for {e.get('lease')} with no live expectation "
                     "of that epoch")
            return
        if slot.landed != set(range(slot.pages)):
            self.bad("COVERAGE", f"commit verified for {e['lease']} with pages "
                     f"{sorted(slot.landed)} of {slot.pages} landed")
        slot.live = False
        lease = self.leases.get(e["lease"])
        if lease is not None:
            lease.committed = True

    def on_fail(self, e: dict) -> None:
        slot = self.slots.get(e.get("lease", ""))
        if slot is not None:
            slot.live = False

    def on_fence(self, e: dict) -> None:
        slot = self.slots.get(e.get("lease", ""))
        if slot is not None:
            slot.live = False
        lease = self.leases.get(e.get("lease", ""))
        if e.get("ok"):
            if slot is not None and slot.accepted - slot.landed:
                self.bad("I3", f"fence of {e['lease']} returned with writes to pages "
                         f"{sorted(slot.accepted - slot.landed)} in flight")
            if lease is not None:
                lease.fenced = True
        elif lease is not None:
            lease.fence_failed = True

    # -- decode's service ---------------------------------------------------------------
    def on_tell(self, e: dict) -> None:
        # The code traces a tell where the terminal event is published (it names the
        # request); the model's lines name the lease too.
        if "lease" in e:
            held = [self.leases[e["lease"]]] if e["lease"] in self.leases else []
        else:
            held = [lease for lease in self.leases.values()
                    if lease.req == e.get("req") and lease.receiving]
        for lease in held:
            if lease.live:
                self.bad("TELL", f"{lease.req} told ({e.get('kind')}) before its lease was "
                         "released")

    def on_stop(self, e: dict) -> None:
        self.stopped = True

    def finish(self) -> None:
        if not self.stopped:
            return
        self.ev = "end"
        for lease in self.leases.values():
            if lease.live and lease.receiving:
                self.bad("I6", f"lease of {lease.req} never freed or quarantined")


def _read(path: Path) -> list[dict]:
    """The lines of one file (a process that stopped cleanly ends with `stop`)."""
    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, raw in enumerate(lines, 1):
        try:
            event = json.loads(raw)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a killed process's cut last line
            raise ValueError(f"{path.name} line {number}: not JSON: {raw[:80]!r}") from None
        event["_line"] = number
        events.append(event)
    return events


def check(files: dict[str, list[dict]]) -> list[Violation]:
    """The violations in a merged trace: process name -> its events in order."""
    out: list[Violation] = []
    for name, events in sorted(files.items()):
        proc = _Process(name, out)
        for e in events:
            proc.line, proc.ev = e.get("_line", 0), e.get("ev", "")
            handler = getattr(proc, "on_" + proc.ev, None)
            if handler is not None:
                try:
                    handler(e)
                except (KeyError, TypeError, ValueError) as exc:
                    proc.bad("FORMAT", f"malformed event: {exc!r}")
        if events and events[-1].get("ev") == "stop":
            proc.finish()
    _check_admission(files, out)
    return out


def _check_admission(files: dict[str, list[dict]], out: list[Violation]) -> None:
    admitted, rejected = set(), set()
    for events in files.values():
        for e in events:
            if e.get("ev") == "decide":
                (admitted if e.get("verdict") == "admit" else rejected).add(e["req"])
    only_rejected = rejected - admitted

    def of_rejected(req: str) -> bool:  # the request itself, or one of its n choices
        if req in only_rejected:
            return True
        base, _, suffix = req.rpartition("-")
        return suffix.isdigit() and base in only_rejected

    for name, events in sorted(files.items()):
        held: set[str] = set()
        for e in events:
            ev = e.get("ev")
            if ev in ("reserve", "reserve_in", "lease", "dispatch", "job") and of_rejected(
                    e.get("req", "")):
                out.append(Violation("I1", name, e.get("_line", 0), ev,
                                     f"rejected request {e['req']} reached a worker"))
            if ev == "reserve":
                held.add(e["lease"])
            elif ev == "cancel":
                held.discard(e.get("lease", ""))
            elif ev == "dispatch" and e["lease"] not in held:
                out.append(Violation("I1", name, e.get("_line", 0), ev,
                                     f"dispatch of {e['req']} under reservation {e['lease']}"
                                     " admission does not hold"))


def load(directory: Path) -> dict[str, list[dict]]:
    files = {}
    for path in sorted(Path(directory).glob("*.jsonl")):
        events = _read(path)
        if events:
            files[events[0].get("p", path.stem)] = events
    return files


def check_dir(directory: Path) -> list[Violation]:
    return check(load(directory))


def summary(files: dict[str, list[dict]]) -> dict[str, int]:
    """Event counts by kind over a loaded trace."""
    counts: dict[str, int] = defaultdict(int)
    for events in files.values():
        for e in events:
            counts[e.get("ev", "")] += 1
    return dict(counts)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[0], "\nusage: tracecheck.py DIR", file=sys.stderr)
        return 2
    files = load(Path(argv[0]))
    violations = check(files)
    for v in violations:
        print(v)
    counts = summary(files)
    print(json.dumps({"ok": not violations, "violations": len(violations),
                      "events": sum(counts.values()), "by_event": counts}))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
