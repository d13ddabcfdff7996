"""KV data plane: the `KVTransport` Protocol, framing, TCP and UCX implementations.

    transport = make_transport("tcp")          # or "ucx"
    address = await transport.start()           # advertise this in heartbeats
"""

from __future__ import annotations

from .base import (
    POISON_BYTE, ExpectedTransfer, KVTransport, TransferAck, TransferPlan, TransferResult,
    TransportStats,
)
from .errors import FrameError, Reason, TransferError
from .faults import FaultPlan

KINDS = ("tcp", "ucx")


def make_transport(kind: str, host: str = "127.0.0.1", port: int = 0, **options) -> KVTransport:
    """Build a transport by kind (`tcp` or `ucx`). Options go to the constructor
    (progress_timeout_s, on_event, faults)."""
    if kind == "tcp":
        from .tcp import TcpTransport

        return TcpTransport(host, port, **options)
    if kind == "ucx":
        from .ucx import UcxTransport, ucx_import_error

        if ucx_import_error is not None:
            raise RuntimeError(
                "transport 'ucx' needs ucxx (pip install 'pdmesh[ucx]') or ucx-py; "
                f"import failed: {ucx_import_error}"
            )
        return UcxTransport(host, port, **options)
    raise ValueError(f"unknown transport kind {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = [
    "KINDS", "POISON_BYTE", "ExpectedTransfer", "FaultPlan", "FrameError", "KVTransport",
    "Reason", "TransferAck", "TransferError", "TransferPlan", "TransferResult",
    "TransportStats", "make_transport",
]
