"""Fixtures of the transport conformance suite: every test runs against every transport."""

from __future__ import annotations

import contextlib
import os

import pytest

from pdmesh.transports import make_transport
from tests.support.transport_cases import HAVE_NIXL, HAVE_UCX, NO_NIXL, PROGRESS_S

os.environ.setdefault("UCX_TLS", "tcp")


@pytest.fixture(params=["tcp", pytest.param("ucx", marks=pytest.mark.ucx),
                        pytest.param("nixl", marks=pytest.mark.nixl)])
def kind(request) -> str:
    if request.param == "ucx" and not HAVE_UCX:
        pytest.skip("ucxx is not importable")
    if request.param == "nixl" and not HAVE_NIXL:
        pytest.skip(NO_NIXL)
    return request.param


@contextlib.asynccontextmanager
async def _transports(kind: str, faults: bool):
    receiver = make_transport(kind, progress_timeout_s=PROGRESS_S)
    sender = make_transport(kind, progress_timeout_s=PROGRESS_S, faults=faults)
    address = await receiver.start()
    await sender.start()
    yield receiver, sender, address
    await sender.close()
    await receiver.close()


@pytest.fixture
async def pair(kind):
    """(receiver, sender, receiver address) of one kind, closed afterwards."""
    async with _transports(kind, faults=False) as transports:
        yield transports


@pytest.fixture
async def faulty_pair(kind):
    """Like `pair`, but the sender is a FaultInjectingTransport: `sender.arm(rid, plan)`."""
    async with _transports(kind, faults=True) as transports:
        yield transports
