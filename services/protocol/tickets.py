"""Admission tickets: only admission can sign one; prefill and decode verify before work.

A ticket is the type-level proof that a request was ADMITTED (architecture: "only admission
can construct the admitted ticket, and prefill/decode verify it"). Admission alone holds the
Ed25519 signing key (`Signer`, `--signing-key`); prefill, decode and colocated workers hold
its public key (`--verify-key`) and can check a signature but not make one, and the gateway
holds neither. The signature covers the canonical msgpack encoding of every other field, so
lengths, tenant, salt, chosen workers and expiry cannot be changed in transit.

The ticket is signed before decode reserves, so it cannot name the reservation. Once decode
reserved, admission signs a *grant* (`Signer.grant()`, sent as `PrefillDispatch.grant`): an
Ed25519 signature over ["pdmesh-grant", the ticket's signature, a SHA-256 digest of the
prompt's token ids, the reservation] (its id, epoch, page ids, page geometry and data
address). Prefill checks it (`verify_grant()`) before it computes anything: a dispatch whose
prompt, reservation or data address was swapped is refused like a bad ticket.

Keys travel as hex: a signing key is the 32-byte Ed25519 private seed
(`generate_signing_key()`), a verify key the raw 32-byte public key (`verify_key_of()`).
Each is parsed once, when the `Signer` or `TicketVerifier` is built (`verify_grant` keeps
the few keys it has seen parsed).
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import time

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.errors import TicketError

KEY_BYTES = 32  # an Ed25519 private seed and a raw public key alike
GRANT_LABEL = "pdmesh-grant"


def key_problem(value: str) -> str | None:
    """What is wrong with a hex key (signing seed, verify key, salt key), or None."""
    if len(value) != 2 * KEY_BYTES:
        return f"must be {2 * KEY_BYTES} hex characters ({KEY_BYTES} bytes), not {len(value)}"
    try:
        bytes.fromhex(value)
    except ValueError:
        return "must be hex (0-9, a-f)"
    return None


def _key_bytes(value: str, what: str) -> bytes:
    problem = key_problem(value)
    if problem:
        raise ValueError(f"{what} {problem}")
    return bytes.fromhex(value)


def _raw_public(key: Ed25519PublicKey) -> str:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def generate_signing_key() -> str:
    """A fresh signing key: the hex of a random 32-byte Ed25519 private seed."""
    return secrets.token_bytes(KEY_BYTES).hex()


def verify_key_of(signing_key: str) -> str:
    """The verify key (hex of the raw public key) of a signing key."""
    seed = _key_bytes(signing_key, "signing key")
    return _raw_public(Ed25519PrivateKey.from_private_bytes(seed).public_key())


@functools.lru_cache(maxsize=16)
def _public_key(verify_key: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_key_bytes(verify_key, "verify key"))


def _ticket_body(ticket: m.AdmittedTicket) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(ticket, signature=""))


def prompt_digest(prompt_ids: list[int]) -> str:
    """SHA-256 over the canonical msgpack encoding of the prompt's token ids (hex)."""
    return hashlib.sha256(msgspec.msgpack.encode(prompt_ids)).hexdigest()


def _grant_body(ticket: m.AdmittedTicket, prompt_ids: list[int],
                reservation: m.Reservation) -> bytes:
    return msgspec.msgpack.encode([GRANT_LABEL, ticket.signature, prompt_digest(prompt_ids),
                                   reservation])


def _signed_by(key: Ed25519PublicKey, signature_hex: str, body: bytes) -> bool:
    """Whether `signature_hex` is `key`'s Ed25519 signature over `body`."""
    try:
        key.verify(bytes.fromhex(signature_hex), body)
    except (InvalidSignature, ValueError):  # forged, or not even hex
        return False
    return True


class Signer:
    """Admission's signing key: issues tickets and grants. Nothing else holds one."""

    def __init__(self, signing_key: str) -> None:
        self._key = Ed25519PrivateKey.from_private_bytes(_key_bytes(signing_key, "signing key"))
        self.verify_key = _raw_public(self._key.public_key())

    def sign(self, *, request_id: str, tenant: str, cache_salt: str, prompt_len: int,
             max_tokens: int, prefill_worker: str, decode_worker: str,
             ttl_s: float) -> m.AdmittedTicket:
        """A signed ticket for a request admission accepted."""
        unsigned = m.AdmittedTicket(
            request_id=request_id, tenant=tenant, cache_salt=cache_salt,
            prompt_len=prompt_len, max_tokens=max_tokens, prefill_worker=prefill_worker,
            decode_worker=decode_worker, expires_at=time.time() + ttl_s,
            nonce=secrets.token_hex(8))
        return msgspec.structs.replace(unsigned,
                                       signature=self._key.sign(_ticket_body(unsigned)).hex())

    def grant(self, ticket: m.AdmittedTicket, prompt_ids: list[int],
              reservation: m.Reservation) -> str:
        """After decode reserved: binds the ticket to this prompt and this reservation (its
        id, epoch, pages and data address)."""
        return self._key.sign(_grant_body(ticket, prompt_ids, reservation)).hex()


def verify_grant(verify_key: str, dispatch: m.PrefillDispatch) -> None:
    """Raise TicketError unless the dispatch's grant covers its ticket, prompt and
    reservation exactly as admission signed them."""
    body = _grant_body(dispatch.ticket, dispatch.prompt_ids, dispatch.reservation)
    if not _signed_by(_public_key(verify_key), dispatch.grant, body):  # guard: dispatch-grant
        raise TicketError(dispatch.ticket.request_id,
                          "grant does not match the prompt or reservation admission signed")


class TicketVerifier:
    """Verifies tickets on one worker: signature, expiry, addressee, and no replay."""

    def __init__(self, verify_key: str, worker_id: str, role: m.Role) -> None:
        self._key = _public_key(verify_key)
        self._worker_id = worker_id
        self._role = role
        self._seen: dict[str, float] = {}  # nonce -> expiry; pruned as tickets expire

    def verify(self, ticket: m.AdmittedTicket, *, prompt_len: int | None = None) -> None:
        """Raise TicketError unless the ticket is genuine, live, ours and unused."""
        if not _signed_by(self._key, ticket.signature,  # guard: ticket-signature
                          _ticket_body(ticket)):
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
