"""A colocated worker applies prefill's token-range gate too: a dispatch whose prompt holds a
token id outside the vocabulary (signed by admission, so only a bug or an insider sends it)
ends that request with PREFILL_REJECTED and frees its lease; it never reaches the engine."""

from __future__ import annotations

import pytest

from pdmesh.services.colocated.service import build
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import DATA_KEY, DEV_SIGNER, STREAM_KEY


@pytest.mark.parametrize("bad_id", [-1, 1 << 20])
async def test_a_token_id_outside_the_vocabulary_is_refused(
        monkeypatch: pytest.MonkeyPatch, bad_id: int) -> None:
    cfg = resolve("colocated", {}, {"PDMESH_WORKER_ID": "colo-t", "PDMESH_KV_TOKENS": "1024"})
    svc = build(cfg)
    sent: list[object] = []

    async def record(subject: str, msg: object, headers: object = None) -> None:
        sent.append(msg)

    monkeypatch.setattr(svc.rt, "publish", record)
    svc.intake.svc = svc  # as attach() does, without subscribing
    prompt = [5, 6, bad_id, 8]
    ticket = DEV_SIGNER.sign(request_id="r1", tenant="t", cache_salt="s",
                             prompt_len=len(prompt), max_tokens=4, prefill_worker="colo-t",
                             decode_worker="colo-t", ttl_s=30)
    reserved = svc.reserve(m.ReserveRequest(ticket=ticket, stream_key=STREAM_KEY,
                                            data_key=DATA_KEY))
    assert isinstance(reserved, m.Reserved)
    d = m.PrefillDispatch(ticket=ticket, prompt_ids=prompt, sampling=m.Sampling(),
                          reservation=reserved.reservation,
                          grant=DEV_SIGNER.grant(ticket, prompt, reserved.reservation),
                          stream_key=STREAM_KEY, data_key=DATA_KEY)
    await svc.intake._on_dispatch(d, None)  # type: ignore[arg-type]
    assert "r1" not in svc.requests and svc.pool.live_leases() == []
    (failed,) = sent
    assert isinstance(failed, m.StreamFailed)
    assert failed.outcome.code is m.Code.PREFILL_REJECTED
    await svc.transport.close()
