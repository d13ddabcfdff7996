"""close() of every transport: it returns in bounded time and leaves no owned task behind."""

from __future__ import annotations

import asyncio

import pytest


async def _nothing() -> None:
    return None


# A close() that spins never yields to the loop, so no asyncio timeout can end it; pytest's
# signal-based timeout does, and fails the test.
@pytest.mark.timeout(15)
async def test_close_returns_with_an_owned_task_ended_but_not_yet_reaped(pair):
    """A task that ended just before close() is still in the owned set: its done callback
    (which takes it out) is queued behind the coroutine calling close(). Since Python 3.12,
    gathering tasks that have all ended gives the loop no turn, so a close() that waited for
    the set to empty itself spun for ever (seen at the end of ucx conformance tests whose
    link task ended right before teardown)."""
    receiver, _, _ = pair
    task = receiver._spawn(_nothing())
    await asyncio.sleep(0)  # the task runs and ends; its done callbacks are queued after us
    assert task.done() and task in receiver._tasks
    await asyncio.wait_for(receiver.close(), 10)
    assert not receiver._tasks
