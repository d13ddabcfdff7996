"""`pdmesh bench llamacpp` without llama.cpp: the run itself needs a 10-minute build and takes
minutes (services/engine/README.md). Here: what it refuses before starting anything, and its
client and figures against the suite's real tiny mesh standing in for both sides (the same server
twice: every figure present, the ratios those of the medians, exact token counts)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdmesh.loadtest.bench import llamacpp
from tests.support.meshproc import REPO, Mesh


def _bench(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "bench",
                           "llamacpp", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "PDMESH_CACHE_DIR": str(cache)})


def test_no_build_without_a_cached_server_fails_clearly(tmp_path: Path) -> None:
    res = _bench("--no-build", "--json", cache=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "no llama-server built in" in res.stderr and "--no-build" in res.stderr
    assert str(tmp_path / "llamacpp") in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    res = _bench("--llama-server", str(tmp_path / "nothing"), cache=tmp_path)
    assert res.returncode == 2 and "no executable file there" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_cached_server_is_found_by_version(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMESH_CACHE_DIR", str(tmp_path))
    for version in ("0.3.9", "0.3.36"):
        binary = tmp_path / "llamacpp" / version / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("#!/bin/sh\n")
        binary.chmod(0o755)
    (tmp_path / "llamacpp" / "0.4.0").mkdir()  # a build that did not finish
    newest = llamacpp.find_llama_server(None, None, False, 2, 60)
    assert newest == ("0.3.36", tmp_path / "llamacpp" / "0.3.36" / "llama-server")
    assert llamacpp.find_llama_server(None, "0.3.9", False, 2, 60)[0] == "0.3.9"
    with pytest.raises(llamacpp.Missing, match="llama-server 0.4.0"):
        llamacpp.find_llama_server(None, "0.4.0", False, 2, 60)


def test_bad_arguments_exit_2() -> None:
    for args in (["--workloads", "1k/64"], ["--workloads", "64/1@1"], ["--runs", "0"],
                 ["--model", "tiny"], ["--workloads", "64/8@1,64/8@1"]):
        with pytest.raises(SystemExit) as exc:
            llamacpp.parse_args(args)
        assert exc.value.code == 2, args


def test_workloads_parse_and_label() -> None:
    assert [w.label for w in llamacpp.parse_workloads(llamacpp.DEFAULT_WORKLOADS)] == [
        "1k_64_c1", "256_64_c4", "4k_32_c1"]


def test_client_figures_against_a_real_mesh(live_mesh: Mesh) -> None:
    """The suite's shared mesh (tests/conftest.py) as both sides."""
    workload = llamacpp.Workload(prompt_tokens=24, max_tokens=6, concurrency=2)
    report: dict[str, object] = {}
    skipped: list[str] = []
    endpoints = [llamacpp.Endpoint(label, live_mesh.base_url, "tiny", "sk-dev-alice")
                 for label in (llamacpp.PDMESH, llamacpp.REFERENCE)]
    asyncio.run(llamacpp.bench(endpoints, [workload], 2, (3, 250), time.monotonic() + 120,
                               report, skipped))
    assert skipped == [] and not [k for k in report if k.startswith("error")], report
    key = workload.label
    assert report[f"runs_{key}"] == 2
    assert set(report) >= {f"{m}_ratio_{key}" for m in llamacpp.METRICS}
    for side in (llamacpp.PDMESH, llamacpp.REFERENCE):
        assert report[f"prompt_tokens_{key}_{side}"] == 24
        assert 0 < report[f"chunks_per_token_{key}_{side}"] <= 1  # type: ignore[operator]
        for metric in ("ttft_s", "tpot_s", "output_tok_s"):
            assert report[f"{metric}_{key}_{side}"] > 0  # type: ignore[operator]
        # chunks read in one go share a timestamp: a loaded client may see gaps of 0
        assert report[f"itl_s_{key}_{side}"] >= 0  # type: ignore[operator]
    for metric in ("ttft_s", "tpot_s", "output_tok_s"):
        assert report[f"{metric}_ratio_{key}"] == pytest.approx(
            report[f"{metric}_{key}_pdmesh"] / report[f"{metric}_{key}_llamacpp"])  # type: ignore[operator]


# Stands in for llama-server on a VM whose AMX tile instructions fault: killed by SIGSEGV
# during its warm-up unless given --no-repack; then it answers /health until stopped.
FAULTING_SERVER = """#!{python}
import http.server, os, signal, sys
args = sys.argv[1:]
if "--no-repack" not in args and "-nr" not in args:
    os.kill(os.getpid(), signal.SIGSEGV)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _faulting_server(tmp_path: Path) -> Path:
    binary = tmp_path / "llama-server"
    binary.write_text(FAULTING_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    return binary


def test_a_server_killed_by_a_signal_is_started_again_without_repacked_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary, gguf = _faulting_server(tmp_path), tmp_path / "model.gguf"
    with contextlib.ExitStack() as stack:
        server, args, why = llamacpp.start_llama_server(stack, binary, gguf, ["-t", "2"])
        assert server.healthy()
        assert args == ["-t", "2", "--no-repack"]
        assert "killed by signal 11" in why
    assert server.proc.poll() is not None  # stopped on the way out
    assert "starting it again with --no-repack" in capsys.readouterr().err


def test_a_server_that_faults_anyway_or_exits_is_not_started_again(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    aborts = tmp_path / "aborts"
    aborts.write_text("#!/bin/sh\nkill -ABRT $$\n")
    aborts.chmod(0o755)
    for args in (["-nr"], ["-t", "2", "--no-repack"]):  # already without: nothing to drop
        with contextlib.ExitStack() as stack, pytest.raises(llamacpp.Crashed, match="signal 6"):
            llamacpp.start_llama_server(stack, aborts, gguf, args)
    exits = tmp_path / "exits"
    exits.write_text("#!/bin/sh\necho 'error: unknown argument' >&2\nexit 1\n")
    exits.chmod(0o755)
    with contextlib.ExitStack() as stack, pytest.raises(RuntimeError) as exc:
        llamacpp.start_llama_server(stack, exits, gguf, ["-t", "2"])
    assert not isinstance(exc.value, llamacpp.Crashed)
    assert "did not start" in str(exc.value) and "unknown argument" in str(exc.value)
