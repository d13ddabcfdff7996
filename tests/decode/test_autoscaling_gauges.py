"""The per-worker gauges an autoscaler scales on (compose/helm's KEDA objects query them):
decode's running and waiting requests, prefill's queued prompt tokens, each with
`model_name` and `worker`, read off the worker's own /metrics registry."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.prefill.service import PrefillJob, PrefillService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.lifecycle import RequestState
from pdmesh.services.runtime.config import resolve
from tests.support.decode_reserve import DATA_KEY, DEV_SIGNER, STREAM_KEY


def _sample(registry: object, name: str) -> dict[str, float]:
    """{worker: value} of gauge `name` (asserting its model_name label)."""
    out = {}
    for line in generate_latest(registry).decode().splitlines():  # type: ignore[arg-type]
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            parts = dict(p.split("=", 1) for p in labels.split(","))
            assert parts["model_name"] == '"tiny"', line
            out[parts["worker"].strip('"')] = float(value)
    return out


async def test_decode_running_and_waiting_requests() -> None:
    svc = DecodeService(resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-g",
                                               "PDMESH_KV_TOKENS": "1024"}))
    for rid in ("r1", "r2", "r3"):
        ticket = DEV_SIGNER.sign(request_id=rid, tenant="t", cache_salt="s", prompt_len=8,
                                 max_tokens=4, prefill_worker="p", decode_worker="decode-g",
                                 ttl_s=30)
        reply = svc.reserve(m.ReserveRequest(ticket=ticket, stream_key=STREAM_KEY,
                                             data_key=DATA_KEY))
        assert isinstance(reply, m.Reserved), reply
    reg = svc.rt.registry
    assert _sample(reg, "pdmesh:decode_requests_waiting") == {"decode-g": 3}
    assert _sample(reg, "pdmesh:decode_requests_running") == {"decode-g": 0}
    r1 = svc.requests["r1"]
    r1.lifecycle.advance(RequestState.TRANSFERRED)
    r1.lifecycle.advance(RequestState.DECODING)
    assert _sample(reg, "pdmesh:decode_requests_waiting") == {"decode-g": 2}
    assert _sample(reg, "pdmesh:decode_requests_running") == {"decode-g": 1}
    await svc.end(svc.requests["r2"], m.Outcome(code=m.Code.ABORTED))
    assert _sample(reg, "pdmesh:decode_requests_waiting") == {"decode-g": 1}
    await svc.transport.close()


async def test_prefill_queued_prompt_tokens() -> None:
    svc = PrefillService(resolve("prefill", {}, {"PDMESH_WORKER_ID": "prefill-g",
                                                 "PDMESH_KV_TOKENS": "1024"}))
    reg = svc.rt.registry
    assert _sample(reg, "pdmesh:prefill_queued_prompt_tokens") == {"prefill-g": 0}
    jobs = []
    for rid, n in (("a", 40), ("b", 25)):
        ticket = DEV_SIGNER.sign(request_id=rid, tenant="t", cache_salt="s", prompt_len=n,
                                 max_tokens=4, prefill_worker="prefill-g",
                                 decode_worker="d", ttl_s=30)
        job = PrefillJob(m.PrefillDispatch(
            ticket=ticket, prompt_ids=list(range(n)), sampling=m.Sampling(),
            reservation=m.Reservation(reservation_id=rid, epoch=1, page_ids=[],
                                      page_tokens=16, page_bytes=1, data_address=""),
            grant="", stream_key=STREAM_KEY, data_key=DATA_KEY))
        svc.queue.push(job)
        jobs.append(job)
    assert _sample(reg, "pdmesh:prefill_queued_prompt_tokens") == {"prefill-g": 65}
    jobs[0].done_tokens = 32  # a chunk of the first is computed
    assert _sample(reg, "pdmesh:prefill_queued_prompt_tokens") == {"prefill-g": 33}
    jobs[1].lifecycle.finish(m.Outcome(code=m.Code.ABORTED))  # aborted: nothing to compute
    assert _sample(reg, "pdmesh:prefill_queued_prompt_tokens") == {"prefill-g": 8}
    await svc.transport.close()
