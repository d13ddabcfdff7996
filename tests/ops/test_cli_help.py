"""`pdmesh` help: `serve --help` and `bench --help` print help and exit 0; the top-level
usage names every command."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pdmesh.services.ops import cli
from tests.support.meshproc import REPO


@pytest.mark.parametrize(("cmd", "names"), [("serve", cli.SERVE), ("bench", cli.BENCH)])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_serve_and_bench_help_exit_0_naming_their_choices(
        cmd: str, names: dict[str, str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([cmd, flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdmesh {cmd} ")
    for name in names:
        assert name in out, (name, out)


def test_serve_and_bench_without_a_choice_still_fail() -> None:
    assert cli.main(["serve"]) == 2
    assert cli.main(["bench", "nothing"]) == 2


def test_the_top_level_usage_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = re.match(r"usage: pdmesh \{([a-z,]+)\}", out)
    assert listed, out
    commands = {"up", "serve", "bench", *cli.PASSTHROUGH}
    assert set(listed.group(1).split(",")) == commands
    assert {"secrets", "certs"} <= commands
    for command in commands:
        assert re.search(rf"^  {command}\b", out, re.M), (command, out)


def test_the_installed_command_prints_serve_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "serve", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "usage: pdmesh serve" in proc.stdout, proc.stderr
