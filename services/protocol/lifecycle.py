"""The request lifecycle: one state enum, terminal states that carry their reason, one exit.

    RECEIVED -> ADMITTED -> RESERVED -> PREFILLING -> TRANSFERRED -> DECODING -> FINISHED
    (each service walks the part it owns)  \\-> REJECTED | ABORTED | FAILED

REJECTED is decided by admission before anything is allocated; it is not a kind of
FINISHED: nothing in the mesh treats "ended" as "done well". Which terminal state a request
ends in follows from its `Outcome`'s code (`messages.Code.kind`), so a reason can never
disagree with its state.

Every service keeps one `Lifecycle` per request and ends it only through
`Lifecycle.finish(outcome)`, which goes through the transition check, records the outcome
and says whether this call ended the request (a second abort or release is a no-op).
Service records build on it: `finish()` on a record returns what the caller must release.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdmesh.services.protocol.messages import Code, Kind, Outcome


class RequestState(enum.IntEnum):
    RECEIVED = 0
    ADMITTED = 1
    RESERVED = 2
    PREFILLING = 3
    TRANSFERRED = 4
    DECODING = 5
    FINISHED = 10
    REJECTED = 11
    ABORTED = 12
    FAILED = 13

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({RequestState.FINISHED, RequestState.REJECTED, RequestState.ABORTED,
                      RequestState.FAILED})

_TERMINAL_FOR_KIND = {Kind.FINISHED: RequestState.FINISHED, Kind.REJECTED: RequestState.REJECTED,
                      Kind.ABORTED: RequestState.ABORTED, Kind.FAILED: RequestState.FAILED}

_LIVE_ENDS = frozenset({RequestState.ABORTED, RequestState.FAILED})
_NEXT: dict[RequestState, frozenset[RequestState]] = {
    RequestState.RECEIVED: frozenset({RequestState.ADMITTED, RequestState.REJECTED}),
    RequestState.ADMITTED: frozenset({RequestState.RESERVED, RequestState.PREFILLING})
    | _LIVE_ENDS,
    RequestState.RESERVED: frozenset({RequestState.PREFILLING, RequestState.TRANSFERRED})
    | _LIVE_ENDS,
    RequestState.PREFILLING: frozenset({RequestState.TRANSFERRED}) | _LIVE_ENDS,
    RequestState.TRANSFERRED: frozenset({RequestState.DECODING, RequestState.FINISHED})
    | _LIVE_ENDS,
    RequestState.DECODING: frozenset({RequestState.FINISHED}) | _LIVE_ENDS,
}


def terminal_state(code: Code) -> RequestState:
    """The terminal state an outcome with this code ends a request in."""
    return _TERMINAL_FOR_KIND[code.kind]


class IllegalTransition(RuntimeError):
    def __init__(self, request_id: str, current: RequestState, wanted: RequestState) -> None:
        super().__init__(f"request {request_id}: illegal transition {current.name} -> "
                         f"{wanted.name}")
        self.request_id = request_id
        self.current = current
        self.wanted = wanted


def check_transition(request_id: str, current: RequestState, wanted: RequestState) -> None:
    if wanted not in _NEXT.get(current, frozenset()):
        raise IllegalTransition(request_id, current, wanted)


@dataclass(eq=False)
class Lifecycle:
    """One request's state as one service sees it. Moves only through `advance` (live
    states) and `finish` (terminal), both checked against the transition table."""

    request_id: str
    state: RequestState = RequestState.RECEIVED
    outcome: Outcome | None = None

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def advance(self, wanted: RequestState) -> None:
        """Move to a live state; raises IllegalTransition (terminal states: `finish`)."""
        if wanted.is_terminal:
            raise IllegalTransition(self.request_id, self.state, wanted)
        check_transition(self.request_id, self.state, wanted)
        self.state = wanted

    def finish(self, outcome: Outcome) -> bool:
        """End the request with `outcome`. True when this call ended it; False when it had
        already ended (the first outcome stands). Raises IllegalTransition when the
        outcome's state cannot follow the current one (e.g. FINISHED before TRANSFERRED)."""
        if self.state.is_terminal:
            return False
        wanted = terminal_state(outcome.code)
        check_transition(self.request_id, self.state, wanted)
        self.state = wanted
        self.outcome = outcome
        return True
