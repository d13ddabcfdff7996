"""Admission tickets: only admission can sign one; prefill and decode verify before work.

A ticket is the type-level proof that a request was ADMITTED (architecture: "only admission
can construct the admitted ticket, and prefill/decode verify it"). The signature is
HMAC-SHA256 with the mesh secret over the canonical msgpack encoding of every other field,
so lengths, tenant, salt, chosen workers and expiry cannot be changed in transit.

The ticket is signed before decode reserves, so it cannot name the reservation. Once decode
reserved, admission signs a *grant* (`grant()`, sent as `PrefillDispatch.grant`): HMAC-SHA256
with the mesh secret over the ticket's signature, a SHA-256 digest of the prompt's token
ids and every field of the reservation (id, epoch, page ids, page geometry, data address).
Prefill checks it (`verify_grant()`) before it computes anything: a dispatch whose prompt,
reservation or data address was swapped is refused like a bad ticket.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import msgspec

from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import TicketError


def _mac(secret: str, ticket: m.AdmittedTicket) -> str:
    body = msgspec.msgpack.encode(msgspec.structs.replace(ticket, signature=""))
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def sign(secret: str, *, request_id: str, tenant: str, cache_salt: str, prompt_len: int,
         max_tokens: int, prefill_worker: str, decode_worker: str,
         ttl_s: float) -> m.AdmittedTicket:
    """Issue a signed ticket (admission only)."""
    unsigned = m.AdmittedTicket(
        request_id=request_id, tenant=tenant, cache_salt=cache_salt, prompt_len=prompt_len,
        max_tokens=max_tokens, prefill_worker=prefill_worker, decode_worker=decode_worker,
        expires_at=time.time() + ttl_s, nonce=secrets.token_hex(8))
    return msgspec.structs.replace(unsigned, signature=_mac(secret, unsigned))


def prompt_digest(prompt_ids: list[int]) -> str:
    """SHA-256 over the canonical msgpack encoding of the prompt's token ids (hex)."""
    return hashlib.sha256(msgspec.msgpack.encode(prompt_ids)).hexdigest()


def _grant_mac(secret: str, ticket: m.AdmittedTicket, prompt_ids: list[int],
               reservation: m.Reservation) -> str:
    body = msgspec.msgpack.encode(["pdmesh-grant", ticket.signature, prompt_digest(prompt_ids),
                                   reservation])
    return hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def grant(secret: str, ticket: m.AdmittedTicket, prompt_ids: list[int],
          reservation: m.Reservation) -> str:
    """Admission only, after decode reserved: binds the ticket to this prompt and this
    reservation (its id, epoch, pages and data address)."""
    return _grant_mac(secret, ticket, prompt_ids, reservation)


def verify_grant(secret: str, dispatch: m.PrefillDispatch) -> None:
    """Raise TicketError unless the dispatch's grant covers its ticket, prompt and
    reservation exactly as admission signed them."""
    expected = _grant_mac(secret, dispatch.ticket, dispatch.prompt_ids, dispatch.reservation)
    if not hmac.compare_digest(expected, dispatch.grant):  # guard: dispatch-grant
        raise TicketError(dispatch.ticket.request_id,
                          "grant does not match the prompt or reservation admission signed")


class TicketVerifier:
    """Verifies tickets on one worker: signature, expiry, addressee, and no replay."""

    def __init__(self, secret: str, worker_id: str, role: m.Role) -> None:
        self._secret = secret
        self._worker_id = worker_id
        self._role = role
        self._seen: dict[str, float] = {}  # nonce -> expiry; pruned as tickets expire

    def verify(self, ticket: m.AdmittedTicket, *, prompt_len: int | None = None) -> None:
        """Raise TicketError unless the ticket is genuine, live, ours and unused."""
        expected = _mac(self._secret, ticket)
        if not hmac.compare_digest(expected, ticket.signature):  # guard: ticket-signature
            raise TicketError(ticket.request_id, "bad signature")
        now = time.time()
        if ticket.expires_at < now:
            raise TicketError(ticket.request_id, "expired")
        addressee = (ticket.decode_worker if self._role is m.Role.DECODE
                     else ticket.prefill_worker)
        if addressee != self._worker_id:
            raise TicketError(ticket.request_id, f"issued for {addressee}, not this worker")
        if prompt_len is not None and prompt_len != ticket.prompt_len:
            raise TicketError(ticket.request_id,
                              f"prompt has {prompt_len} tokens, ticket says {ticket.prompt_len}")
        self._prune(now)
        if ticket.nonce in self._seen:
            raise TicketError(ticket.request_id, "replayed")
        self._seen[ticket.nonce] = ticket.expires_at

    def _prune(self, now: float) -> None:
        if len(self._seen) > 1024:
            self._seen = {n: exp for n, exp in self._seen.items() if exp >= now}
