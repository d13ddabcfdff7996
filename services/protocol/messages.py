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
UNREACHABLE_SUBJECT: Final = f"{PREFIX}.admission.unreachable"
# Operator -> prefill workers (request, many replies): delete one salt's KV in every tier.
CACHE_PURGE_SUBJECT: Final = f"{PREFIX}.cache.purge"


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


def inbox_prefix(nats_user: str) -> str:
    """The reply-subject prefix of NATS user `nats_user` (nats-py's `inbox_prefix`): each
    identity may subscribe to its own replies only (services/ops/natsauth.py), so none reads
    another's `Admitted`, `Reserved` or stats reply. A client without a user keeps NATS's
    default `_INBOX`."""
    return f"_INBOX.{nats_user}" if nats_user else "_INBOX"


# ---------------------------------------------------------------------------------------
# Codes
# ---------------------------------------------------------------------------------------
class Role(enum.StrEnum):
    ADMISSION = "admission"
    PREFILL = "prefill"
    DECODE = "decode"
    GATEWAY = "gateway"


class Code(enum.IntEnum):
    """Why a request ended: the one reason vocabulary of the mesh.

    Every terminal path carries one (in an `Outcome`): admission's rejections, the
    finish of a generation, aborts and failures; the wire, the gateway's HTTP answers and
    metric labels, and the pool's release causes all use these names (`Code.label`). The
    hundreds say which terminal state a code belongs to (`Code.kind`)."""

    # FINISHED: the generation ended well.
    STOP = 100  # end-of-sequence token
    LENGTH = 101  # max_tokens reached
    # REJECTED: decided by admission before anything is allocated (never a kind of finish).
    CONTEXT_LENGTH_EXCEEDED = 200  # prompt + max_tokens > served context
    PROMPT_EXCEEDS_PREFILL_POOL = 201  # prompt > largest live prefill pool
    EXCEEDS_DECODE_POOL = 202  # prompt + max_tokens > largest live decode pool
    NO_WORKERS = 203  # no live prefill or decode worker
    SATURATED = 204  # workers live but none can hold it now
    INVALID = 205  # empty prompt, bad lengths
    TENANT_LIMIT = 206  # the tenant holds its share of the decode KV (tenants file)
    # ABORTED: someone stopped an admitted request.
    ABORTED = 300  # client gone or explicit abort
    PEER_RELEASED = 301  # the other side gave up first, or stopped heartbeating
    # FAILED: an admitted request could not be served.
    TICKET_INVALID = 400
    RESERVE_FAILED = 401
    PREFILL_REJECTED = 402
    TRANSFER_FAILED = 403  # integrity check, peer lost, deadline
    DEADLINE = 404
    INTERNAL = 405
    REFUSED = 406  # a worker's own capacity gate refuses the request outright (static)
    INTERRUPTED = 407  # the gateway lost its control-plane connection mid-stream
    # A worker serving the request died or was cut off (heartbeats or its data-plane
    # connection lost), or drained with the request still in flight: the gateway resumes
    # the request on other workers from the tokens already delivered (RESUMABLE).
    WORKER_LOST = 408
    WORKER_DRAINED = 409

    @property
    def kind(self) -> Kind:
        return Kind(self.value // 100)

    @property
    def label(self) -> str:
        """The name used in metric labels, release causes and logs."""
        return self.name.lower()


class Kind(enum.IntEnum):
    """The terminal state a `Code` leads to (lifecycle.RequestState has the same names)."""

    FINISHED = 1
    REJECTED = 2
    ABORTED = 3
    FAILED = 4


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """How a request ended: a code from the one vocabulary and a human-readable detail."""

    code: Code
    detail: str = ""
    worker: str = ""  # RESUMABLE codes: the worker lost (the resumed request avoids it)

    @property
    def kind(self) -> Kind:
        return self.code.kind

    @property
    def label(self) -> str:
        return self.code.label


# The codes an admitted request is resumed after rather than failed (gateway/mesh.py).
RESUMABLE: Final = frozenset({Code.WORKER_LOST, Code.WORKER_DRAINED})

FINISHED_STOP: Final = Outcome(code=Code.STOP)
FINISHED_LENGTH: Final = Outcome(code=Code.LENGTH)


# ---------------------------------------------------------------------------------------
# Requests and tickets
# ---------------------------------------------------------------------------------------
# What a structured output may be constrained by (services/engine/grammar.py): a JSON
# schema (`json`; any JSON object is grammar.ANY_JSON_OBJECT), a regular expression,
# a JSON list of strings to choose from, or a Lark / GBNF grammar.
STRUCTURED_KINDS: Final = ("json", "regex", "choice", "grammar")


class Structured(msgspec.Struct, frozen=True, kw_only=True):
    """A structured-output constraint: every token sampled for the request (prefill's first
    and decode's) is masked to what `spec`, of `kind`, still allows."""

    kind: str
    spec: str


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """How one request samples, carried to prefill (first token) and decode (the rest).
    Every field's default is its neutral value (services/engine/sampling.py applies them)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens, as vLLM
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's + the top k
    # The prompt's distinct token ids, sent only when repetition_penalty != 1 (decode does
    # not see the prompt otherwise).
    penalty_prompt_ids: list[int] = []
    # A resumed request (its first workers were lost): this many tokens of it were already
    # generated and delivered, and are now the end of `prompt_ids`. The RNG's token index
    # and `min_tokens` count on from here, so the continuation is the stream the first
    # workers would have produced.
    start_index: int = 0
    # Those tokens, sent only when a penalty counts output tokens (presence, frequency,
    # repetition) or the output is structured: the sampler's counts, and its grammar's
    # state, start from them.
    prior_output_ids: list[int] = []
    structured: Structured | None = None
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, before the rest
    # The prompt's own logprobs (completions' echo with logprobs): prefill sends each
    # prompt token's logprob and this many alternatives (PromptLogprobs), computing the
    # whole prompt (no prefix-cache hit) to do so.
    prompt_logprobs: int | None = None


class SubmitRequest(msgspec.Struct, frozen=True, kw_only=True, tag="submit"):
    """Gateway -> admission. The gateway has already authenticated the tenant.
    `stream_key`: the gateway's fresh key for this request's stream (streamauth.py);
    admission hands it to the two workers it chooses, and the gateway takes only events
    MACed under it."""

    request_id: str
    tenant: str
    cache_salt: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    stream_key: str = ""
    # The tenant's limits as the gateway's tenants file sets them (gateway/tenants.py):
    # admission orders waiting requests by `weight` and holds each tenant to `kv_share`
    # of the live decode KV.
    weight: float = 1.0
    kv_share: float = 1.0
    # Choices 1..n-1 of an `n` > 1 request: admitted all together with this one (choice 0)
    # or rejected with it, never some of them.
    choices: list[SubmitChoice] = []
    # Workers admission must not place this request on: a resumed request's lost ones
    # (their heartbeats may still be in admission's registry for up to a TTL).
    avoid_workers: list[str] = []
    # A resumed request: the id of the request it continues (logs and metrics only).
    resumes: str = ""
    # vLLM's `priority` (lower first): orders this tenant's own waiting requests in
    # admission's fair line; it never moves a request ahead of another tenant's share.
    priority: int = 0


class SubmitChoice(msgspec.Struct, frozen=True, kw_only=True):
    """One more choice of a submit: the same prompt and max_tokens, its own request id,
    stream key and sampling (seed)."""

    request_id: str
    stream_key: str
    sampling: Sampling = Sampling()


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where admission placed one choice."""

    request_id: str
    decode_worker: str
    prefill_worker: str


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


class Admitted(msgspec.Struct, frozen=True, kw_only=True, tag="admitted"):
    """Admission -> gateway: the request holds a decode reservation and was dispatched."""

    request_id: str
    decode_worker: str
    prefill_worker: str
    choices: list[Placement] = []  # the submit's other choices, in its order
    # Admission's own time from the submit's arrival to its first dispatch: the queue part
    # of the TTFT, ending where prefill's queue begins (the gateway's submit-to-answer
    # time also holds the reply's way back, which overlaps prefill's work).
    queued_s: float | None = None


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="rejected"):
    """Admission -> gateway: refused before anything was allocated (terminal, I1)."""

    request_id: str
    outcome: Outcome  # a REJECTED-kind code
    prompt_len: int = 0
    max_tokens: int = 0
    limit: int = 0
    retry_after_s: float = 0.0  # when trying again may succeed (0: no estimate)


