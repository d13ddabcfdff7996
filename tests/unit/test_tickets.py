"""Only admission can make a ticket that prefill and decode accept."""

from __future__ import annotations

import msgspec
import pytest

from pdmesh.services import messages as m
from pdmesh.services.errors import TicketError
from pdmesh.services.tickets import TicketVerifier, sign

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
