"""Admission and handoff guards on the running mesh (I1, I5, I6, ticket checks)."""

from __future__ import annotations

import time

import pytest

from pdmesh.services.protocol import messages as m
from tests.support import meshstats
from tests.support.meshproc import Mesh
from tests.support.meshstats import counter, heartbeats, worker_stats
from tests.support.oracle import expected_text

pytestmark = [pytest.mark.mesh, pytest.mark.slow]

WORK_COUNTERS = [(m.Role.DECODE, "reservations"), (m.Role.DECODE, "transfers"),
                 (m.Role.PREFILL, "dispatches"), (m.Role.PREFILL, "bootstraps"),
                 (m.Role.PREFILL, "transfers")]


def _work(mesh: Mesh) -> dict[tuple[m.Role, str], float]:
    stats = worker_stats(mesh.nats_url)
    return {(role, name): counter(stats, role, name) for role, name in WORK_COUNTERS}


def test_over_capacity_prompt_is_rejected_before_any_worker_hears_of_it(mesh: Mesh) -> None:
    """I1: 400 context_length_exceeded, and zero reservations, bootstraps and transfers."""
    before = _work(mesh)
    prompt = "x" * (mesh.max_context + 10)  # the live (clamped) context, not the configured
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 4})
    assert status == 400, body
    assert body["error"]["code"] == "context_length_exceeded"
    # Prompt fits, prompt + max_tokens does not: still rejected up front.
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "y" * (mesh.max_context - 20), "max_tokens": 64})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert _work(mesh) == before, "a rejected request reached a worker"


def test_capacity_audit_clamps_to_the_real_pool(mesh: Mesh) -> None:
    """I5: tiny is configured for 65536 tokens but the pools hold 4096: served is clamped."""
    assert mesh.max_context == 4096
    workers = heartbeats(mesh.nats_url)
    assert workers
    for b in workers.values():
        assert b.configured_context == 65536
        assert b.pool_capacity_tokens == 4096
        assert b.served_context == 4096 and b.capacity_mismatch


def test_asymmetric_prefill_rejection_frees_decode_within_a_second(mesh: Mesh) -> None:
    """I6: prefill refuses what admission admitted; decode lets go at once (no timeout)."""
    t0 = time.monotonic()
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "asymmetric " * 40, "max_tokens": 8},
        headers={"X-Pdmesh-Fault": "prefill_reject"})
    elapsed = time.monotonic() - t0
    assert status == 502, body
    assert "prefill_rejected" in body["error"]["code"]
    # The stall limit of this mesh is 5 s: answering in < 1 s proves that decode
    # was told, not timed out.
    assert elapsed < 1.0, elapsed
    stats = worker_stats(mesh.nats_url, listen_s=0.6)
    assert all(s.live_leases == 0 for s in stats.values()), stats


def test_silent_prefill_failure_is_bounded_by_progress(mesh: Mesh) -> None:
    """Backstop: even a prefill that never tells decode cannot pin decode's pages forever:
    no progress for the request within prefill_stall_s (5 s on this mesh) ends it."""
    t0 = time.monotonic()
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "silent " * 20, "max_tokens": 8},
        headers={"X-Pdmesh-Fault": "silent_prefill"})
    elapsed = time.monotonic() - t0
    # Decode and the gateway both go by progress (either may be first): 504 `deadline`.
    assert status == 504 and body["error"]["code"] == "deadline", body
    assert 4.0 < elapsed < 9.0, elapsed  # the 5 s stall limit, not a hang
    stats = worker_stats(mesh.nats_url, listen_s=0.6)
    assert all(s.live_leases == 0 for s in stats.values()), stats


def test_forged_ticket_is_refused_by_decode(mesh: Mesh) -> None:
    """Only admission can sign a ticket: a reserve with a forged one gets no pages."""
    import asyncio
    import secrets

    import msgspec

    from pdmesh.services.protocol.tickets import Signer, generate_signing_key
    from pdmesh.services.runtime.config import DEV_SIGNING_KEY

    decode = next(s for s in worker_stats(mesh.nats_url).values() if s.role is m.Role.DECODE)

    async def reserve(ticket: m.AdmittedTicket) -> m.ReserveReply:
        # An insider with admission's NATS identity (the only one allowed to reserve) but
        # without admission's signing key.
        nc = await meshstats.connect(mesh.nats_url_for("admission"))
        try:
            request = m.ReserveRequest(ticket=ticket, stream_key=secrets.token_hex(32),
                                       data_key=secrets.token_hex(32))
            reply = await nc.request(m.reserve_subject(decode.worker_id), m.encode(request),
                                     timeout=3)
            return m.Decoder(m.ReserveReply).decode("reserve", reply.data)
        finally:
            await nc.close()

    args = {"request_id": "forged-1", "tenant": "mallory", "cache_salt": "x", "prompt_len": 8,
            "max_tokens": 4, "prefill_worker": "p", "decode_worker": decode.worker_id,
            "ttl_s": 30.0}
    # Any key but this mesh's signing key (the built-in dev one included) is refused.
    for other in (generate_signing_key(), DEV_SIGNING_KEY):
        got = asyncio.run(reserve(Signer(other).sign(**args)))  # type: ignore[arg-type]
        assert isinstance(got, m.ReserveRefused) and "bad signature" in got.outcome.detail
        assert got.outcome.code is m.Code.TICKET_INVALID
    tampered = msgspec.structs.replace(Signer(mesh.signing_key).sign(**args),  # type: ignore[arg-type]
                                       prompt_len=1)
    got = asyncio.run(reserve(tampered))
    assert isinstance(got, m.ReserveRefused) and "bad signature" in got.outcome.detail
    after = worker_stats(mesh.nats_url)[decode.worker_id]
    assert after.counters["tickets_refused"] >= 3
    assert after.live_leases == 0


def test_mesh_still_serves_the_oracle_after_the_faults(mesh: Mesh) -> None:
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "still correct", "max_tokens": 10, "temperature": 0})
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text("still correct", 10)


def test_admission_bypassed_the_workers_still_refuse(mesh: Mesh) -> None:
    """Defence in depth: with admission's checks switched off (test fault), an over-capacity
    request is still refused by decode's own gate: no lease, no prefill, no 200."""
    before = _work(mesh)
    status, body = mesh.http("POST", "/v1/completions", {
        "model": "tiny", "prompt": "w" * (mesh.max_context - 8), "max_tokens": 64},
        headers={"X-Pdmesh-Fault": "bypass_admission"})
    assert status == 400, body  # refused by decode's own gate, never served
    assert body["error"]["code"] == "context_length_exceeded", body
    assert "decode worker" in body["error"]["message"] and "exceed" in body["error"]["message"]
    after = _work(mesh)
    assert after[(m.Role.PREFILL, "bootstraps")] == before[(m.Role.PREFILL, "bootstraps")]
    assert after[(m.Role.DECODE, "transfers")] == before[(m.Role.DECODE, "transfers")]
