"""Admission tickets: only admission can sign one; prefill and decode verify before work.

A ticket is the type-level proof that a request was ADMITTED (architecture: "only admission
can construct the admitted ticket, and prefill/decode verify it"). The signature is
HMAC-SHA256 with the mesh secret over the canonical msgpack encoding of every other field,
so lengths, tenant, salt, chosen workers and expiry cannot be changed in transit.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import msgspec

from pdmesh.services import messages as m
from pdmesh.services.errors import TicketError


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
        if not hmac.compare_digest(expected, ticket.signature):
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
