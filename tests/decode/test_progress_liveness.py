"""Liveness by progress, on a real DecodeService (tiny model, real pool, real
transport object; publishing recorded): a reservation whose prefill keeps reporting
progress is kept however long the prefill takes; one whose progress stops is freed after
`prefill_stall_s`, as is one whose prefill stops heartbeating (sooner: the worker TTL)."""

from __future__ import annotations

import time

import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import reserve as reserve_on

STALL_S = 20.0


@pytest.fixture
def decode(monkeypatch: pytest.MonkeyPatch) -> DecodeService:
    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-l", "PDMESH_KV_TOKENS": "1024",
                                 "PDMESH_PREFILL_STALL_S": str(STALL_S)})
    svc = DecodeService(cfg)
    sent: list[object] = []

    async def record(_subject: str, msg: object, headers: object = None) -> None:
        sent.append(msg)

    monkeypatch.setattr(svc.rt, "publish", record)
    svc.sent = sent  # type: ignore[attr-defined]
    return svc


def reserve(svc: DecodeService, rid: str) -> str:
    return reserve_on(svc, rid, prompt_len=40, prefill_worker="prefill-l")


def age(svc: DecodeService, seconds: float) -> None:
    """Move the clock of every reservation back (instead of sleeping)."""
    for dreq in svc.requests.values():
        dreq.reserved_at -= seconds
        dreq.progress_at -= seconds


async def test_progress_keeps_a_reservation_past_the_stall_limit(
        decode: DecodeService) -> None:
    rid = reserve(decode, "long")
    for _ in range(5):  # five stall limits of prefill time, progress all along
        age(decode, STALL_S * 0.9)
        decode.prefill_seen["prefill-l"] = time.monotonic()  # its heartbeats arrive
        await decode._on_release(m.PrefillProgress(
            request_id="long", reservation_id=rid, done_tokens=10, total_tokens=40), None)
        await decode._watch_prefills()
        assert "long" in decode.requests
    await decode.transport.close()


async def test_a_reservation_without_progress_is_freed_after_the_stall_limit(
        decode: DecodeService) -> None:
    reserve(decode, "quiet")
    decode.prefill_seen["prefill-l"] = time.monotonic()  # the worker itself is alive
    age(decode, STALL_S + 1)
    decode.prefill_seen["prefill-l"] = time.monotonic()
    await decode._watch_prefills()
    assert "quiet" not in decode.requests and decode.pool.live_leases() == []
    failed = [e for e in decode.sent if isinstance(e, m.StreamFailed)]  # type: ignore[attr-defined]
    assert failed and failed[0].outcome.code is m.Code.DEADLINE
    assert "no progress" in failed[0].outcome.detail
    decode.pool.check_integrity()
    await decode.transport.close()


async def test_progress_for_another_reservation_changes_nothing(
        decode: DecodeService) -> None:
    reserve(decode, "mine")
    age(decode, STALL_S + 1)
    decode.prefill_seen["prefill-l"] = time.monotonic()
    # A progress message naming the request but not its reservation (stale or forged).
    await decode._on_release(m.PrefillProgress(
        request_id="mine", reservation_id="00000000-0000-0000-0000-000000000000",
        done_tokens=1, total_tokens=40), None)
    await decode._watch_prefills()
    assert "mine" not in decode.requests
    await decode.transport.close()
