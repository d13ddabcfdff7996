"""A reservation on an in-process DecodeService, as admission's signed ticket makes one, and
messages to it as its NATS subscription delivers them (with or without the request's MAC)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol import streamauth
from pdmesh.services.protocol.tickets import Signer
from pdmesh.services.runtime.config import DEV_SIGNING_KEY

STREAM_KEY = "5a" * streamauth.KEY_BYTES  # the request keys admission would make
DATA_KEY = "d4" * streamauth.KEY_BYTES
DEV_SIGNER = Signer(DEV_SIGNING_KEY)


def reserve(svc: DecodeService, rid: str, *, prompt_len: int = 20,
            prefill_worker: str = "p") -> str:
    """Reserve for request `rid` (4 output tokens); returns the reservation id."""
    ticket = DEV_SIGNER.sign(request_id=rid, tenant="t", cache_salt="s",
                             prompt_len=prompt_len, max_tokens=4,
                             prefill_worker=prefill_worker,
                             decode_worker=svc.cfg.worker_id, ttl_s=30)
    reply = svc.reserve(m.ReserveRequest(ticket=ticket, stream_key=STREAM_KEY,
                                         data_key=DATA_KEY))
    assert isinstance(reply, m.Reserved), reply
    return reply.reservation.reservation_id


@dataclass
class Delivered:
    """What a nats-py `Msg` gives a handler: subject, payload bytes, headers."""

    subject: str
    data: bytes
    headers: dict[str, str] | None


def to_decode(svc: DecodeService, msg: msgspec.Struct,
              key: str | None = STREAM_KEY) -> Delivered:
    """`msg` as it reaches decode on its release subject, MACed under `key` (None: no MAC,
    as another worker without the request's key would send it)."""
    subject = m.release_subject(svc.cfg.worker_id)
    data = m.encode(msg)
    headers = None if key is None else streamauth.sign(streamauth.parse_key(key), subject, data)
    return Delivered(subject, data, headers)
