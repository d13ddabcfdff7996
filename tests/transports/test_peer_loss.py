"""Peer loss mid-transfer (killed, frozen) fails both sides within about a second; a
streamed sender frozen between chunks is bounded by the receiving slot's deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from pdmesh.transports import ExpectedTransfer, Reason, TransferError, TransferPlan
from tests.support.transport_cases import PROGRESS_S, Pages

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "tests" / "support" / "transport_peer.py"
PAGE_BYTES, PAGE_TOKENS, NUM_TOKENS = 256 << 10, 16, 160


async def spawn(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable, str(PEER), *args, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE)


async def reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    await proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_sender_killed_or_frozen(pair, kind, sig):
    receiver, _, address = pair
    n = NUM_TOKENS // PAGE_TOKENS
    dst = Pages(n, PAGE_BYTES, seed=5)
    rid = uuid.uuid4().hex
    fut = receiver.expect(ExpectedTransfer(rid, 1, tuple(range(100, 100 + n)), dst.views(),
                                           PAGE_BYTES, PAGE_TOKENS, NUM_TOKENS, 30.0))
    proc = await spawn("send", kind, address, rid, "1", str(NUM_TOKENS), str(PAGE_TOKENS),
                       str(PAGE_BYTES))
    try:
        deadline = time.monotonic() + 20
        while receiver.stats.frames_received < 2:  # mid-transfer: pages 0 and 1 landed
            assert time.monotonic() < deadline and not fut.done()
            await asyncio.sleep(0.01)
        proc.send_signal(sig)
        started = time.monotonic()
        with pytest.raises(TransferError) as got:
            await asyncio.wait_for(fut, 5)
        assert time.monotonic() - started < 1.5
        assert got.value.reason is Reason.PEER_LOST
        assert (dst.array[:2] == 0xFF).all()  # what landed is poisoned
    finally:
        await reap(proc)


async def test_receiver_frozen(pair, kind):
    _, sender, _ = pair
    n = 64  # 64 x 1 MiB: more than the socket buffers hold
    src = Pages(n, 1 << 20, seed=6)
    rid = uuid.uuid4().hex
    proc = await spawn("recv", kind, rid, "1", str(n * PAGE_TOKENS), str(PAGE_TOKENS),
                       str(1 << 20))
    try:
        address = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        proc.send_signal(signal.SIGSTOP)
        plan = TransferPlan(rid, 1, tuple(range(100, 100 + n)), n * PAGE_TOKENS, PAGE_TOKENS,
                            1 << 20, first_token=1, deadline_s=30.0)
        started = time.monotonic()
        with pytest.raises(TransferError) as sent:
            await sender.send(address, plan, src.views())
        assert time.monotonic() - started < 2.0
        assert sent.value.reason is Reason.PEER_LOST
    finally:
        await reap(proc)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
async def test_streamed_sender_killed_or_frozen_between_chunks(pair, kind, sig):
    """A streamed sender sent pages 0 and 1 (the last flagged PAUSE) and waits for the
    next chunk. Killed: the receiver knows at once. Frozen: it cannot be told from a long
    prefill chunk, so the link is kept past the progress timeout and the receiving slot's
    own deadline ends it (decode's liveness checks end it earlier in the mesh)."""
    receiver, _, address = pair
    n = NUM_TOKENS // PAGE_TOKENS
    dst = Pages(n, PAGE_BYTES, seed=5)
    snapshot = dst.snapshot()
    rid = uuid.uuid4().hex
    deadline_s = 8 * PROGRESS_S
    fut = receiver.expect(ExpectedTransfer(rid, 1, tuple(range(100, 100 + n)), dst.views(),
                                           PAGE_BYTES, PAGE_TOKENS, NUM_TOKENS, deadline_s))
    expected = time.monotonic() + deadline_s
    proc = await spawn("stream", kind, address, rid, "1", str(NUM_TOKENS), str(PAGE_TOKENS),
                       str(PAGE_BYTES))
    try:
        while receiver.stats.frames_received < 2:
            assert time.monotonic() < expected and not fut.done()
            await asyncio.sleep(0.01)
        proc.send_signal(sig)
        started = time.monotonic()
        if sig == signal.SIGSTOP:
            await asyncio.sleep(3 * PROGRESS_S)
            assert not fut.done(), "a paused transfer was torn down by the progress timeout"
        with pytest.raises(TransferError) as got:
            await asyncio.wait_for(fut, deadline_s + 5)
        if sig == signal.SIGKILL:
            assert time.monotonic() - started < 1.5
            assert got.value.reason is Reason.PEER_LOST
        else:
            assert got.value.reason is Reason.DEADLINE
            assert time.monotonic() > expected - 0.1
        assert (dst.array[:2] == 0xFF).all()  # what landed is poisoned
        assert (dst.array[2:] == snapshot[2:]).all()
    finally:
        await reap(proc)
