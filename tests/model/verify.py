"""Check the Promela model of the handoff (handoff.pml) with Spin: the full state space of
each configuration, every property, and every variant with one guard removed. Then tie the
model to the code's trace checker (tracecheck.py): random simulations of the model print
the protocol trace the code writes, and every one must pass the checker; each variant's
counterexample, replayed, must fail it (where the guard's loss shows in a trace at all).

    python tests/model/verify.py            # what `make verify` runs
    python tests/model/verify.py --no-ltl   # skip the weak-fairness I6 run (the slowest)
    python tests/model/verify.py --only NO_FENCE_WAIT
    python tests/model/verify.py --simulations 500   # random runs per configuration

Prints one table (the unmutated model's runs, then each variant: LOAD-BEARING with its
counterexample's length in steps, or NOT CAUGHT) and one JSON object on the last line.
Exits non-zero when a property fails on the unmutated model, a search does not finish, or
a variant goes uncaught. Needs `spin` (Debian's package) and a C compiler.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.model import tracecheck

MODEL = Path(__file__).with_name("handoff.pml")
CONFIGS = {"tenants": [], "resume": ["-DCONF_RESUME"]}

# variant -> the guard it removes (the code's guard tag, where there is one) and the
# invariant its counterexample breaks
VARIANTS = {
    "NO_REJECT_FIRST": ("admission reserves before it decides", "I1"),
    "INCIDENT": ("a rejected prompt passed on as a 1-page stub", "I1"),
    "NO_EPOCH_CHECK": ("receiver's epoch check (guard: epoch)", "I2"),
    "NO_FRAME_MAC": ("frame MAC (guard: frame-mac)", "I2"),
    "NO_COVERAGE": ("commit coverage (guard: commit-verification)", "I2"),
    "WRITTEN_EARLY": ("mark written only after the verified commit", "I2"),
    "NO_FENCE_WAIT": ("fence waits for the write in flight (guard: fence-inflight)", "I3"),
    "NO_QUARANTINE": ("quarantine when the fence cannot establish the end (guard: quarantine)",
                      "I3"),
    "TELL_FIRST": ("release before telling the client", "I6"),
    "RELEASE_TWICE": ("release is idempotent", "I3"),
    "NO_TIER_CHECK": ("a tier entry's check (tenant, tokens) before its block is copied", "I9"),
}

# an assertion's text in pan's report -> the invariant it states
BROKEN = (("rejected", "I1"), ("content[", "I2"), ("owner[p]", "I3"), ("leased==0", "I6"),
          ("own_kv[", "I9"), ("invalid end state", "end state"), ("acceptance cycle", "I6"))


def invariant_of(violation: str) -> str:
    return next((inv for text, inv in BROKEN if text in violation), violation)


SAFETY_FLAGS = ["-O2", "-DSAFETY", "-DNOCLAIM", "-DCOLLAPSE", "-DVECTORSZ=2048"]
LTL_FLAGS = ["-O2", "-DCOLLAPSE", "-DNFAIR=4", "-DVECTORSZ=2048"]


@dataclass
class Run:
    name: str
    config: str
    errors: int
    states: int
    depth: int
    seconds: float
    finished: bool
    violation: str = ""
    trail_steps: int = 0
    trace_rules: list[str] | None = None  # the replayed counterexample's trace violations


def _spin_ok() -> None:
    missing = [t for t in ("spin", "gcc") if shutil.which(t) is None]
    if missing:
        sys.exit(f"verify: {', '.join(missing)} not found (make verify installs Debian's spin)")


def _pan(workdir: Path, defines: list[str], cflags: list[str], memlim_mb: int) -> Path:
    model = workdir / MODEL.name
    shutil.copy(MODEL, model)
    subprocess.run(["spin", *defines, "-a", model.name], cwd=workdir, check=True,
                   capture_output=True, text=True)
    subprocess.run(["gcc", *cflags, f"-DMEMLIM={memlim_mb}", "-o", "pan", "pan.c"],
                   cwd=workdir, check=True, capture_output=True, text=True)
    return workdir / "pan"


def _int(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else 0


def model_trace(spin_output: str) -> dict[str, list[dict]]:
    """The protocol trace a simulation printed ("T " lines, ' for "), by process."""
    files: dict[str, list[dict]] = {}
    for raw in spin_output.splitlines():
        if raw.startswith("T "):
            event = json.loads(raw[2:].replace("'", '"'))
            lines = files.setdefault(event["p"], [])
            event["_line"] = len(lines) + 1
            lines.append(event)
    return files


def simulate(config: str, seed: int) -> tuple[list[tracecheck.Violation], bool, int, int]:
    """One random run of the unmutated model: the checker's violations of its trace,
    whether it came to rest, its number of trace lines, and its blocks loaded from the KV
    tiers (verified entries; refused ones are computed)."""
    with tempfile.TemporaryDirectory(prefix="pdmesh-sim-") as tmp:
        shutil.copy(MODEL, Path(tmp) / MODEL.name)
        out = subprocess.run(["spin", "-T", f"-n{seed}", "-u100000", *CONFIGS[config],
                              MODEL.name], cwd=tmp, capture_output=True, text=True,
                             timeout=120).stdout
    files = model_trace(out)
    events = [e for lines in files.values() for e in lines]
    rested = any(e["ev"] == "stop" for e in events)
    loaded = sum(1 for e in events if e["ev"] == "tier_load" and e.get("pages"))
    return tracecheck.check(files), rested, len(events), loaded


def run_one(name: str, config: str, defines: list[str], ltl: bool, timeout_s: float,
            memlim_mb: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="pdmesh-verify-") as tmp:
        workdir = Path(tmp)
        pan = _pan(workdir, defines + CONFIGS[config], LTL_FLAGS if ltl else SAFETY_FLAGS,
                   memlim_mb)
        args = [str(pan), "-m1000000"] + (["-a", "-f"] if ltl else [])
        started = time.monotonic()
        try:
            out = subprocess.run(args, cwd=workdir, capture_output=True, text=True,
                                 timeout=timeout_s).stdout
            finished = True
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            finished = False
        seconds = time.monotonic() - started
        errors = _int(r"errors: (\d+)", out)
        finished = finished and "errors:" in out and "out of memory" not in out
        violation = ""
        m = re.search(r"pan:\d+: (.+?)(?: \(at depth \d+\))?$", out, re.M)
        if m:
            violation = m.group(1).strip()
        elif "acceptance cycle" in out:
            violation = "acceptance cycle (I6 violated)"
        steps = 0
        trace_rules = None
        trail = workdir / (MODEL.name + ".trail")
        if errors and trail.exists():
            steps = sum(1 for line in trail.read_text().splitlines()
                        if line and not line.startswith("-"))
            replay = subprocess.run(["spin", "-T", "-t", *defines, *CONFIGS[config],
                                     MODEL.name], cwd=workdir, capture_output=True,
                                    text=True, timeout=120).stdout
            trace_rules = sorted({v.rule for v in tracecheck.check(model_trace(replay))})
        return Run(name=name, config=config, errors=errors, trace_rules=trace_rules,
                   states=_int(r"(\d+(?:\.\d+)?(?:e\+\d+)?) states, stored", out),
                   depth=_int(r"depth reached (\d+)", out), seconds=round(seconds, 1),
                   finished=finished, violation=violation, trail_steps=steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-ltl", action="store_true", help="skip the weak-fairness I6 run")
    ap.add_argument("--only", action="append", default=[], help="run only these variants")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per search")
    ap.add_argument("--memlim-mb", type=int, default=4096, help="per search")
    ap.add_argument("--simulations", type=int, default=200,
                    help="random runs per configuration, each trace checked")
    ns = ap.parse_args()
    _spin_ok()
    todo: list[tuple[str, str, list[str], bool]] = []
    if not ns.only:
        todo += [("model", c, [], False) for c in CONFIGS]
        if not ns.no_ltl:
            todo.append(("model (I6, weak fairness)", "resume", [], True))
    for v in ns.only or VARIANTS:
        if v not in VARIANTS:
            sys.exit(f"verify: unknown variant {v}; known: {', '.join(VARIANTS)}")
        todo += [(v, c, [f"-D{v}"], False) for c in CONFIGS]
    with ThreadPoolExecutor(max_workers=ns.jobs) as pool:
        runs = list(pool.map(lambda t: run_one(*t, ns.timeout_s, ns.memlim_mb), todo))
        sims = {c: list(pool.map(lambda seed, c=c: simulate(c, seed),
                                 range(1, ns.simulations + 1)))
                for c in CONFIGS} if not ns.only else {}

    ok = True
    print(f"{'run':28} {'config':8} {'result':14} {'states':>10} {'depth':>6} {'steps':>6} "
          f"{'s':>6}  violation")
    for r in runs:
        if r.name.startswith("model"):
            result = "HOLDS" if r.finished and r.errors == 0 else (
                "VIOLATED" if r.errors else "UNFINISHED")
            ok &= result == "HOLDS"
        else:
            result = "counterexample" if r.errors else (
                "none" if r.finished else "unfinished")
        print(f"{r.name:28} {r.config:8} {result:14} {r.states:>10} {r.depth:>6} "
              f"{r.trail_steps or '':>6} {r.seconds:>6}  {r.violation}")
    verdicts = {}
    print()
    print(f"{'variant':16} {'verdict':13} {'shortest':>8}  {'trace check':18} "
          "guard removed -> invariant it breaks")
    for v in ns.only or VARIANTS:
        caught = [r for r in runs if r.name == v and r.errors]
        verdict = "LOAD-BEARING" if caught else "NOT CAUGHT"
        ok &= bool(caught)
        shortest = min((r.trail_steps for r in caught), default=0)
        broke = sorted({invariant_of(r.violation) for r in caught})
        traced = sorted({rule for r in caught for rule in r.trace_rules or []})
        verdicts[v] = {"verdict": verdict, "steps": shortest,
                       "configs": [r.config for r in caught], "broke": broke,
                       "trace_rules": traced}
        guard, inv = VARIANTS[v]
        print(f"{v:16} {verdict:13} {shortest or '-':>8}  {','.join(traced) or 'not visible':18} "
              f"{guard} -> {inv}"
              f"{'' if broke in ([inv], []) else ' (found: ' + ', '.join(broke) + ')'}")
    simulations = {}
    for config, results in sims.items():
        bad = [(seed, v) for seed, (vs, _, _, _) in enumerate(results, 1) for v in vs]
        ok &= not bad
        simulations[config] = {"runs": len(results), "violations": len(bad),
                               "at_rest": sum(rested for _, rested, _, _ in results),
                               "trace_lines": sum(n for _, _, n, _ in results),
                               "tier_loads": sum(t for _, _, _, t in results)}
        print(f"random runs ({config}): {len(results)}, "
              f"{simulations[config]['at_rest']} came to rest, "
              f"{simulations[config]['trace_lines']} trace lines "
              f"({simulations[config]['tier_loads']} verified tier loads), {len(bad)} steps "
              "the trace checker refused")
        for seed, v in bad[:10]:
            print(f"  seed {seed}: {v}")
    print(json.dumps({"ok": ok, "runs": [asdict(r) for r in runs], "variants": verdicts,
                      "simulations": simulations}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
