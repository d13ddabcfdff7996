"""Liveness by progress, on a real DecodeService (tiny model, real pool, real
transport object; publishing recorded): a reservation whose prefill keeps reporting
progress is kept however long the prefill takes; one whose progress stops, or only repeats
itself, is freed after `prefill_stall_s`, as is one whose prefill stops heartbeating
(sooner: the worker TTL). Progress and releases count only with the request's MAC: another
prefill worker, which NATS lets publish on the same subject, changes nothing."""

from __future__ import annotations

import time

import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import reserve as reserve_on
from tests.support.decode_reserve import to_decode

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
    for chunk in range(5):  # five stall limits of prefill time, progress all along
        age(decode, STALL_S * 0.9)
        decode.prefill_seen["prefill-l"] = time.monotonic()  # its heartbeats arrive
        progress = m.PrefillProgress(request_id="long", reservation_id=rid,
                                     done_tokens=8 * (chunk + 1), total_tokens=40)
        await decode._on_release(progress, to_decode(decode, progress))
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
    progress = m.PrefillProgress(request_id="mine",
                                 reservation_id="00000000-0000-0000-0000-000000000000",
                                 done_tokens=1, total_tokens=40)
    await decode._on_release(progress, to_decode(decode, progress))
    await decode._watch_prefills()
    assert "mine" not in decode.requests
    await decode.transport.close()


async def test_a_queued_request_is_kept_while_its_prefill_says_so(
        decode: DecodeService) -> None:
    """Nothing computed yet (done_tokens 0, waiting in prefill's queue): each word counts."""
    rid = reserve(decode, "queued")
    for _ in range(3):
        age(decode, STALL_S * 0.9)
        decode.prefill_seen["prefill-l"] = time.monotonic()
        progress = m.PrefillProgress(request_id="queued", reservation_id=rid, done_tokens=0,
                                     total_tokens=40)
        await decode._on_release(progress, to_decode(decode, progress))
        await decode._watch_prefills()
        assert "queued" in decode.requests
    await decode.transport.close()


async def test_progress_that_does_not_advance_frees_the_reservation(
        decode: DecodeService) -> None:
    """A prefill that keeps repeating the same computed count mid-prompt holds the pages
    only until the stall limit: the repetitions are counted, not believed."""
    rid = reserve(decode, "stuck")
    for _ in range(3):
        age(decode, STALL_S * 0.5)
        decode.prefill_seen["prefill-l"] = time.monotonic()
        progress = m.PrefillProgress(request_id="stuck", reservation_id=rid, done_tokens=16,
                                     total_tokens=40)
        await decode._on_release(progress, to_decode(decode, progress))
        await decode._watch_prefills()
    assert "stuck" not in decode.requests and decode.pool.live_leases() == []
    assert decode.rt.refused_messages.labels("decode", "stale_progress")._value.get() == 2
    await decode.transport.close()


async def test_progress_and_release_without_the_request_mac_change_nothing(
        decode: DecodeService) -> None:
    """Another prefill worker (NATS lets any prefill publish on this subject) knows the
    request and reservation ids but not the request's key: its progress keeps nothing
    alive and its Release frees nothing."""
    rid = reserve(decode, "victim")
    age(decode, STALL_S + 1)
    decode.prefill_seen["prefill-l"] = time.monotonic()
    forged = m.PrefillProgress(request_id="victim", reservation_id=rid, done_tokens=1,
                               total_tokens=40)
    await decode._on_release(forged, to_decode(decode, forged, key=None))
    await decode._on_release(forged, to_decode(decode, forged, key="00" * 32))
    await decode._watch_prefills()
    assert "victim" not in decode.requests  # the forged progress did not keep it
    rid = reserve(decode, "victim-2")
    release = m.Release(request_id="victim-2", reservation_id=rid,
                        outcome=m.Outcome(code=m.Code.ABORTED, detail="forged"))
    await decode._on_release(release, to_decode(decode, release, key=None))
    assert "victim-2" in decode.requests  # the forged release freed nothing
    assert decode.rt.refused_messages.labels("decode", "peer_mac")._value.get() == 3
    await decode._on_release(release, to_decode(decode, release))  # the real prefill's
    assert "victim-2" not in decode.requests
    await decode.transport.close()
