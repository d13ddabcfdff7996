"""UCX sending endpoints without peer error handling (`PDMESH_UCX_ERROR_MODE`,
transports/ucx.py `data_error_mode`).

An endpoint with peer error handling gets no shared-memory lane between two processes, so
in error mode "none" a sender posts its frames on a second endpoint, to the receiver's
worker address, without it; the link's listener endpoint keeps peer error handling and
carries the replies. These tests show:
- `auto` picks "none" only where every transport UCX may use is tcp / shared memory / self
  (on InfiniBand an unhandled peer error can abort the process), and a bad value is
  refused when the transport is built;
- each mode delivers on its own endpoint, and "none" really sends on the second one;
- over the shared-memory lanes (`UCX_TLS` unset, both peers in their own processes, as
  `pdmesh up` runs them), a transfer lands, and a sender killed mid-transfer is reported
  to the receiver at once (PEER_LOST through the listener endpoint, although the receiver
  has no progress timeout to speak of), which survives it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdmesh.transports import make_transport
from pdmesh.transports.ucx import ERROR_MODE_ENV, data_error_mode
from tests.support.transport_cases import HAVE_UCX, PROGRESS_S, make_case

pytestmark = [pytest.mark.ucx, pytest.mark.skipif(not HAVE_UCX, reason="ucxx is not importable")]

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "tests" / "support" / "transport_peer.py"


def test_auto_is_none_only_where_every_ucx_transport_survives_a_lost_peer():
    assert data_error_mode("auto", {"tcp"}) == "none"
    assert data_error_mode("auto", {"tcp", "posix", "sysv", "cma", "self"}) == "none"
    assert data_error_mode("auto", {"tcp", "cma", "rc_mlx5"}) == "peer"
    assert data_error_mode("auto", {"dc_mlx5"}) == "peer"
    assert data_error_mode("auto", set()) == "peer"  # unknown: the safe choice
    assert data_error_mode("peer", {"tcp"}) == "peer"
    assert data_error_mode("none", {"rc_verbs"}) == "none"  # the operator's explicit call


def test_a_bad_setting_is_refused_when_the_transport_is_built(monkeypatch):
    monkeypatch.setenv(ERROR_MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match=ERROR_MODE_ENV):
        make_transport("ucx")
    with pytest.raises(ValueError, match="expected auto, peer or none"):
        make_transport("ucx", error_mode="always")  # what services pass (--ucx-error-mode)


@pytest.mark.parametrize("mode", ["peer", "none", "auto"])
async def test_each_mode_delivers_on_its_own_endpoint(monkeypatch, mode):
    monkeypatch.setenv(ERROR_MODE_ENV, mode)
    receiver = make_transport("ucx", progress_timeout_s=PROGRESS_S)
    sender = make_transport("ucx", progress_timeout_s=PROGRESS_S)
    address = await receiver.start()
    try:
        for seed in (1, 2):  # the second transfer reuses the pooled link
            src, dst, target, plan = make_case(num_tokens=300, page_tokens=16, seed=seed)
            fut = receiver.expect(target)
            await sender.send(address, plan, src.views())
            await fut
            n = target.num_pages
            assert (dst.array[:n] == src.array[:n]).all()
        # auto: "none" under the suite's UCX_TLS=tcp, whatever this host's UCX offers.
        resolved = data_error_mode() if mode == "auto" else mode
        assert sender.error_mode == resolved
        # "none": the link sends on its own endpoint to the receiver's worker address.
        assert len(sender._tx_eps) == (1 if resolved == "none" else 0)
    finally:
        await sender.close()
        await receiver.close()


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", ERROR_MODE_ENV)}
    env.update(PYTHONPATH=str(ROOT), UCXPY_ENABLE_PYTHON_FUTURE="1")
    return await asyncio.create_subprocess_exec(
        sys.executable, str(PEER), *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)


async def _reap(*procs: asyncio.subprocess.Process) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def _line(proc: asyncio.subprocess.Process, within_s: float) -> str:
    return (await asyncio.wait_for(proc.stdout.readline(), within_s)).decode().strip()


PAGE_BYTES, PAGE_TOKENS = 1 << 20, 16


async def test_shared_memory_lanes_deliver_and_a_killed_sender_is_reported_at_once():
    """Both peers in their own processes with `UCX_TLS` unset (as `pdmesh up` runs them):
    error mode "none", so the bytes take UCX's shared-memory lanes."""
    n = 8
    geometry = ("1", str(n * PAGE_TOKENS), str(PAGE_TOKENS), str(PAGE_BYTES))
    procs = []
    try:
        rid = uuid.uuid4().hex
        procs.append(receiver := await _spawn("recv", "ucx", rid, *geometry))
        address = await _line(receiver, 30)
        assert address.startswith("ucx://"), address
        procs.append(sender := await _spawn("sendall", "ucx", address, rid, *geometry))
        verdict = await _line(receiver, 30)
        if verdict == "landed":  # printed only if the poll saw the transfer half-way
            verdict = await _line(receiver, 30)
        assert verdict == "done OK"
        assert await _line(sender, 30) == "sent none"

        # A sender killed mid-transfer (it stalls after pages 0 and 1): its data endpoint
        # has no peer error handling, but the link's listener endpoint reports the loss.
        # The receiver runs with a one-hour progress timeout: only that report can end it.
        rid = uuid.uuid4().hex
        procs.append(receiver := await _spawn("recv", "ucx", rid, *geometry))
        address = await _line(receiver, 30)
        procs.append(sender := await _spawn("send", "ucx", address, rid, *geometry))
        assert await _line(receiver, 30) == "landed"
        sender.send_signal(signal.SIGKILL)
        started = time.monotonic()
        assert await _line(receiver, 10) == "done PEER_LOST"
        assert time.monotonic() - started < 1.5
        await asyncio.sleep(0.5)
        assert receiver.returncode is None  # the lost peer did not take the receiver down
    finally:
        await _reap(*procs)
