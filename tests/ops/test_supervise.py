"""`pdmesh up` supervises its processes as compose's `restart: always` would: a service
that exits is started again (same argv, environment, ports and worker id) after a back-off
while the others keep serving; one that keeps dying at its start, or nats-server exiting,
stops the mesh; Ctrl-C stops everything, gateway first, and restarts nothing.

The back-off is a pure policy (`RestartPolicy`); the launcher's supervision and stop run
here on small stand-in processes (milliseconds), then on a real `pdmesh up --model tiny`.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pdmesh.services.ops import launcher as launcher_mod
from pdmesh.services.ops.launcher import (
    Backoff,
    Child,
    Launcher,
    RestartPolicy,
    describe_exit,
)
from tests.support.meshproc import Mesh, mesh_env, run_mesh
from tests.support.meshstats import worker_stats
from tests.support.oracle import expected_text

# The real-mesh cases (minutes on two cores) run under `make test-chaos`.
ON_A_MESH = pytest.mark.skipif(os.environ.get("PDMESH_CHAOS_TESTS") != "1",
                               reason="real pdmesh up runs: make test-chaos")

# -- the policy -------------------------------------------------------------------------------


def _exits(policy: RestartPolicy, ready_for: list[float]) -> list[tuple[Backoff, float | None]]:
    """The back-off and delay after each exit of processes ready for these many seconds."""
    backoff, out = Backoff(), []
    for ready_s in ready_for:
        backoff = policy.after_exit(backoff, ready_s)
        out.append((backoff, policy.delay_s(backoff)))
    return out


def test_the_delay_doubles_from_half_a_second_to_ten() -> None:
    steps = _exits(RestartPolicy(), [15.0] * 8)  # each was ready a while, never 30 s
    assert [delay for _, delay in steps] == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert [b.attempt for b, _ in steps] == list(range(1, 9))
    assert all(b.quick_exits == 0 for b, _ in steps)  # never given up on


def test_a_run_of_thirty_seconds_starts_the_back_off_over() -> None:
    steps = _exits(RestartPolicy(), [15.0, 15.0, 15.0, 30.0, 15.0])
    assert [delay for _, delay in steps] == [0.5, 1, 2, 0.5, 1]


def test_five_restarts_in_a_row_that_do_not_come_back_give_up() -> None:
    # Ready for an hour, then every restart dies before it is ready (0) or soon after: the
    # fifth restart's death stops the mesh (delay None).
    steps = _exits(RestartPolicy(), [3600.0, 0.0, 3.0, 0.0, 0.0, 9.0])
    assert [b.quick_exits for b, _ in steps] == [0, 1, 2, 3, 4, 5]
    assert [delay for _, delay in steps] == [0.5, 1, 2, 4, 8, None]


def test_a_restart_that_came_back_resets_the_quick_count() -> None:
    # Dying quickly 4 times, then ready past quick_exit_s: not given up, and the count
    # starts over (the back-off keeps growing: it was not ready 30 s).
    steps = _exits(RestartPolicy(), [1.0, 1.0, 1.0, 1.0, 12.0, 1.0, 1.0])
    assert [b.quick_exits for b, _ in steps] == [1, 2, 3, 4, 0, 1, 2]
    assert None not in [delay for _, delay in steps]
    assert steps[-1][1] == 10


def test_exit_descriptions() -> None:
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"


# -- the launcher on stand-in processes -------------------------------------------------------

# A stand-in service: logs its start, and on SIGTERM drains for `drain` seconds (negative:
# ignores SIGTERM), logging both ends of it.
STAND_IN = """
import os, signal, sys, time
log, name, drain = sys.argv[1], sys.argv[2], float(sys.argv[3])
def note(what):
    with open(log, "a") as f:
        f.write(f"{name} {what}\\n")
def on_term(*_):
    note("term")
    time.sleep(drain)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term if drain >= 0 else signal.SIG_IGN)
note(f"start {os.getpid()}")
while True:
    time.sleep(1)
