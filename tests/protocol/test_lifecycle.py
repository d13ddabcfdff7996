"""The one request lifecycle: every legal and illegal path, CPU only, no NATS.

Each test that holds pages ends with the pool's integrity check and nothing leased.
"""

from __future__ import annotations

import itertools

import pytest

from pdmesh.kvstore import KVPool, PoolSpec, ScrubPolicy
from pdmesh.services.decode.service import DecodeRequest, peer_ending
from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.lifecycle import (
    TERMINAL,
    IllegalTransition,
    Lifecycle,
    RequestState,
    terminal_state,
)

S = RequestState
LIVE_PATH = [S.RECEIVED, S.ADMITTED, S.RESERVED, S.PREFILLING, S.TRANSFERRED, S.DECODING]


def outcome(code: m.Code) -> m.Outcome:
    return m.Outcome(code=code, detail=f"test {code.label}")


def test_every_code_belongs_to_exactly_one_terminal_state() -> None:
    seen = {terminal_state(c) for c in m.Code}
    assert seen == set(TERMINAL)
    assert terminal_state(m.Code.STOP) is S.FINISHED
    assert terminal_state(m.Code.SATURATED) is S.REJECTED
    assert terminal_state(m.Code.ABORTED) is S.ABORTED
    assert terminal_state(m.Code.TRANSFER_FAILED) is S.FAILED
    # Labels are the one vocabulary of metrics, release causes and error codes.
    assert m.Code.CONTEXT_LENGTH_EXCEEDED.label == "context_length_exceeded"
    assert len({c.label for c in m.Code}) == len(m.Code)


def test_the_happy_path_walks_every_live_state_then_finishes() -> None:
    life = Lifecycle("r1")
    for state in LIVE_PATH[1:]:
        life.advance(state)
        assert life.state is state and not life.is_terminal
    assert life.finish(m.FINISHED_LENGTH)
    assert life.state is S.FINISHED and life.outcome == m.FINISHED_LENGTH


@pytest.mark.parametrize("code", [m.Code.ABORTED, m.Code.PEER_RELEASED, m.Code.INTERNAL,
                                  m.Code.TRANSFER_FAILED, m.Code.DEADLINE])
@pytest.mark.parametrize("at", LIVE_PATH[1:])
def test_abort_or_failure_ends_any_admitted_state(code: m.Code, at: RequestState) -> None:
    life = Lifecycle("r", at)
    assert life.finish(outcome(code))
    assert life.state is terminal_state(code)
    assert life.outcome is not None and life.outcome.code is code


def test_rejection_is_only_possible_before_admission() -> None:
    life = Lifecycle("r")
    assert life.finish(outcome(m.Code.CONTEXT_LENGTH_EXCEEDED))
    assert life.state is S.REJECTED
    for at in LIVE_PATH[1:]:
        with pytest.raises(IllegalTransition):
            Lifecycle("r", at).finish(outcome(m.Code.SATURATED))


@pytest.mark.parametrize("at", [S.RECEIVED, S.ADMITTED, S.RESERVED, S.PREFILLING])
def test_nothing_finishes_before_its_kv_was_transferred(at: RequestState) -> None:
    with pytest.raises(IllegalTransition):
        Lifecycle("r", at).finish(m.FINISHED_STOP)


def test_only_the_first_outcome_stands() -> None:
    life = Lifecycle("r", S.DECODING)
    assert life.finish(outcome(m.Code.ABORTED))
    assert not life.finish(outcome(m.Code.INTERNAL))
    assert not life.finish(m.FINISHED_STOP)
    assert life.state is S.ABORTED and life.outcome.code is m.Code.ABORTED


