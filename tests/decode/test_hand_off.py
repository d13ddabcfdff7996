"""A decode worker's drain hand-off: every request still held at the drain timeout ends
`worker_drained` (lease fenced and freed first) and its gateway is told, also a request the
engine's step holds at that moment (it is told when the step lets go; before, the drain's
close cancelled the loop that would have told it, and the gateway found out only from the
missing heartbeats, a TTL later). A real DecodeService (tiny model, real pool); its
publishes are recorded."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import reserve


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch) -> DecodeService:
    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-h", "PDMESH_KV_TOKENS": "1024"})
    svc = DecodeService(cfg)
    svc.told: list[m.StreamEvent] = []  # type: ignore[attr-defined]

    async def record(_subject: str, event: m.StreamEvent, _key: bytes) -> None:
        svc.told.append(event)  # type: ignore[attr-defined]

    monkeypatch.setattr(svc.rt, "publish_authenticated", record)
    return svc


async def test_every_request_held_at_the_drain_timeout_is_handed_to_its_gateway(
        decode: DecodeService) -> None:
    reserve(decode, "idle")
    reserve(decode, "stepping")
    stepping = decode.requests["stepping"]
    stepping.pinned = True  # inside the engine's step right now

    async def the_step_ends() -> None:
        await asyncio.sleep(0.3)
        lease = stepping.unpin()
        assert lease is not None
        await decode.conclude(stepping, lease)

    step = asyncio.ensure_future(the_step_ends())
    cut = await decode.hand_off()
    told = {e.request_id: e for e in decode.told}  # type: ignore[attr-defined]
    await step
    assert cut == 0
    assert set(told) == {"idle", "stepping"}
    for event in told.values():
        assert isinstance(event, m.StreamFailed)
        assert event.outcome.code is m.Code.WORKER_DRAINED
        assert event.outcome.worker == "decode-h"
    assert decode.pool.live_leases() == [] and not decode.requests
    decode.pool.check_integrity()
    await decode.transport.close()


async def test_a_step_that_never_ends_is_counted_as_cut(
        decode: DecodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    import pdmesh.services.decode.service as svc_mod

    monkeypatch.setattr(svc_mod, "HANDOFF_STEP_WAIT_S", 0.2)
    reserve(decode, "stuck")
    decode.requests["stuck"].pinned = True
    assert await decode.hand_off() == 1
    await decode.transport.close()
