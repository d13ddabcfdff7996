"""Decode reports the KV its leases hold per tenant (the heartbeat's `tenant_tokens`), from
which admission holds each tenant to its kv_share."""

from __future__ import annotations

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import DATA_KEY, DEV_SIGNER, STREAM_KEY


async def test_decode_counts_each_tenants_leased_tokens_page_rounded() -> None:
    svc = DecodeService(resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-t",
                                               "PDMESH_KV_TOKENS": "1024",
                                               "PDMESH_PAGE_TOKENS": "16"}))
    for rid, tenant, prompt_len in (("a1", "alice", 8), ("a2", "alice", 30), ("b1", "bob", 40)):
        ticket = DEV_SIGNER.sign(request_id=rid, tenant=tenant, cache_salt="s",
                                 prompt_len=prompt_len, max_tokens=4, prefill_worker="p",
                                 decode_worker="decode-t", ttl_s=30)
        reply = svc.reserve(m.ReserveRequest(ticket=ticket, stream_key=STREAM_KEY,
                                             data_key=DATA_KEY))
        assert isinstance(reply, m.Reserved), reply
    # 12 -> 1 page, 34 -> 3 pages, 44 -> 3 pages of 16 tokens.
    assert svc.tenant_tokens() == {"alice": 64, "bob": 48}
    await svc.end(svc.requests["a2"], m.Outcome(code=m.Code.ABORTED))
    assert svc.tenant_tokens() == {"alice": 16, "bob": 48}
    await svc.transport.close()