SubmitReply = Admitted | Rejected


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """A decode lease as the data plane sees it: decode's reserve reply carries it to
    admission, the dispatch carries it to prefill, which turns it into its transfer plan.
    `reservation_id` is the lease's id (one name on the wire, `Lease.lease_id` in the pool)."""

    reservation_id: str
    epoch: int
    page_ids: list[int]
    page_tokens: int
    page_bytes: int
    data_address: str


class ReserveRequest(msgspec.Struct, frozen=True, kw_only=True, tag="reserve"):
    """Admission -> the chosen decode worker. `stream_key` authenticates the request's
    stream and the prefill's messages to decode (streamauth.py); `data_key` is admission's
    fresh key for this reservation's KV frames (framing.transfer_key). Only the two workers
    of the request learn them, on their own subjects."""

    ticket: AdmittedTicket
    sampling: Sampling = Sampling()
    stream_key: str = ""
    data_key: str = ""


class ReserveCancel(msgspec.Struct, frozen=True, kw_only=True, tag="reserve_cancel"):
    """Admission -> the one decode worker it asked (on its reserve subject): the reserve
    with this ticket got no reply in time and the request went elsewhere (or was
    rejected), or its dispatch could not be sent (over NATS's max_payload); free what it
    reserved, if anything, and tell no client: admission answers.
    `nonce` is the ticket's: a later reservation for the same request is not touched."""

    request_id: str
    nonce: str
    outcome: Outcome


