"""Prefill's own gate on a dispatch: a malformed reservation is refused with a Release to
decode and a failure to the client (I6), never an exception that leaves decode holding its
lease until the transfer deadline. A real PrefillService (tiny model), publish recorded."""

from __future__ import annotations

import uuid

import pytest

from pdmesh.services.prefill.service import PrefillService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import DATA_KEY, DEV_SIGNER, STREAM_KEY


@pytest.fixture
def prefill() -> PrefillService:
    cfg = resolve("prefill", {}, {"PDMESH_WORKER_ID": "prefill-t", "PDMESH_KV_TOKENS": "1024"})
    return PrefillService(cfg)


def dispatch(svc: PrefillService, **reservation: object) -> m.PrefillDispatch:
    prompt = [5, 6, 7, 8, 9]
    ticket = DEV_SIGNER.sign(request_id=f"r-{uuid.uuid4().hex[:6]}", tenant="t",
                             cache_salt="s", prompt_len=len(prompt), max_tokens=4,
                             prefill_worker=svc.cfg.worker_id, decode_worker="decode-x",
                             ttl_s=30)
    fields = {"reservation_id": str(uuid.uuid4()), "epoch": 3, "page_ids": [0],
              "page_tokens": svc.pool.spec.page_tokens, "page_bytes": 64,
              "data_address": "tcp://127.0.0.1:9", **reservation}
    return m.PrefillDispatch(ticket=ticket, prompt_ids=prompt, sampling=m.Sampling(),
                             reservation=m.Reservation(**fields),  # type: ignore[arg-type]
                             stream_key=STREAM_KEY, data_key=DATA_KEY)


@pytest.mark.parametrize("reservation", [{"page_tokens": 0}, {"page_tokens": -16},
                                         {"page_ids": []}, {"page_ids": [0, 1, 2]}])
async def test_a_malformed_reservation_is_refused_and_decode_told(
        prefill: PrefillService, monkeypatch: pytest.MonkeyPatch,
        reservation: dict[str, object]) -> None:
    sent: list[tuple[str, object]] = []

    async def record(subject: str, msg: object, headers: object = None) -> None:
        sent.append((subject, msg))

    monkeypatch.setattr(prefill.rt, "publish", record)
    d = dispatch(prefill, **reservation)
    await prefill.accept(d)
    assert len(prefill.queue) == 0  # not queued
    (release_subject, release), (tokens_subject, failed) = sent
    assert release_subject == m.release_subject("decode-x")
    assert isinstance(release, m.Release)
    assert release.reservation_id == d.reservation.reservation_id
    assert release.outcome.code is m.Code.PREFILL_REJECTED
    assert isinstance(failed, m.StreamFailed) and failed.outcome.code is m.Code.PREFILL_REJECTED
    await prefill.transport.close()