"""
CRASHER = "import sys; sys.exit(3)"
FAST = RestartPolicy(first_delay_s=0.01, max_delay_s=0.05, quick_exit_s=5.0)


def _launcher(**kwargs: object) -> Launcher:
    options: dict = {"policy": FAST, "worker_ttl_s": 0.0, "quiet": True, **kwargs}
    return Launcher(nats_url="nats://127.0.0.1:1", gateway_port=0, prefill=1, decode=1,
                    env={}, **options)


async def _stand_in(launcher: Launcher, log: Path, name: str, role: str,
                    drain_s: float = 0.0, code: str = STAND_IN) -> Child:
    argv = [sys.executable, "-c", code, str(log), name, str(drain_s)]
    child = await launcher._spawn(name, argv, {**os.environ, "STAND_IN": name}, role)
    launcher.children.append(child)
    child.ready_at = time.monotonic()  # as `start()` marks it (a stand-in has no /ready)
    if code == STAND_IN:
        await _until(lambda: f"{name} start {child.proc.pid}" in _text(log))
    return child


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def _cmdline(pid: int) -> list[str]:
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def _text(log: Path) -> str:
    return log.read_text() if log.exists() else ""


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(30)
async def test_a_killed_service_restarts_with_the_same_command_and_env(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log"
    launcher = _launcher(worker_ttl_s=1.0)
    other = await _stand_in(launcher, log, "prefill", "prefill")
    victim = await _stand_in(launcher, log, "decode-1", "decode")
    supervising = asyncio.create_task(launcher.supervise())
    try:
        old_pid, argv = victim.proc.pid, victim.argv
        os.kill(old_pid, signal.SIGKILL)
        await _until(lambda: victim.proc.pid != old_pid
                     and f"decode-1 start {victim.proc.pid}" in _text(log))
        new_pid = victim.proc.pid
        assert _cmdline(new_pid) == argv
        assert _environ(new_pid)["STAND_IN"] == "decode-1"
        assert other.proc.returncode is None and not supervising.done()
        err = capsys.readouterr().err
        # A worker waits out the heartbeat TTL (1 s here) + 0.5 s, whatever the back-off.
        assert re.search(r"pdmesh: decode-1 exited \(killed by SIGKILL\) after \d+\.\d+s up; "
                         r"restart 1 in 1\.5s", err), err
        assert f"pdmesh: decode-1 restarted (pid {new_pid})" in err
        assert "prefill" not in err
    finally:
        await _cancel(supervising)
        await launcher.stop()
    assert launcher.alive() == []


@pytest.mark.timeout(30)
async def test_a_service_dying_at_once_repeatedly_stops_the_mesh(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log"
    launcher = _launcher()
    await _stand_in(launcher, log, "prefill", "prefill")
    await _stand_in(launcher, log, "admission", "admission", code=CRASHER)
    reason = await asyncio.wait_for(launcher.supervise(), 20)
    assert reason == ("admission did not come back 5 times in a row (each exited before it "
                      "was ready for 5s; last: exit code 3); stopping the mesh")
    err = capsys.readouterr().err
    assert [int(n) for n in re.findall(r"admission exited \(exit code 3\).* restart (\d+)",
                                       err)] == [1, 2, 3, 4]
    await launcher.stop()
    assert launcher.alive() == []


@pytest.mark.timeout(30)
async def test_restart_never_stops_the_mesh_at_the_first_exit(tmp_path: Path) -> None:
    launcher = _launcher(restart="never")
    await _stand_in(launcher, tmp_path / "log", "decode", "decode", code=CRASHER)
    reason = await asyncio.wait_for(launcher.supervise(), 10)
    assert reason == "decode exited (exit code 3); stopping the mesh (--restart never)"
    await launcher.stop()


@pytest.mark.timeout(30)
async def test_keep_going_leaves_an_exited_service_dead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log"
    launcher = _launcher(keep_going=True)
    other = await _stand_in(launcher, log, "prefill", "prefill")
    victim = await _stand_in(launcher, log, "decode", "decode")
    supervising = asyncio.create_task(launcher.supervise())
    try:
        os.kill(victim.proc.pid, signal.SIGKILL)
        await _until(lambda: "not restarted" in capsys.readouterr().err)
        await asyncio.sleep(1.0)
        assert not supervising.done(), "the mesh goes on"
        assert victim.proc.returncode == -signal.SIGKILL  # the same, dead process
        assert other.proc.returncode is None
        assert _text(log).count("decode start") == 1
    finally:
        await _cancel(supervising)
        await launcher.stop()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep_going", [False, True])
async def test_nats_server_exiting_stops_the_mesh(tmp_path: Path, keep_going: bool) -> None:
    log = tmp_path / "log"
    launcher = _launcher(keep_going=keep_going)
    await _stand_in(launcher, log, "decode", "decode")
    nats = await _stand_in(launcher, log, "nats", "")
    launcher.children.remove(nats)
    launcher.nats = nats
    supervising = asyncio.create_task(launcher.supervise())
    os.kill(nats.proc.pid, signal.SIGKILL)
    assert await asyncio.wait_for(supervising, 10) == (
        "nats-server exited (killed by SIGKILL); stopping the mesh")
    await launcher.stop()
    assert _text(log).count("nats start") == 1


@pytest.mark.timeout(30)
async def test_stop_drains_the_gateway_then_the_workers_then_admission_then_nats(
        tmp_path: Path) -> None:
    log = tmp_path / "log"
    launcher = _launcher(drain_timeout_s=5.0)
    for name, role in (("admission", "admission"), ("prefill", "prefill"),
                       ("decode-0", "decode"), ("decode-1", "decode"), ("gateway", "gateway")):
        await _stand_in(launcher, log, name, role, drain_s=0.3)
    nats = await _stand_in(launcher, log, "nats", "", drain_s=0.1)
    launcher.children.remove(nats)
    launcher.nats = nats
    await launcher.stop()
    events = [ln for ln in _text(log).splitlines() if not ln.split()[1] == "start"]
    at = {ev: i for i, ev in enumerate(events)}
    workers = ("prefill", "decode-0", "decode-1")
    assert at["gateway exit"] < min(at[f"{w} term"] for w in workers), events
    assert max(at[f"{w} exit"] for w in workers) < at["admission term"], events
    assert at["admission exit"] < at["nats term"], events
    assert all(c.proc.returncode == 0 for c in [*launcher.children, nats])  # none killed
    assert _text(log).count("start") == 6  # nothing restarted


@pytest.mark.timeout(30)
async def test_stop_waits_the_drain_timeout_and_a_margin_then_kills(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "STOP_MARGIN_S", 0.5)
    log = tmp_path / "log"
    launcher = _launcher(drain_timeout_s=1.5)
    slow = await _stand_in(launcher, log, "decode", "decode", drain_s=1.2)
    stuck = await _stand_in(launcher, log, "prefill", "prefill", drain_s=-1)
    started = time.monotonic()
    await launcher.stop()
    took = time.monotonic() - started
    assert slow.proc.returncode == 0, "a drain within the timeout is not cut"
    assert stuck.proc.returncode == -signal.SIGKILL
    assert 1.9 <= took < 4.0, took


@pytest.mark.timeout(30)
async def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    launcher = _launcher(drain_timeout_s=30.0)
    stuck = await _stand_in(launcher, tmp_path / "log", "gateway", "gateway", drain_s=-1)
    stopping = asyncio.create_task(launcher.stop())
    await asyncio.sleep(0.3)
    assert not stopping.done()
    launcher.kill_now()
    await asyncio.wait_for(stopping, 3)
    assert stuck.proc.returncode == -signal.SIGKILL


# -- a real `pdmesh up` -----------------------------------------------------------------------


def _services(mesh: Mesh) -> dict[str, int]:
    """Process name (decode-1, gateway, ...) -> pid, from each child's worker id."""
    out = {}
    for pid in mesh.child_pids():
        try:
            wid = _environ(pid).get("PDMESH_WORKER_ID", "")
        except OSError:
            continue  # gone meanwhile
        if wid:
            out[wid.rsplit("-", 1)[0]] = pid
    return out