ToReserve = ReserveRequest | ReserveCancel


class Reserved(msgspec.Struct, frozen=True, kw_only=True, tag="reserved"):
    request_id: str
    reservation: Reservation


class ReserveRefused(msgspec.Struct, frozen=True, kw_only=True, tag="reserve_refused"):
    """Decode could not reserve. `outcome.code` REFUSED is final (its static capacity gate);
    any other code (pool full now, duplicate id, bad ticket) may succeed elsewhere/later."""

    request_id: str
    outcome: Outcome


ReserveReply = Reserved | ReserveRefused


class PrefillDispatch(msgspec.Struct, frozen=True, kw_only=True, tag="dispatch"):
    ticket: AdmittedTicket
    prompt_ids: list[int]
    sampling: Sampling
    reservation: Reservation
    # Admission's signature over the ticket, prompt digest and reservation
    # (tickets.Signer.grant()): prefill refuses a dispatch whose grant does not verify.
    grant: str = ""
    # The request's keys, as decode got them in its ReserveRequest.
    stream_key: str = ""
    data_key: str = ""


class Release(msgspec.Struct, frozen=True, kw_only=True, tag="release"):
    """A peer tells decode to free a reservation now (no timeout as cleanup, I6)."""

    request_id: str
    reservation_id: str
    outcome: Outcome


class PrefillProgress(msgspec.Struct, frozen=True, kw_only=True, tag="prefill_progress"):
    """Prefill -> decode (on its release subject) and -> gateway (on the token stream): the
    prefill still holds this request and is making progress. Sent when a dispatch is
    queued, after every prefill chunk, and every heartbeat for each request it holds while
    its engine is not stalled. Liveness is progress, not a fixed deadline: decode keeps a
    reservation and the gateway keeps waiting for the first token while these arrive."""

    request_id: str
    reservation_id: str
    done_tokens: int  # prompt tokens whose KV is computed (cached ones included)
    total_tokens: int


ToDecode = Release | PrefillProgress


