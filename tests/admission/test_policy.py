"""Admission, prefill and decode agree on what fits (property test over random meshes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh.services.admission.policy import Admitted, Rejected, WorkerView, decide
from pdmesh.services.protocol.capacity import audit_capacity, decode_refusal, prefill_refusal
from pdmesh.services.protocol.messages import Code

PAGE = st.sampled_from([1, 4, 16, 64])


def worker(name: str, configured: int, pool_tokens: int, page: int,
           free_frac: float) -> WorkerView:
    """A worker as its heartbeat describes it: capacity audited the way workers do it."""
    capacity = (pool_tokens // page) * page
    served, _ = audit_capacity(configured, capacity, "clamp", "test")
    return WorkerView(worker_id=name, capacity_tokens=capacity,
                      available_tokens=int(capacity * free_frac) // page * page, page_tokens=page,
                      served_context=served)


@settings(max_examples=3000, deadline=None)
@given(context=st.integers(1, 1 << 20), prefill_pool=st.integers(1, 1 << 20),
       decode_pool=st.integers(1, 1 << 20), page=PAGE, prompt=st.integers(0, 1 << 20),
       max_tokens=st.integers(0, 1 << 16), free=st.floats(0, 1))
def test_admission_prefill_and_decode_always_agree(context: int, prefill_pool: int,
                                                   decode_pool: int, page: int, prompt: int,
                                                   max_tokens: int, free: float) -> None:
    p = worker("p", context, max(prefill_pool, page), page, free)
    d = worker("d", context, max(decode_pool, page), page, free)
    decision = decide(prompt, max_tokens, [p], [d])
    p_refuses = prefill_refusal(prompt, p.capacity_tokens, page, p.served_context)
    d_refuses = decode_refusal(prompt, max_tokens, d.capacity_tokens, page, d.served_context)
    if isinstance(decision, Admitted):
        # Admitted work is never refused by either worker's own gate...
        assert not p_refuses and not d_refuses
        # ...and never exceeds the context that the pool can really hold (the incident).
        assert prompt + max_tokens <= d.capacity_tokens
        assert prompt <= p.capacity_tokens
    else:
        assert isinstance(decision, Rejected)
        if decision.reason is Code.SATURATED:
            assert not p_refuses and not d_refuses  # only the *current* load stopped it
        else:
            # A static rejection always has a worker that would refuse it too.
            assert p_refuses or d_refuses


def test_over_capacity_prompt_is_context_length_exceeded() -> None:
    p = worker("p", 16384, 4096, 16, 1.0)
    d = worker("d", 16384, 4096, 16, 1.0)
    got = decide(5000, 16, [p], [d])
    assert isinstance(got, Rejected)
    assert got.reason is Code.CONTEXT_LENGTH_EXCEEDED
    assert got.limit == 4096  # the live, clamped figure, not the configured 16384


def test_no_workers_and_saturated() -> None:
    p = worker("p", 4096, 4096, 16, 1.0)
    busy = worker("d", 4096, 4096, 16, 0.0)
    assert decide(10, 10, [], [busy]).reason is Code.NO_WORKERS  # type: ignore[union-attr]
    assert decide(10, 10, [p], [busy]).reason is Code.SATURATED  # type: ignore[union-attr]


def test_picks_the_decode_with_most_free_pages() -> None:
    p = worker("p", 4096, 4096, 16, 1.0)
    d1 = worker("d1", 4096, 4096, 16, 0.2)
    d2 = worker("d2", 4096, 4096, 16, 0.9)
    got = decide(100, 10, [p], [d1, d2])
    assert isinstance(got, Admitted) and got.decode.worker_id == "d2"


def test_equal_idle_workers_share_the_requests() -> None:
    # Regression (multi-host scenario 3): with the worker id as the tie-break, an idle mesh
    # sent every request to the same decode worker, so a worker that came back after a cut
    # was never routed to again. Equal workers now get a per-request share of the traffic.
    prefills = [worker(f"p{i}", 4096, 4096, 16, 1.0) for i in range(2)]
    decodes = [worker(f"d{i}", 4096, 4096, 16, 1.0) for i in range(3)]
    picked: dict[str, int] = {}
    for n in range(300):
        got = decide(100, 10, prefills, decodes, spread=f"req-{n}")
        assert isinstance(got, Admitted)
        picked[got.decode.worker_id] = picked.get(got.decode.worker_id, 0) + 1
        picked[got.prefill.worker_id] = picked.get(got.prefill.worker_id, 0) + 1
        # The same request is always routed the same way (a pure function).
        again = decide(100, 10, prefills, decodes, spread=f"req-{n}")
        assert isinstance(again, Admitted) and again.decode == got.decode
    assert all(60 <= picked[f"d{i}"] <= 140 for i in range(3)), picked
    assert all(100 <= picked[f"p{i}"] <= 200 for i in range(2)), picked
