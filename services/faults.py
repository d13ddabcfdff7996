"""Test-only fault injection for a running mesh, wired in from outside the service code.

Off unless explicitly allowed: a service builds these pieces only when started with
`PDMESH_FAULTS` containing `request_faults`, which the config accepts only with
`PDMESH_ALLOW_FAULTS=1`. Nothing here is on a production code path: the services take an
admission policy, a dispatch intake and a transport at construction, and `serve()` passes
the fault-injecting ones below only for such a test mesh.

The fault name travels as a NATS message header (`Pdmesh-Fault`), never as a field of a
wire message: the gateway copies the `X-Pdmesh-Fault` HTTP header onto its submit,
admission's fault policy copies it onto the dispatch, and prefill's fault intake reads it.
Production services never read or forward it.

Faults (name: what happens):
- `bypass_admission`: admission skips its length checks (the workers' own gates must hold).
- `stub_transfer`: prefill sends a 1-token stub for the whole prompt (the 2026 incident).
- `stale_epoch`, `foreign_reservation`: prefill's frames name another epoch / reservation.
- `first_token_out_of_range`, `first_token_negative`: the commit carries a first token id
  outside the vocabulary (decode must fail only this request, not its whole batch).
- `first_token_off_grammar`: the commit carries token 0 as the first token, in the
  vocabulary but outside any structured output the tests ask for.
- `corrupt_payload`, `corrupt_header`, `drop_frame`, `duplicate_frame`, `reorder_frames`,
  `commit_first` (the "done" arrives before the data), `truncate`, `reset`: data-plane
  faults on this request's KV frames.
- `stall`: prefill pauses 0.5 s before its second frame (time to kill it mid-transfer).
- `silent_prefill`: prefill never hears of the request and tells nobody (decode's deadline
  is the backstop).
- `prefill_reject`: prefill's own gate refuses a request admission admitted (asymmetric
  rejection: decode must free its lease at once, not after a transfer timeout). Done by
  handing prefill a dispatch whose reservation does not match the prompt's pages.
- `slow_reserve`: the first decode worker admission asks reserves, but replies only after
  admission's reserve timeout (admission must free that reservation and place the request
  elsewhere, without the late worker ending it).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from pdmesh.services.admission.policy import Admitted, LivePolicy, Rejected, WorkerView
from pdmesh.services.protocol import messages as m
from pdmesh.services.runtime.config import DecodeConfig, PrefillConfig, ServiceConfig
from pdmesh.transports import (
    FaultInjectingTransport,
    FaultPlan,
    KVTransport,
    PagesReady,
    TransferAck,
    TransferPlan,
    make_service_transport,
)

FAULT_HEADER = "X-Pdmesh-Fault"  # HTTP header the gateway reads on a test mesh
NATS_FAULT_HEADER = "Pdmesh-Fault"  # the same name carried on NATS messages
REQUEST_FAULTS = "request_faults"

DATA_PLANE = ("corrupt_payload", "corrupt_header", "drop_frame", "duplicate_frame",
              "reorder_frames", "commit_first", "truncate", "reset", "stall", "stale_epoch",
              "foreign_reservation", "first_token_out_of_range", "first_token_negative",
              "first_token_off_grammar")
CONTROL = ("bypass_admission", "stub_transfer", "silent_prefill", "prefill_reject",
           "slow_reserve")
ALL = DATA_PLANE + CONTROL


def enabled(cfg: ServiceConfig) -> bool:
    return REQUEST_FAULTS in cfg.fault_set


def fault_of(headers: Mapping[str, str] | None) -> str:
    return (headers or {}).get(NATS_FAULT_HEADER, "")


def data_plane_plan(fault: str, num_pages: int, page_bytes: int) -> FaultPlan | None:
    """The sender-side FaultPlan for a data-plane fault on a transfer of `num_pages` pages
    (frames 0..num_pages-1 carry pages, frame num_pages is the commit)."""
    last = num_pages  # index of the commit frame
    plans = {
        "corrupt_payload": FaultPlan(corrupt={0: 10}),
        "corrupt_header": FaultPlan(corrupt_header={0}),
        "drop_frame": FaultPlan(drop={0}),
        "duplicate_frame": FaultPlan(duplicate={0}),
        "reorder_frames": FaultPlan(reorder=((0, 1),)) if num_pages > 1 else None,
        "commit_first": FaultPlan(reorder=((0, last),)),
        "truncate": FaultPlan(truncate_after=page_bytes // 2),
        "reset": FaultPlan(reset_after=page_bytes // 2),
        "stall": FaultPlan(delay={1: 0.5}),
    }
    return plans.get(fault)


# -- gateway --------------------------------------------------------------------------------
def gateway_headers(cfg: ServiceConfig) -> Any:
    """The gateway's submit-header function: on a test mesh it copies the HTTP fault header
    onto the NATS submit; in production (`None`) it adds nothing."""
    if not enabled(cfg):
        return None

    def headers(http_headers: Mapping[str, str]) -> dict[str, str] | None:
        fault = http_headers.get(FAULT_HEADER, "")
        return {NATS_FAULT_HEADER: fault} if fault else None

    return headers


def gateway_bypass(cfg: ServiceConfig) -> Any:
    """Whether the gateway skips its own context check for a request: on a test mesh, for
    `bypass_admission` (so that the workers' gates are what is tested); never in
    production."""
    if not enabled(cfg):
        return lambda _http_headers: False
    return lambda http_headers: http_headers.get(FAULT_HEADER, "") == "bypass_admission"


# -- admission ------------------------------------------------------------------------------
class FaultPolicy(LivePolicy):
    """Admission on a test mesh: `bypass_admission` admits to the first live pair without
    any check, and the fault header is forwarded to prefill on the dispatch."""

    def decide(self, req: m.SubmitRequest, prefills: list[WorkerView],
               decodes: list[WorkerView], headers: Mapping[str, str]) -> Admitted | Rejected:
        if fault_of(headers) == "bypass_admission" and prefills and decodes:
            return Admitted(prefill=prefills[0], decode=decodes[0])
        return super().decide(req, prefills, decodes, headers)

    def dispatch_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        fault = fault_of(headers)
        return {NATS_FAULT_HEADER: fault} if fault else None

    def reserve_headers(self, request_id: str, headers: Mapping[str, str],
                        attempt: int) -> dict[str, str] | None:
        """`slow_reserve` goes on the first reserve request of a request only."""
        if fault_of(headers) == "slow_reserve" and attempt == 0:
            return {NATS_FAULT_HEADER: "slow_reserve"}
        return None


def admission_policy(cfg: ServiceConfig) -> LivePolicy | None:
    return FaultPolicy() if enabled(cfg) else None


# -- decode ---------------------------------------------------------------------------------
def reserve_reply_delay(cfg: DecodeConfig) -> Any:
    """Decode's delay before it answers a reserve request (production: None): on a test
    mesh, `slow_reserve` answers after admission's reserve timeout."""
    if not enabled(cfg):
        return None
    late = cfg.reserve_timeout_s + 0.5
    return lambda headers: late if fault_of(headers) == "slow_reserve" else 0.0


# -- prefill --------------------------------------------------------------------------------
class FaultySender:
    """A prefill transport on a test mesh: rewrites the plan of a transfer whose request
    asked for a control fault (stub, stale epoch, foreign reservation) and arms the
    frame-level FaultPlan of data-plane faults on the fault-injecting transport below it.
    Everything else is the wrapped transport's."""

    def __init__(self, inner: FaultInjectingTransport) -> None:
        self.inner = inner
        self.armed: dict[str, str] = {}  # reservation id -> fault name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def send(self, address: str, plan: TransferPlan, page_buffers: Sequence[memoryview],
                   ready: PagesReady | None = None) -> TransferAck:
        fault = self.armed.pop(plan.reservation_id, "")
        buffers = list(page_buffers)
        if fault and ready is not None:
            # A faulted transfer is not streamed: every page (and the first token) first.
            await ready.wait(ready.total)
            if ready.first_token is not None:
                plan = dataclasses.replace(plan, first_token=ready.first_token)
            ready = None
        if fault == "stub_transfer":
            # The incident: a "rejected" prompt replaced by a 1-token stub, handed off anyway.
            plan = dataclasses.replace(plan, num_tokens=1, dest_page_ids=plan.dest_page_ids[:1])
            buffers = buffers[:1]
        elif fault == "stale_epoch":
            plan = dataclasses.replace(plan, epoch=plan.epoch + 1)
        elif fault == "foreign_reservation":
            plan = dataclasses.replace(plan, reservation_id=str(uuid.uuid4()))
        elif fault == "first_token_out_of_range":
            plan = dataclasses.replace(plan, first_token=1 << 40)
        elif fault == "first_token_negative":
            plan = dataclasses.replace(plan, first_token=-1)
        elif fault == "first_token_off_grammar":
            plan = dataclasses.replace(plan, first_token=0)
        frame_faults = data_plane_plan(fault, len(buffers), plan.page_bytes)
        if frame_faults is not None:
            self.inner.arm(plan.reservation_id, frame_faults)
        return await self.inner.send(address, plan, buffers, ready)