class PhaseTiming(msgspec.Struct, frozen=True, kw_only=True, tag="phase_timing"):
    """Prefill -> gateway, after decode acked the KV: where the time before the first
    token went on the prefill side. `transfer_s` runs from the first page sent to the ack;
    `exposed_transfer_s` is the part of it after the last chunk was computed (what the
    transfer adds to the time to first token when pages stream as they are computed)."""

    request_id: str
    queue_s: float  # dispatch received -> first chunk started
    prefill_s: float  # first chunk started -> last chunk computed
    transfer_s: float
    exposed_transfer_s: float


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Broadcast: every worker holding anything for `request_id` frees it."""

    request_id: str
    outcome: Outcome = Outcome(code=Code.ABORTED)


# ---------------------------------------------------------------------------------------
# The token stream of one request (tokens_subject(request_id)): a tagged union
# ---------------------------------------------------------------------------------------
class TokenEvent(msgspec.Struct, frozen=True, kw_only=True, tag="tokens"):
    """Decode -> gateway: tokens in `seq` order; `finish` (a FINISHED-kind outcome) set on
    the last one."""

    request_id: str
    seq: int
    token_ids: list[int] = []
    finish: Outcome | None = None
    prompt_tokens: int = 0
    # With Sampling.logprobs: per token of `token_ids`, (its logprob, [(id, logprob) of the
    # top k]). The first token is sampled on prefill, which sends its logprobs in a
    # `FirstTokenLogprobs` event before the KV goes out (decode's seq 0 carries none).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []
    # On seq 0 only: decode's own part of the time to first token, from the verified
    # commit of the prompt's KV to this event's publication (seconds).
    decode_first_token_s: float | None = None


class FirstTokenLogprobs(msgspec.Struct, frozen=True, kw_only=True, tag="first_logprobs"):
    """Prefill -> gateway, with Sampling.logprobs only: the logprobs of the first token,
    which prefill samples; sent before the KV goes out. Neither carries tokens nor ends."""

    request_id: str
    token_id: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []


class StreamFailed(msgspec.Struct, frozen=True, kw_only=True, tag="failed"):
    """A worker ended an admitted request without finishing it (ABORTED/FAILED kind)."""

    request_id: str
    outcome: Outcome


class PrefixCacheInfo(msgspec.Struct, frozen=True, kw_only=True, tag="prefix_cache"):
    """Prefill -> gateway, before the KV goes out: how much of the prompt the prefix cache
    served (usage.prompt_tokens_details.cached_tokens). Neither carries tokens nor ends."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int


class CachePurge(msgspec.Struct, frozen=True, kw_only=True, tag="cache_purge"):
    """`pdmesh cache purge` -> every prefill worker: delete the cached KV of this cache salt
    (a tenant's) in the pool and in every KV tier; each worker answers `CachePurged`. With
    `tenant` too (or alone), also the salts the worker has seen that tenant's tickets carry."""

    cache_salt: str = ""
    tenant: str = ""


class CachePurged(msgspec.Struct, frozen=True, kw_only=True, tag="cache_purged"):
    """A prefill worker's answer to `CachePurge`: entries removed, by tier ("pool", "host",
    "disk", "remote"), and what failed (a store that could not be reached)."""

    worker_id: str
    removed: dict[str, int] = {}
    error: str = ""


class StreamInterrupted(msgspec.Struct, frozen=True, kw_only=True, tag="interrupted"):
    """Made by the gateway itself (never sent): its NATS connection was interrupted, so
    events of this stream may be lost (NATS core is at-most-once)."""

    request_id: str
    detail: str


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True, tag="prompt_logprobs"):
    """Prefill -> gateway, a chunk at a time: the logprobs of prompt tokens `start`,
    `start + 1`, ... each given the tokens before it (the first prompt token has none), with
    `Sampling.prompt_logprobs` alternatives each."""

    request_id: str
    start: int
    logprobs: list[tuple[float, list[tuple[int, float]]]]


StreamEvent = (TokenEvent | StreamFailed | PrefixCacheInfo | FirstTokenLogprobs
               | PrefillProgress | PhaseTiming | PromptLogprobs)
LocalStreamEvent = StreamEvent | StreamInterrupted


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
    available_tokens: int = 0  # tokens a new lease could take now (free + evictable)
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
    # Decode: KV tokens its leases hold per tenant (admission's per-tenant KV share). Only
    # the gateway, admission and the tools user may read decode heartbeats (natsauth.py).
    tenant_tokens: dict[str, int] = {}
    # What decides the bits this worker computes (services/engine/fingerprint.py): model
    # file digest, engine path and kernel build, dtype, device. Admission pairs a prefill
    # and a decode only when theirs are equal (empty: not announced).
    fingerprint: str = ""


class DataPlaneUnreachable(msgspec.Struct, frozen=True, kw_only=True, tag="unreachable"):
    """Prefill -> admission: connecting to this worker's advertised data address failed, so
    admission routes around it (a wrong or unreachable address is caught at its first
    transfer, not retried forever)."""

    worker_id: str
    data_address: str
    reporter: str
    detail: str = ""


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
    # Requests holding a live lease here now (a reservation or a stream in progress):
    # tells tests which worker serves a request, where request_ids also names reserves
    # that were refused or cancelled.
    leased_requests: list[str] = []
    pid: int = 0
    cached_pages: int = 0  # prefix-cache pages (free + leased + cached == total)


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
