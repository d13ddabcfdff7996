"""The request lifecycle: one enum, named terminal states, legal transitions.

RECEIVED -> ADMITTED -> RESERVED -> PREFILLING -> TRANSFERRED -> DECODING -> FINISHED,
with terminal REJECTED (decided before anything is allocated), ABORTED (client gone, peer
gave up) and FAILED (integrity check, deadline, internal error). REJECTED is not a kind of
FINISHED: nothing in the mesh treats "ended" as "done well".
"""

from __future__ import annotations

import enum


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

_NEXT: dict[RequestState, frozenset[RequestState]] = {
    RequestState.RECEIVED: frozenset({RequestState.ADMITTED, RequestState.REJECTED}),
    RequestState.ADMITTED: frozenset({RequestState.RESERVED, RequestState.PREFILLING,
                                      RequestState.ABORTED, RequestState.FAILED}),
    RequestState.RESERVED: frozenset({RequestState.PREFILLING, RequestState.TRANSFERRED,
                                      RequestState.ABORTED, RequestState.FAILED}),
    RequestState.PREFILLING: frozenset({RequestState.TRANSFERRED, RequestState.ABORTED,
                                        RequestState.FAILED}),
    RequestState.TRANSFERRED: frozenset({RequestState.DECODING, RequestState.FINISHED,
                                         RequestState.ABORTED, RequestState.FAILED}),
    RequestState.DECODING: frozenset({RequestState.FINISHED, RequestState.ABORTED,
                                      RequestState.FAILED}),
}


class IllegalTransition(RuntimeError):
    def __init__(self, request_id: str, current: RequestState, wanted: RequestState) -> None:
        super().__init__(f"request {request_id}: illegal transition {current.name} -> "
                         f"{wanted.name}")
        self.request_id = request_id
        self.current = current
        self.wanted = wanted


def advance(request_id: str, current: RequestState, wanted: RequestState) -> RequestState:
    """Return `wanted` if the transition is legal, else raise IllegalTransition."""
    if wanted not in _NEXT.get(current, frozenset()):
        raise IllegalTransition(request_id, current, wanted)
    return wanted
