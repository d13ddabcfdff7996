"""A reservation on an in-process DecodeService, as admission's signed ticket makes one."""

from __future__ import annotations

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.protocol import messages as m
from pdmesh.services.protocol.tickets import sign
from pdmesh.services.runtime.config import DEV_MESH_SECRET


def reserve(svc: DecodeService, rid: str, *, prompt_len: int = 20,
            prefill_worker: str = "p") -> str:
    """Reserve for request `rid` (4 output tokens); returns the reservation id."""
    ticket = sign(DEV_MESH_SECRET, request_id=rid, tenant="t", cache_salt="s",
                  prompt_len=prompt_len, max_tokens=4, prefill_worker=prefill_worker,
                  decode_worker=svc.cfg.worker_id, ttl_s=30)
    reply = svc.reserve(m.ReserveRequest(ticket=ticket))
    assert isinstance(reply, m.Reserved), reply
    return reply.reservation.reservation_id