def _complete(mesh: Mesh, prompt: str) -> tuple[int, dict]:
    return mesh.http("POST", "/v1/completions", {"model": "tiny", "prompt": prompt,
                                                 "max_tokens": 6, "temperature": 0}, timeout=30)


def _launcher_lines(mesh: Mesh, needle: str) -> list[str]:
    return [ln for ln in list(mesh.log) if ln.startswith("pdmesh: ") and needle in ln]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@ON_A_MESH
@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_decode_worker_killed_with_sigkill_is_restarted_while_the_mesh_serves() -> None:
    with run_mesh("--decode", "2") as mesh:
        before = _services(mesh)
        assert {"admission", "prefill", "decode-0", "decode-1", "gateway"} <= set(before)
        wid = _environ(before["decode-1"])["PDMESH_WORKER_ID"]
        os.kill(before["decode-1"], signal.SIGKILL)
        answers, deadline = [], time.monotonic() + 60
        while not _launcher_lines(mesh, "decode-1 restarted"):
            assert time.monotonic() < deadline, "\n".join(mesh.log[-40:])
            prompt = f"while decode-1 is down {len(answers)}"
            status, body = _complete(mesh, prompt)
            assert status == 200, body
            answers.append(body["choices"][0]["text"] == expected_text(prompt, 6))
        assert answers and all(answers)
        assert mesh.proc.poll() is None, "the mesh kept running"
        (exited,) = _launcher_lines(mesh, "decode-1 exited")
        assert "killed by SIGKILL" in exited and "restart 1 in" in exited
        (restarted,) = _launcher_lines(mesh, "decode-1 restarted")
        new_pid = int(re.search(r"pid (\d+)", restarted).group(1))
        deadline = time.monotonic() + 60
        while not _launcher_lines(mesh, f"decode-1 ready again (pid {new_pid})"):
            assert time.monotonic() < deadline, "\n".join(mesh.log[-40:])
            time.sleep(0.2)
        assert new_pid != before["decode-1"]
        after = _services(mesh)
        assert after == {**before, "decode-1": new_pid}, "only decode-1 was restarted"
        # Same worker id, new process: its heartbeats come back, from the new pid.
        deadline = time.monotonic() + 30
        while getattr(worker_stats(mesh.nats_url, listen_s=1.0).get(wid), "pid", 0) != new_pid:
            assert time.monotonic() < deadline, f"{wid} never heartbeated again"
        for i in range(4):  # both decodes serve (admission spreads the requests)
            status, body = _complete(mesh, f"after the restart {i}")
            assert status == 200 and body["choices"][0]["text"] == expected_text(
                f"after the restart {i}", 6), body


