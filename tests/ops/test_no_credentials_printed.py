"""No credential printed: a start-up error, `pdmesh check` (text and `--json`) and the log
lines of a service never show a NATS password or a secret setting's value."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from pdmesh.loadtest import check
from pdmesh.services.ops import cli
from pdmesh.services.protocol.errors import StartupError
from tests.support.meshproc import REPO, mesh_env

PASSWORD = "S3cretPW-" + secrets.token_hex(4)


def _serve(role: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = mesh_env(PDMESH_NATS_CONNECT_TIMEOUT_S="1", PDMESH_HTTP_PORT="0",
                    PDMESH_LOG_LEVEL="DEBUG", **env)
    return subprocess.run([sys.executable, "-m", "pdmesh.services.ops.cli", "serve", role,
                           *args], cwd=REPO, env=full, capture_output=True, text=True,
                          timeout=120)


def test_a_start_up_error_does_not_show_the_nats_url_password() -> None:
    proc = _serve("admission", "--nats-url", f"nats://admin:{PASSWORD}@127.0.0.1:1")
    assert proc.returncode == 1, proc.stderr
    assert PASSWORD not in proc.stderr + proc.stdout
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("pdmesh: error:")]
    assert len(errors) == 1 and "127.0.0.1:1" in errors[0], proc.stderr
    assert "unreachable" in errors[0]


def test_cli_masks_the_password_of_any_error_it_prints(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever text an error carries (a StartupError quoting its URL as given)."""
    exc = StartupError("admission", f"NATS at nats://admin:{PASSWORD}@127.0.0.1:1",
                       "unreachable for 1s (TimeoutError)")
    assert cli._fail(str(exc), 1) == 1
    err = capsys.readouterr().err
    assert err == ("pdmesh: error: admission: cannot start: NATS at "
                   "nats://admin:***@127.0.0.1:1: unreachable for 1s (TimeoutError)\n")


def test_the_nats_password_setting_is_never_printed() -> None:
    """Given as --nats-password (or its env var), at DEBUG, through a failed start."""
    proc = _serve("admission", "--nats-url", "nats://127.0.0.1:1", "--nats-user", "admin",
                  "--nats-password", PASSWORD)
    assert proc.returncode == 1 and "unreachable" in proc.stderr, proc.stderr
    assert PASSWORD not in proc.stderr + proc.stdout
    proc = _serve("admission", "--nats-url", "nats://127.0.0.1:1",
                  PDMESH_NATS_USER="admin", PDMESH_NATS_PASSWORD=PASSWORD)
    assert proc.returncode == 1 and PASSWORD not in proc.stderr + proc.stdout


@pytest.mark.parametrize("as_json", [True, False])
def test_check_does_not_print_the_tools_password(as_json: bool,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The README's `pdmesh check --nats-url "$(cat tools.url)"`, NATS unreachable."""
    argv = ["--nats-url", f"nats://tools:{PASSWORD}@127.0.0.1:1", "--connect-timeout-s",
            "0.5", "--listen-s", "0.1"]
    code = check.main([*argv, "--json"] if as_json else argv)
    out, err = capsys.readouterr()
    assert code == check.EXIT_UNREACHABLE
    assert PASSWORD not in out + err, out + err
    assert "nats://tools:***@127.0.0.1:1" in err
    if as_json:
        report = json.loads(out.splitlines()[-1])
        assert report["nats_url"] == "nats://tools:***@127.0.0.1:1"
        assert PASSWORD not in report["verdict"]


def test_check_report_json_masks_the_url_it_is_given() -> None:
    report = check.report_json([], check.Verdict(check.EXIT_OK, "ok"),
                               nats_url=f"tls://tools:{PASSWORD}@h1:4222,tls://h2:4222",
                               listen_s=1.0)
    assert report["nats_url"] == "tls://tools:***@h1:4222,tls://h2:4222"
