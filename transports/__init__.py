"""KV data plane: the `KVTransport` Protocol, framing, TCP, UCX and NIXL implementations.

    transport = make_transport("tcp")          # or "ucx", "nixl"
    address = await transport.start()           # advertise this in heartbeats

Tests and test meshes that inject data-plane faults build the transport with
`make_transport(kind, faults=True)`: a `FaultInjectingTransport` (faults.py) around it,
with `arm(reservation_id, FaultPlan(...))` for the next send of that reservation.
"""

from __future__ import annotations

import os
import sys

from .base import (
    POISON_BYTE,
    ExpectedTransfer,
    KVTransport,
    PagesReady,
    TransferAck,
    TransferPlan,
    TransferResult,
    TransportStats,
)
from .errors import FrameError, Reason, TransferError
from .faults import FaultInjectingTransport, FaultPlan
from .tcp import TcpTransport

KINDS = ("tcp", "ucx", "nixl")


def make_transport(kind: str, host: str = "127.0.0.1", port: int = 0, *,
                   faults: bool = False, **options) -> KVTransport:
    """Build a transport by kind (`tcp`, `ucx` or `nixl`). Options go to the constructor
    (progress_timeout_s, on_event). With `faults=True` (tests and test meshes only) the
    transport comes wrapped in a `FaultInjectingTransport`."""
    if faults:
        return FaultInjectingTransport(
            lambda frame_filter: make_transport(kind, host, port, frame_filter=frame_filter,
                                                **options))
    if kind == "tcp":
        return TcpTransport(host, port, **options)
    if kind == "ucx":
        # Lazy: ucxx (and its CUDA-stack libraries) loads only where a UCX transport is used.
        from .ucx import UcxTransport, ucx_import_error

        if ucx_import_error is not None:
            raise RuntimeError(
                "transport 'ucx' needs ucxx (pip install 'pdmesh[ucx]') or ucx-py; "
                f"import failed: {ucx_import_error}"
            )
        return UcxTransport(host, port, **options)
    if kind == "nixl":
        # Lazy too: NIXL (and its bundled UCX) loads only where a NIXL transport is used.
        from ._nixl_build import INSTALL_HINT
        from .nixl import NixlTransport, nixl_import_error

        if nixl_import_error is not None:
            raise RuntimeError(
                f"transport 'nixl' needs NIXL ({INSTALL_HINT}); "
                f"import failed: {nixl_import_error}"
            )
        return NixlTransport(host, port, **options)
    raise ValueError(f"unknown transport kind {kind!r}; expected one of {', '.join(KINDS)}")


def make_service_transport(kind: str, host: str, port: int, *, progress_timeout_s: float,
                           faults: bool = False, ucx_error_mode: str = "auto") -> KVTransport:
    """The transport of a service process (one event loop for the life of the process). For
    ucx that means ucxx's Python futures (`UCXPY_ENABLE_PYTHON_FUTURE=1` unless the
    environment says otherwise): without them every outstanding UCX request is polled by
    the event loop (`wait_yield`, an `asyncio.sleep(0)` loop), and a decode worker's idle
    pooled link, whose header receive stays posted, kept a core busy for as long as the
    worker ran (measured: 1.0 CPU-s per second, idle, after three requests; 0.03 with
    futures). Pair with `stop_ucx_notifier()` when the process's transports have closed.
    `ucx_error_mode`: `--ucx-error-mode` (ucx only; transports/ucx.py `data_error_mode`)."""
    options: dict = {}
    if kind == "ucx":
        os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")  # guard: ucx-service-futures
        options["error_mode"] = ucx_error_mode
    return make_transport(kind, host, port, faults=faults, progress_timeout_s=progress_timeout_s,
                          **options)


def stop_ucx_notifier() -> None:
    """Stop ucxx's notifier thread if the ucx transport was loaded in this process (it
    keeps a process from exiting otherwise); a no-op elsewhere."""
    module = sys.modules.get(f"{__name__}.ucx")
    if module is not None:
        module.stop_notifier()


__all__ = [
    "KINDS", "POISON_BYTE", "ExpectedTransfer", "FaultInjectingTransport", "FaultPlan",
    "FrameError", "KVTransport", "PagesReady", "Reason", "TransferAck", "TransferError",
    "TransferPlan", "TransferResult", "TransportStats", "make_transport",
]
