"""Every control-plane message and every NATS subject name of the mesh.

Wire format: msgspec MessagePack, tagged structs, one typed decoder per subscription built
at start-up. New fields always get defaults so that mixed versions interoperate. Status and
reason codes are int enums. Nothing here imports torch or a service: it is the contract.
"""

from __future__ import annotations

import enum
from typing import Final, Generic, TypeVar

import msgspec

# ---------------------------------------------------------------------------------------
# Subjects
# ---------------------------------------------------------------------------------------
PREFIX: Final = "pdmesh"
SUBMIT_SUBJECT: Final = f"{PREFIX}.admission.submit"
HEARTBEAT_SUBJECT: Final = f"{PREFIX}.heartbeat"  # + ".<role>.<worker_id>"
HEARTBEAT_WILDCARD: Final = f"{PREFIX}.heartbeat.>"
ABORT_SUBJECT: Final = f"{PREFIX}.abort"
STATS_SUBJECT: Final = f"{PREFIX}.stats"  # + ".<role>.<worker_id>" (request/reply)


def heartbeat_subject(role: str, worker_id: str) -> str:
    return f"{HEARTBEAT_SUBJECT}.{role}.{worker_id}"


def reserve_subject(decode_worker: str) -> str:
    return f"{PREFIX}.decode.{decode_worker}.reserve"


def release_subject(decode_worker: str) -> str:
    return f"{PREFIX}.decode.{decode_worker}.release"


def dispatch_subject(prefill_worker: str) -> str:
    return f"{PREFIX}.prefill.{prefill_worker}.dispatch"


def tokens_subject(request_id: str) -> str:
    return f"{PREFIX}.tokens.{request_id}"


def stats_subject(role: str, worker_id: str) -> str:
    return f"{STATS_SUBJECT}.{role}.{worker_id}"


# ---------------------------------------------------------------------------------------
# Codes
# ---------------------------------------------------------------------------------------
class Role(enum.StrEnum):
    ADMISSION = "admission"
    PREFILL = "prefill"
    DECODE = "decode"
    GATEWAY = "gateway"


class RejectReason(enum.IntEnum):
    """Why admission refused a request. Rejection is terminal and never a kind of finish."""

    CONTEXT_LENGTH_EXCEEDED = 1  # prompt + max_tokens > served context
    PROMPT_EXCEEDS_PREFILL_POOL = 2  # prompt > largest live prefill pool
    EXCEEDS_DECODE_POOL = 3  # prompt + max_tokens > largest live decode pool
    NO_WORKERS = 4  # no live prefill or decode worker
    SATURATED = 5  # workers live but none can hold it now
    INVALID = 6  # empty prompt, bad lengths


class FinishReason(enum.IntEnum):
    STOP = 1  # end-of-sequence token
    LENGTH = 2  # max_tokens reached


class FailCode(enum.IntEnum):
    """Why an admitted request ended without finishing (ABORTED / FAILED)."""

    ABORTED = 1  # client gone or explicit abort
    TICKET_INVALID = 2
    RESERVE_FAILED = 3
    PREFILL_REJECTED = 4
    TRANSFER_FAILED = 5  # integrity check, peer lost, deadline
    DEADLINE = 6
    INTERNAL = 7
    PEER_RELEASED = 8  # the other side gave up first
    REFUSED = 9  # a worker's own capacity gate refuses the request outright (static)


# ---------------------------------------------------------------------------------------
# Requests and tickets
# ---------------------------------------------------------------------------------------
class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


class SubmitRequest(msgspec.Struct, frozen=True, kw_only=True, tag="submit"):
    """Gateway -> admission. The gateway has already authenticated the tenant."""

    request_id: str
    tenant: str
    cache_salt: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    # Test-only fault to inject for this request (see services/faults.py); honoured only
    # by services started with PDMESH_FAULTS=request_faults, which needs PDMESH_ALLOW_FAULTS=1.
    fault: str = ""


class AdmittedTicket(msgspec.Struct, frozen=True, kw_only=True):
    """Only admission constructs a signed one; prefill and decode verify `signature`."""

    request_id: str
    tenant: str
    cache_salt: str
    prompt_len: int
    max_tokens: int
    prefill_worker: str
    decode_worker: str
    expires_at: float  # unix seconds
    nonce: str
    signature: str = ""


class Rejection(msgspec.Struct, frozen=True, kw_only=True):
    reason: RejectReason
    message: str
    prompt_len: int = 0
    max_tokens: int = 0
    limit: int = 0


class SubmitReply(msgspec.Struct, frozen=True, kw_only=True, tag="submit_reply"):
    request_id: str
    admitted: bool
    rejection: Rejection | None = None
    decode_worker: str = ""
    prefill_worker: str = ""