def test_illegal_live_moves_are_refused() -> None:
    legal = {(a, b) for a, b in itertools.pairwise(LIVE_PATH)} | {
        (S.ADMITTED, S.PREFILLING), (S.RESERVED, S.TRANSFERRED)}
    for a, b in itertools.product(LIVE_PATH, LIVE_PATH):
        life = Lifecycle("r", a)
        if (a, b) in legal:
            life.advance(b)
            assert life.state is b
        else:
            with pytest.raises(IllegalTransition):
                life.advance(b)
            assert life.state is a
    for terminal in TERMINAL:  # terminal states are reached through finish() only
        with pytest.raises(IllegalTransition):
            Lifecycle("r", S.DECODING).advance(terminal)
    for terminal, b in itertools.product(TERMINAL, LIVE_PATH):
        with pytest.raises(IllegalTransition):
            Lifecycle("r", terminal).advance(b)


def test_a_peer_cannot_end_a_request_as_finished_or_rejected() -> None:
    assert peer_ending(m.FINISHED_STOP, "").code is m.Code.PEER_RELEASED
    assert peer_ending(outcome(m.Code.SATURATED), "").code is m.Code.PEER_RELEASED
    got = peer_ending(outcome(m.Code.PREFILL_REJECTED), "released by peer: ")
    assert got.code is m.Code.PREFILL_REJECTED and got.detail.startswith("released by peer")


# -- decode records: finish() says what to release ------------------------------------------
@pytest.fixture
def pool() -> KVPool:
    spec = PoolSpec(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=4, num_pages=8)
    return KVPool(spec, scrub=ScrubPolicy.NONE)


def record(pool: KVPool, rid: str = "r1", prompt_len: int = 6) -> DecodeRequest:
    ticket = m.AdmittedTicket(request_id=rid, tenant="t", cache_salt="s",
                              prompt_len=prompt_len, max_tokens=4, prefill_worker="p",
                              decode_worker="d", expires_at=0.0, nonce="n")
    lease = pool.allocate(rid, prompt_len + 4)
    return DecodeRequest(ticket=ticket, lease=lease, reservation_id=lease.lease_id,
                         sampler=Sampler(SamplingParams(max_tokens=4)))


def assert_clean(pool: KVPool) -> None:
    pool.check_integrity()
    assert pool.live_leases() == [] and pool.num_free_pages == pool.num_pages


def test_record_returns_its_lease_exactly_once(pool: KVPool) -> None:
    dreq = record(pool)
    assert dreq.state is S.RESERVED and dreq.prompt_page_ids == dreq.lease.page_ids[:2]
    lease = dreq.finish(outcome(m.Code.ABORTED))
    assert lease is dreq.lease
    assert dreq.finish(outcome(m.Code.INTERNAL)) is None  # already ended: nothing to free
    pool.release(lease, dreq.lifecycle.outcome.label)
    assert lease.release_cause == "aborted"
    assert_clean(pool)


def test_a_pinned_record_is_released_after_the_engine_step(pool: KVPool) -> None:
    dreq = record(pool)
    dreq.lifecycle.advance(S.TRANSFERRED)
    dreq.lifecycle.advance(S.DECODING)
    dreq.pinned = True
    assert dreq.finish(outcome(m.Code.ABORTED)) is None  # the engine still reads the lease
    assert dreq.lifecycle.is_terminal and dreq.lease.is_live
    lease = dreq.unpin()
    assert lease is dreq.lease
    pool.release(lease, dreq.lifecycle.outcome.label)
    assert_clean(pool)


def test_an_unpinned_live_record_keeps_its_lease(pool: KVPool) -> None:
    dreq = record(pool)
    dreq.pinned = True
    assert dreq.unpin() is None  # still live: nothing to free
    lease = dreq.finish(outcome(m.Code.DEADLINE))
    assert lease is not None
    pool.release(lease, dreq.lifecycle.outcome.label)
    assert_clean(pool)


def test_finishing_a_generation_frees_the_lease(pool: KVPool) -> None:
    dreq = record(pool)
    dreq.lifecycle.advance(S.TRANSFERRED)
    lease = dreq.finish(m.FINISHED_STOP)  # max_tokens=1 ends right after the transfer
    assert lease is not None and dreq.state is S.FINISHED
    pool.release(lease, dreq.lifecycle.outcome.label)
    assert lease.release_cause == "stop"
    assert_clean(pool)
