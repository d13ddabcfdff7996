"""A reserve request without valid request keys reserves nothing and is refused as a ticket
problem (admission's to fix), not as decode's final capacity refusal."""

from __future__ import annotations

import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import DATA_KEY, DEV_SIGNER, STREAM_KEY


@pytest.mark.parametrize("keys", [{"stream_key": ""}, {"data_key": "zz" * 32},
                                  {"stream_key": STREAM_KEY[:-2]}])
async def test_a_reserve_without_valid_keys_reserves_nothing(keys: dict[str, str]) -> None:
    svc = DecodeService(resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-k",
                                               "PDMESH_KV_TOKENS": "1024"}))
    ticket = DEV_SIGNER.sign(request_id="r1", tenant="t", cache_salt="s", prompt_len=8,
                             max_tokens=4, prefill_worker="p", decode_worker="decode-k",
                             ttl_s=30)
    reply = svc.reserve(m.ReserveRequest(ticket=ticket, **{
        "stream_key": STREAM_KEY, "data_key": DATA_KEY, **keys}))
    assert isinstance(reply, m.ReserveRefused)
    assert reply.outcome.code is m.Code.TICKET_INVALID  # not REFUSED: admission may retry
    assert "bad request keys" in reply.outcome.detail
    assert "r1" not in svc.requests and svc.pool.live_leases() == []
    await svc.transport.close()