class ReserveRequest(msgspec.Struct, frozen=True, kw_only=True, tag="reserve"):
    ticket: AdmittedTicket
    sampling: Sampling = Sampling()


class ReserveReply(msgspec.Struct, frozen=True, kw_only=True, tag="reserve_reply"):
    ok: bool
    request_id: str
    reservation_id: str = ""
    epoch: int = 0
    page_ids: list[int] = []
    page_tokens: int = 0
    page_bytes: int = 0
    data_address: str = ""
    error: str = ""
    code: int = 0


class PrefillDispatch(msgspec.Struct, frozen=True, kw_only=True, tag="dispatch"):
    ticket: AdmittedTicket
    prompt_ids: list[int]
    sampling: Sampling
    reservation_id: str
    epoch: int
    page_ids: list[int]
    page_tokens: int
    page_bytes: int
    data_address: str
    fault: str = ""  # test-only, see SubmitRequest.fault


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """A peer tells decode to free a reservation now (no timeout as cleanup, I6)."""

    request_id: str
    reservation_id: str
    code: FailCode
    detail: str = ""


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Broadcast: every worker holding anything for `request_id` frees it."""

    request_id: str
    code: FailCode = FailCode.ABORTED
    detail: str = ""


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True, tag="tokens"):
    """Decode (or a failing worker) -> gateway on tokens_subject(request_id).

    `finish` set means the stream is over; `fail_code` set means it failed. `seq` -1 marks
    an info event from prefill (only `cached_tokens` set) that neither carries tokens nor
    ends the stream.
    """

    request_id: str
    seq: int
    token_ids: list[int] = []
    finish: FinishReason | None = None
    fail_code: FailCode | None = None
    detail: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0


# ---------------------------------------------------------------------------------------
# Heartbeats (live capacity)
# ---------------------------------------------------------------------------------------
class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, tag="heartbeat"):
    worker_id: str
    role: Role
    model: str
    data_address: str = ""
    http_address: str = ""
    # Live figures read off the real pool, never from configuration (I5).
    pool_capacity_tokens: int = 0
    free_tokens: int = 0
    page_tokens: int = 0
    configured_context: int = 0
    served_context: int = 0  # clamped when the pool is smaller than configured
    capacity_mismatch: bool = False
    queue_depth: int = 0
    active_requests: int = 0
    ready: bool = True
    draining: bool = False
    sent_at: float = 0.0
    # Prefix cache (prefill): chain hashes (kvstore.prefix_key) of cached prefixes of
    # `prefix_align_tokens`-multiples, most recently used first, bounded. Admission routes a
    # request to the worker holding its longest prefix; a hash names (salt, tokens) only.
    prefix_hashes: list[int] = []
    prefix_align_tokens: int = 0
    prefix_cached_tokens: int = 0  # tokens held by the cache (evictable ones included)


class StatsReply(msgspec.Struct, frozen=True, kw_only=True, tag="stats"):
    """Answer to stats_subject(): counters tests and `pdmesh check` read."""

    worker_id: str
    role: Role
    counters: dict[str, float] = {}
    leased_pages: int = 0
    free_pages: int = 0
    total_pages: int = 0
    live_leases: int = 0
    integrity_ok: bool = True
    integrity_error: str = ""
    # Requests this worker has heard of (bounded, newest last): lets tests prove that a
    # rejected request reached no worker (I1).
    request_ids: list[str] = []
    pid: int = 0
    cached_pages: int = 0  # prefix-cache pages (free + leased + cached == total)


ControlMessage = (
    SubmitRequest
    | SubmitReply
    | ReserveRequest
    | ReserveReply
    | PrefillDispatch
    | Release
    | Abort
    | TokenEvent
    | Heartbeat
    | StatsReply
)

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class MessageError(ValueError):
    """A control message that could not be decoded; carries the subject and the cause."""

    def __init__(self, subject: str, cause: str, size: int) -> None:
        super().__init__(f"bad message on {subject!r} ({size} bytes): {cause}")
        self.subject = subject
        self.cause = cause
        self.size = size


T = TypeVar("T")


class Decoder(Generic[T]):
    """One typed decoder per subscription, built once; raises MessageError on bad input."""

    def __init__(self, typ: type[T]) -> None:
        self._dec = msgspec.msgpack.Decoder(typ)

    def decode(self, subject: str, data: bytes) -> T:
        try:
            return self._dec.decode(data)
        # msgspec raises UnicodeDecodeError for invalid UTF-8 inside a str (found by fuzzing).
        except (msgspec.MsgspecError, UnicodeDecodeError, ValueError) as exc:
            raise MessageError(subject, f"{type(exc).__name__}: {exc}", len(data)) from exc
