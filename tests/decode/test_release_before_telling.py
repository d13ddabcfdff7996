"""Release before telling: a decode worker frees a request's lease before it publishes the
request's last event, so a publish that fails (nats-py raises OutboundBufferLimitError while
reconnecting with a full buffer) can neither leak the lease nor stop the service.

A real DecodeService (tiny model, real pool, real TCP transport object) whose NATS publish
raises; no NATS server is needed for the path under test.
"""

from __future__ import annotations

import nats.errors
import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import reserve


@pytest.fixture
def decode() -> DecodeService:
    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-t", "PDMESH_KV_TOKENS": "1024"})
    return DecodeService(cfg)


async def failing_publish(*_args: object, **_kwargs: object) -> None:
    raise nats.errors.OutboundBufferLimitError()


async def test_an_abort_frees_the_lease_even_when_publishing_fails(
        decode: DecodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode.rt, "publish", failing_publish)
    reserve(decode, "r1")
    assert len(decode.pool.live_leases()) == 1
    await decode.end(decode.requests["r1"], m.Outcome(code=m.Code.ABORTED, detail="test"))
    assert decode.pool.live_leases() == [] and "r1" not in decode.requests
    decode.pool.check_integrity()
    # The service goes on: the next request reserves and ends the same way.
    reserve(decode, "r2")
    await decode.end(decode.requests["r2"], m.Outcome(code=m.Code.PEER_RELEASED))
    assert decode.pool.live_leases() == []
    await decode.transport.close()


async def test_a_finished_generation_frees_the_lease_even_when_publishing_fails(
        decode: DecodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode.rt, "publish", failing_publish)
    reserve(decode, "r3")
    dreq = decode.requests["r3"]
    # As if the verified commit arrived with the prompt's first token; an EOS finishes it.
    eos = next(iter(decode.model.tokenizer.eos_token_ids))
    await decode.start_decoding(dreq, eos)
    assert dreq.lifecycle.outcome == m.FINISHED_STOP
    assert decode.pool.live_leases() == [] and "r3" not in decode.requests
    await decode.transport.close()


async def test_prefills_not_heard_of_within_the_ttl_are_forgotten(
        decode: DecodeService) -> None:
    """`prefill_seen` stays bounded by the live prefills (heartbeats under ever new ids,
    forged or from restarts, would otherwise grow it forever)."""
    import time

    now = time.monotonic()
    for i in range(100):
        decode.prefill_seen[f"gone-{i}"] = now - decode.cfg.worker_ttl_s - 1
    decode.prefill_seen["live"] = now
    await decode._watch_prefills()
    assert list(decode.prefill_seen) == ["live"]
    await decode.transport.close()


async def test_a_lease_whose_fence_cannot_finish_is_quarantined_not_reused(
        decode: DecodeService, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the transport cannot establish that a write into the pages has ended
    (`fence()` raises QUARANTINED), the pages never go back to the free list."""
    from pdmesh.transports import Reason, TransferError

    async def fence_fails(reservation_id: str) -> None:
        raise TransferError(reservation_id, Reason.QUARANTINED, "receive still posted")

    monkeypatch.setattr(decode.rt, "publish", failing_publish)
    monkeypatch.setattr(decode.transport, "fence", fence_fails)
    reserve(decode, "r4")
    pages = set(decode.requests["r4"].lease.page_ids)
    await decode.end(decode.requests["r4"], m.Outcome(code=m.Code.ABORTED))
    pool = decode.pool
    assert "r4" not in decode.requests and pool.live_leases() == []
    assert pool.num_quarantined_pages == len(pages)
    pool.check_integrity()  # free + leased + cached + quarantined == total
    # The whole rest of the pool can be leased, and never one of the quarantined pages.
    rest = pool.allocate("next", pool.num_free_pages * pool.spec.page_tokens)
    assert pages.isdisjoint(rest.page_ids)
    pool.release(rest, "stop")
    await decode.transport.close()


async def test_a_request_whose_loop_guard_fired_is_counted(decode: DecodeService,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """`pdmesh:structured_loops_total`: one per constrained request ended here whose
    reply repeated itself until the loop guard closed it; none for the others."""
    import json

    from prometheus_client import generate_latest

    from pdmesh.services.engine.sampling import Sampler

    monkeypatch.setattr(decode.rt, "publish", failing_publish)

    def loops_total() -> float:
        for line in generate_latest(decode.rt.registry).decode().splitlines():
            if line.startswith("pdmesh:structured_loops_total "):
                return float(line.split()[1])
        raise AssertionError("no pdmesh:structured_loops_total")

    structured = m.Structured(kind="json", spec=json.dumps(
        {"type": "object", "properties": {"a": {"type": "string"}}}))
    for rid, text, counted in (("plain", '{"a": "abc', 0.0), ("loop", '{"a": "' + "ab" * 20,
                                                              1.0)):
        reserve(decode, rid)
        dreq = decode.requests[rid]
        dreq.sampler = Sampler.for_request(
            m.Sampling(structured=structured, prior_output_ids=list(text.encode())), 64,
            decode.model.tokenizer.eos_token_ids, decode.grammars)
        await decode.end(dreq, m.Outcome(code=m.Code.ABORTED, detail="test"))
        assert loops_total() == counted, rid
    await decode.transport.close()
