"""Test-only fault injection for the running mesh. Off unless explicitly allowed.

A service honours per-request faults only when started with `PDMESH_FAULTS` containing
`request_faults`, which the config accepts only with `PDMESH_ALLOW_FAULTS=1`. The gateway then
reads the fault name from the `X-Pdmesh-Fault` header and carries it in `SubmitRequest.fault`;
admission passes it on in `PrefillDispatch.fault`. A production mesh ignores the header.

Faults (name: what happens):
- `bypass_admission`: admission skips its length checks (the workers' own gates must hold).
- `stub_transfer`: prefill sends a 1-token stub for the whole prompt (the 2026 incident).
- `stale_epoch`, `foreign_reservation`: prefill's frames name another epoch / reservation.
- `corrupt_payload`, `corrupt_header`, `drop_frame`, `duplicate_frame`, `reorder_frames`,
  `commit_first` (the "done" arrives before the data), `truncate`, `reset`: data-plane
  faults on this request's KV frames.
- `stall`: prefill pauses 0.5 s before its second frame (time to kill it mid-transfer).
- `silent_prefill`: prefill fails without telling decode (decode's deadline is the backstop).
- `prefill_reject`: prefill's own gate refuses a request admission admitted (asymmetric
  rejection: decode must free its lease at once, not after a transfer timeout).
"""

from __future__ import annotations

from transports import FaultPlan

FAULT_HEADER = "X-Pdmesh-Fault"
REQUEST_FAULTS = "request_faults"

DATA_PLANE = ("corrupt_payload", "corrupt_header", "drop_frame", "duplicate_frame",
              "reorder_frames", "commit_first", "truncate", "reset", "stall", "stale_epoch",
              "foreign_reservation")
CONTROL = ("bypass_admission", "stub_transfer", "silent_prefill", "prefill_reject")
ALL = DATA_PLANE + CONTROL


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