class FaultIntake:
    """Prefill's dispatch intake on a test mesh (production: `accept_dispatch`)."""

    def __init__(self, sender: FaultySender) -> None:
        self.sender = sender

    def __call__(self, d: m.PrefillDispatch,
                 headers: Mapping[str, str] | None) -> m.PrefillDispatch | None:
        fault = fault_of(headers)
        if fault == "silent_prefill":
            return None  # prefill never hears of it and tells nobody
        if fault == "prefill_reject":
            # Prefill's own gate refuses a reservation that does not match the prompt.
            return msgspec.structs.replace(d, reservation=msgspec.structs.replace(
                d.reservation, page_ids=[]))
        if fault:
            self.sender.armed[d.reservation.reservation_id] = fault
        return d


def accept_dispatch(d: m.PrefillDispatch,
                    headers: Mapping[str, str] | None) -> m.PrefillDispatch | None:
    """The production intake: every dispatch as it came (headers are not read)."""
    return d


def prefill_wiring(cfg: PrefillConfig) -> tuple[KVTransport | None, Any]:
    """(transport, intake) for a prefill worker: (None: the worker builds its own, and
    `accept_dispatch`), or on a test mesh the fault-injecting pair, its frame hook built
    into the real transport at construction."""
    if not enabled(cfg):
        return None, accept_dispatch
    inner = make_service_transport(cfg.transport, cfg.data_host, cfg.data_port, faults=True,
                                   progress_timeout_s=cfg.transfer_progress_s,
                                   ucx_error_mode=cfg.ucx_error_mode)
    assert isinstance(inner, FaultInjectingTransport)
    sender = FaultySender(inner)
    return sender, FaultIntake(sender)  # type: ignore[return-value]