@ON_A_MESH
@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigint_stops_every_process_gateway_first_and_restarts_none() -> None:
    with run_mesh(env=mesh_env(PDMESH_LOG_LEVEL="INFO")) as mesh:
        children = mesh.child_pids()
        assert len(children) == 5, children  # nats-server + four services
        assert _complete(mesh, "before the stop")[0] == 200
        mesh.proc.send_signal(signal.SIGINT)
        assert mesh.proc.wait(120) == 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in children if _alive(p)] == []
    assert _launcher_lines(mesh, "SIGINT: stopping the mesh")
    assert not _launcher_lines(mesh, "restart"), mesh.log[-40:]
    log = list(mesh.log)

    def first(service: str, what: str) -> int:
        return next(i for i, ln in enumerate(log)
                    if ln.startswith(f"[{service}] ") and f" {what} " in ln)

    workers = ("prefill", "decode")
    assert first("gateway", "drained") < min(first(w, "draining") for w in workers), log
    assert max(first(w, "drained") for w in workers) < first("admission", "draining"), log


@ON_A_MESH
@pytest.mark.mesh
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_that_cannot_come_back_stops_the_mesh_with_a_clear_line() -> None:
    """The decode dies, and its HTTP port is taken meanwhile by another process: every
    restart fails at once (port in use), so after 5 of them the mesh stops."""
    with run_mesh() as mesh:
        pid = _services(mesh)["decode"]
        port = int(_environ(pid)["PDMESH_HTTP_PORT"])
        # Ready past quick_exit_s first: this death is not a failed restart, the next 5 are.
        time.sleep(RestartPolicy().quick_exit_s + 0.5)
        holder = socket.socket()
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 3
            while True:
                try:
                    holder.bind(("127.0.0.1", port))
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the killed decode kept its port"
                    time.sleep(0.02)
            holder.listen()
            code = mesh.proc.wait(200)
        finally:
            holder.close()
        assert code == 1, mesh.log[-40:]
        restarts = [int(n) for ln in _launcher_lines(mesh, "decode exited (")
                    for n in re.findall(r"; restart (\d+) in", ln)]
        assert restarts == [1, 2, 3, 4, 5], mesh.log[-60:]
        assert len(_launcher_lines(mesh, "up, never ready; restart")) == 4  # restarts 2 to 5
        assert not _launcher_lines(mesh, "ready again")
        assert _launcher_lines(mesh, "decode did not come back 5 times in a row (each exited "
                               "before it was ready for 10s; last: exit code 1); stopping the "
                               "mesh"), mesh.log[-60:]
        assert any("address already in use" in ln for ln in mesh.log)
