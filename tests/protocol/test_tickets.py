"""Only admission can make a ticket that prefill and decode accept: it alone holds the
Ed25519 signing key; the workers hold the public key, which verifies and cannot sign."""

from __future__ import annotations

import uuid

import msgspec
import pytest

from pdmesh.services.prefill.service import PrefillService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import TicketError
from pdmesh.services.protocol.tickets import (
    Signer,
    TicketVerifier,
    generate_signing_key,
    verify_grant,
    verify_key_of,
)
from pdmesh.services.runtime.config import DEV_SIGNING_KEY, DEV_VERIFY_KEY, resolve
from tests.support.decode_reserve import DATA_KEY, STREAM_KEY

SIGNER_KEY = generate_signing_key()
SIGNER = Signer(SIGNER_KEY)  # admission's
VERIFY_KEY = SIGNER.verify_key  # what the workers hold
TICKET_ARGS = {"request_id": "r1", "tenant": "alice", "cache_salt": "s", "prompt_len": 10,
               "max_tokens": 5, "prefill_worker": "p1", "decode_worker": "d1", "ttl_s": 30.0}


def ticket(signer: Signer = SIGNER, **overrides: object) -> m.AdmittedTicket:
    return signer.sign(**{**TICKET_ARGS, **overrides})  # type: ignore[arg-type]


def test_genuine_ticket_is_accepted_once() -> None:
    v = TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE)
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
        TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE).verify(forged)


def test_wrong_key_expired_and_wrong_worker_are_refused() -> None:
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier(Signer(generate_signing_key()).verify_key, "d1",
                       m.Role.DECODE).verify(ticket())
    with pytest.raises(TicketError, match="expired"):
        TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE).verify(ticket(ttl_s=-1.0))
    with pytest.raises(TicketError, match="not this worker"):
        TicketVerifier(VERIFY_KEY, "d2", m.Role.DECODE).verify(ticket())
    with pytest.raises(TicketError, match="not this worker"):
        TicketVerifier(VERIFY_KEY, "d1", m.Role.PREFILL).verify(ticket())


def test_prompt_length_must_match_the_ticket() -> None:
    with pytest.raises(TicketError, match="ticket says 10"):
        TicketVerifier(VERIFY_KEY, "p1", m.Role.PREFILL).verify(ticket(), prompt_len=11)


# -- keys: only admission's signing key makes a ticket a worker accepts --

@pytest.mark.parametrize("role,worker", [(m.Role.DECODE, "d1"), (m.Role.PREFILL, "p1")])
def test_a_ticket_signed_by_any_other_key_is_refused(role: m.Role, worker: str) -> None:
    """Whoever holds some other signing key (a gateway, a worker, an outsider) mints
    tickets that no worker holding admission's verify key accepts."""
    verifier = TicketVerifier(VERIFY_KEY, worker, role)
    for other in (Signer(generate_signing_key()), Signer(DEV_SIGNING_KEY)):
        with pytest.raises(TicketError, match="bad signature"):
            verifier.verify(ticket(other))
    verifier.verify(ticket())  # the genuine one still passes


def test_the_verify_key_cannot_sign() -> None:
    """The public key is all a worker holds. Nothing in the API signs with it; used as a
    seed it is just another signing key, whose tickets and grants are refused."""
    impostor = Signer(VERIFY_KEY)
    assert impostor.verify_key != VERIFY_KEY
    forged = ticket(impostor)
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE).verify(forged)
    # Nor can it lend a genuine ticket a signature copied onto changed fields.
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE).verify(
            msgspec.structs.replace(forged, signature=ticket().signature))
    d = _granted()
    with pytest.raises(TicketError, match="grant"):
        verify_grant(VERIFY_KEY, msgspec.structs.replace(
            d, grant=impostor.grant(d.ticket, d.prompt_ids, d.reservation)))


def test_keys_are_hex_ed25519_and_the_dev_pair_matches() -> None:
    assert verify_key_of(SIGNER_KEY) == Signer(SIGNER_KEY).verify_key
    assert len(SIGNER.verify_key) == 64 and bytes.fromhex(SIGNER.verify_key)
    assert generate_signing_key() != generate_signing_key()
    assert verify_key_of(DEV_SIGNING_KEY) == DEV_VERIFY_KEY
    for bad in ("", "ab" * 31, "zz" * 32, "ab" * 33):
        with pytest.raises(ValueError, match="signing key"):
            Signer(bad)
        with pytest.raises(ValueError, match="verify key"):
            TicketVerifier(bad, "d1", m.Role.DECODE)


@pytest.mark.parametrize("signature", ["", "not hex", "00" * 64, "ab" * 63])
def test_a_malformed_signature_is_a_bad_signature(signature: str) -> None:
    with pytest.raises(TicketError, match="bad signature"):
        TicketVerifier(VERIFY_KEY, "d1", m.Role.DECODE).verify(
            msgspec.structs.replace(ticket(), signature=signature))


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
                             reservation=r, grant=SIGNER.grant(t, prompt, r))


def test_a_granted_dispatch_verifies() -> None:
    verify_grant(VERIFY_KEY, _granted())


@pytest.mark.parametrize("change", [
    {"data_address": "tcp://6.6.6.6:7000"}, {"epoch": 4},
    {"reservation_id": "00000000-0000-4000-8000-000000000000"}, {"page_ids": [5, 4]},
    {"page_bytes": 128}])
def test_a_swapped_reservation_field_breaks_the_grant(change: dict[str, object]) -> None:
    d = _granted()
    forged = msgspec.structs.replace(
        d, reservation=msgspec.structs.replace(d.reservation, **change))
    with pytest.raises(TicketError, match="grant"):
        verify_grant(VERIFY_KEY, forged)


def test_a_swapped_prompt_missing_grant_or_other_key_is_refused() -> None:
    d = _granted()
    swapped = list(d.prompt_ids)
    swapped[3] += 1
    for forged in (msgspec.structs.replace(d, prompt_ids=swapped),
                   msgspec.structs.replace(d, grant=""),
                   msgspec.structs.replace(d, ticket=ticket(prompt_len=20))):
        with pytest.raises(TicketError, match="grant"):
            verify_grant(VERIFY_KEY, forged)
    with pytest.raises(TicketError, match="grant"):
        verify_grant(Signer(generate_signing_key()).verify_key, d)
    other = Signer(generate_signing_key())  # a grant by any other key, over the same fields
    with pytest.raises(TicketError, match="grant"):
        verify_grant(VERIFY_KEY, msgspec.structs.replace(
            d, grant=other.grant(d.ticket, d.prompt_ids, d.reservation)))


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

    admission = Signer(DEV_SIGNING_KEY)  # the worker's config holds the dev verify key

    def make() -> m.PrefillDispatch:
        t = admission.sign(request_id=f"r-{uuid.uuid4().hex[:6]}", tenant="t",
                           cache_salt="s", prompt_len=len(prompt), max_tokens=4,
                           prefill_worker="prefill-g", decode_worker="decode-x", ttl_s=30)
        r = m.Reservation(reservation_id=str(uuid.uuid4()), epoch=3, page_ids=[0],
                          page_tokens=svc.pool.spec.page_tokens, page_bytes=64,
                          data_address="tcp://127.0.0.1:9")
        return m.PrefillDispatch(ticket=t, prompt_ids=prompt, sampling=m.Sampling(),
                                 reservation=r, grant=admission.grant(t, prompt, r),
                                 stream_key=STREAM_KEY, data_key=DATA_KEY)
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
