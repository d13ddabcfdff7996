"""Only admission can make a ticket that prefill and decode accept."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from pdmesh.services.prefill.service import PrefillService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import TicketError
from pdmesh.services.protocol.tickets import TicketVerifier, grant, sign, verify_grant
from pdmesh.services.runtime.config import DEV_MESH_SECRET, resolve

SECRET = "test-secret"


def ticket(**overrides: object) -> m.AdmittedTicket:
    args = {"request_id": "r1", "tenant": "alice", "cache_salt": "s", "prompt_len": 10,
            "max_tokens": 5, "prefill_worker": "p1", "decode_worker": "d1", "ttl_s": 30.0}
    args.update(overrides)
    return sign(SECRET, **args)  # type: ignore[arg-type]


def test_genuine_ticket_is_accepted_once() -> None:
    v = TicketVerifier(SECRET, "d1", m.Role.DECODE)
    t = ticket()
    v.verify(t)
    with pytest.raises(TicketError, match="replayed"):
        v.verify(t)


@pytest.mark.parametrize("field,value", [("prompt_len", 1), ("max_tokens", 99999),
                                         ("tenant", "mallory"), ("cache_salt", "other"),
                                         ("expires_at", 4e9)])
def test_any_changed_field_breaks_the_signature(field: str, value: object) -> None:
    forged = msgspec.structs.replace(ticket(), **{field: value})
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier(SECRET, "d1", m.Role.DECODE).verify(forged)


def test_wrong_secret_expired_and_wrong_worker_are_refused() -> None:
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier("other-secret", "d1", m.Role.DECODE).verify(ticket())
    with pytest.raises(TicketError, match="expired"):
        TicketVerifier(SECRET, "d1", m.Role.DECODE).verify(ticket(ttl_s=-1.0))
    with pytest.raises(TicketError, match="not this worker"):
        TicketVerifier(SECRET, "d2", m.Role.DECODE).verify(ticket())
    with pytest.raises(TicketError, match="not this worker"):
        TicketVerifier(SECRET, "d1", m.Role.PREFILL).verify(ticket())


def test_prompt_length_must_match_the_ticket() -> None:
    with pytest.raises(TicketError, match="ticket says 10"):
        TicketVerifier(SECRET, "p1", m.Role.PREFILL).verify(ticket(), prompt_len=11)


# -- the grant: after decode reserved, admission binds prompt and reservation --

def _reservation(**overrides: object) -> m.Reservation:
    fields = {"reservation_id": "7f0c6a2e-3d1b-4c8e-9a55-0b1d2e3f4a5b", "epoch": 3,
              "page_ids": [4, 5], "page_tokens": 16, "page_bytes": 64,
              "data_address": "tcp://10.0.0.2:7000", **overrides}
    return m.Reservation(**fields)  # type: ignore[arg-type]


def _granted(prompt: list[int] | None = None) -> m.PrefillDispatch:
    prompt = prompt if prompt is not None else list(range(20))
    t = ticket(prompt_len=len(prompt))
    r = _reservation()
    return m.PrefillDispatch(ticket=t, prompt_ids=prompt, sampling=m.Sampling(),
                             reservation=r, grant=grant(SECRET, t, prompt, r))


def test_a_granted_dispatch_verifies() -> None:
    verify_grant(SECRET, _granted())


@pytest.mark.parametrize("change", [
    {"data_address": "tcp://6.6.6.6:7000"}, {"epoch": 4},
    {"reservation_id": "00000000-0000-4000-8000-000000000000"}, {"page_ids": [5, 4]},
    {"page_bytes": 128}])
def test_a_swapped_reservation_field_breaks_the_grant(change: dict[str, object]) -> None:
    d = _granted()
    forged = msgspec.structs.replace(
        d, reservation=msgspec.structs.replace(d.reservation, **change))
    with pytest.raises(TicketError, match="grant"):
        verify_grant(SECRET, forged)


def test_a_swapped_prompt_missing_grant_or_other_secret_is_refused() -> None:
    d = _granted()
    swapped = list(d.prompt_ids)
    swapped[3] += 1
    for forged in (msgspec.structs.replace(d, prompt_ids=swapped),
                   msgspec.structs.replace(d, grant=""),
                   msgspec.structs.replace(d, ticket=ticket(prompt_len=20))):
        with pytest.raises(TicketError, match="grant"):
            verify_grant(SECRET, forged)
    with pytest.raises(TicketError, match="grant"):
        verify_grant("another-secret", d)


@pytest.mark.parametrize("swap", ["data_address", "epoch", "prompt"])
async def test_prefill_refuses_a_swapped_dispatch_before_computing(
        monkeypatch: pytest.MonkeyPatch, swap: str) -> None:
    """A real PrefillService: the dispatch is not queued; decode gets a Release and the
    client a StreamFailed (TICKET_INVALID), as for any refused ticket."""

    svc = PrefillService(resolve("prefill", {}, {"PDMESH_WORKER_ID": "prefill-g",
                                                 "PDMESH_KV_TOKENS": "1024"}))
    sent: list[tuple[str, object]] = []

    async def record(subject: str, msg: object, headers: object = None) -> None:
        sent.append((subject, msg))

    monkeypatch.setattr(svc.rt, "publish", record)
    prompt = [5, 6, 7, 8, 9]

    def make() -> m.PrefillDispatch:
        t = sign(DEV_MESH_SECRET, request_id=f"r-{uuid.uuid4().hex[:6]}", tenant="t",
                 cache_salt="s", prompt_len=len(prompt), max_tokens=4,
                 prefill_worker="prefill-g", decode_worker="decode-x", ttl_s=30)
        r = m.Reservation(reservation_id=str(uuid.uuid4()), epoch=3, page_ids=[0],
                          page_tokens=svc.pool.spec.page_tokens, page_bytes=64,
                          data_address="tcp://127.0.0.1:9")
        return m.PrefillDispatch(ticket=t, prompt_ids=prompt, sampling=m.Sampling(),
                                 reservation=r, grant=grant(DEV_MESH_SECRET, t, prompt, r))
    try:
        await svc.accept(make())  # the genuine one is queued: decode and client hear so
        assert len(svc.queue) == 1
        assert [type(msg) for _, msg in sent] == [m.PrefillProgress, m.PrefillProgress]
        sent.clear()
        d = make()
        if swap == "prompt":
            forged = msgspec.structs.replace(d, prompt_ids=[5, 6, 7, 8, 10])
        else:
            value = "tcp://6.6.6.6:9" if swap == "data_address" else 4
            forged = msgspec.structs.replace(d, reservation=msgspec.structs.replace(
                d.reservation, **{swap: value}))
        await svc.accept(forged)
        assert len(svc.queue) == 1  # not queued, nothing computed
        (release_subject, release), (_, failed) = sent
        assert release_subject == m.release_subject("decode-x")
        assert isinstance(release, m.Release)
        assert release.outcome.code is m.Code.TICKET_INVALID
        assert isinstance(failed, m.StreamFailed)
        assert failed.outcome.code is m.Code.TICKET_INVALID
    finally:
        await svc.transport.close()
