"""The admission decision: a pure function of the request and the *live* worker views.

It runs before anything is allocated anywhere. A rejection is a terminal value of its own
(`Rejected`), not a flavour of success, so the caller cannot hand it to a function that
reserves or dispatches (those take an `Admitted`).

A prefill and a decode are paired only when their engine fingerprints are equal
(`services/engine/fingerprint.py`: model file, decode path and kernel build, torch, dtype,
device): two workers that would compute different bits never serve one request. An empty
fingerprint (a worker that announces none) pairs only with another empty one: it says
nothing of the worker's bits, so it cannot be shown to match a known build, while a mesh
of workers that all announce none keeps working as before.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from pdmesh.services.protocol.capacity import decode_refusal, fits, prefill_refusal
from pdmesh.services.protocol.messages import Code, SubmitRequest


@dataclass(frozen=True)
class WorkerView:
    """What admission knows of one live worker, from its latest heartbeat."""

    worker_id: str
    capacity_tokens: int  # real pool capacity (never the configured figure)
    available_tokens: int
    page_tokens: int
    served_context: int  # the context this worker really serves (clamped to its pool)
    queue_depth: int = 0
    # Prefill: leading tokens of *this* request (under its tenant's salt) that the worker's
    # prefix cache holds, from its heartbeat summary (CapacityRegistry.views).
    cached_prefix_tokens: int = 0
    fingerprint: str = ""  # what decides its bits (Heartbeat.fingerprint; "": not announced)


@dataclass(frozen=True)
class Admitted:
    prefill: WorkerView
    decode: WorkerView


@dataclass(frozen=True)
class Rejected:
    reason: Code  # a REJECTED-kind code
    message: str
    limit: int = 0
    retry_after_s: float = 0.0  # when trying again may succeed (0: no estimate)


@dataclass(frozen=True)
class Retry:
    """A decode worker did not reserve now (its pool changed since its heartbeat): try
    another worker or wait, never final by itself."""

    why: str
    worker_id: str = ""  # the decode that did not reserve ("": none in particular)


class AdmissionPolicy(Protocol):
    """How admission decides, injected at construction (production: `LivePolicy`)."""

    def decide(self, req: SubmitRequest, prefills: list[WorkerView],
               decodes: list[WorkerView], headers: Mapping[str, str]) -> Admitted | Rejected:
        ...

    def dispatch_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        """NATS headers to put on the dispatch (production: none)."""
        ...

    def reserve_headers(self, request_id: str, headers: Mapping[str, str],
                        attempt: int) -> dict[str, str] | None:
        """NATS headers to put on the `attempt`-th reserve request (production: none)."""
        ...


class LivePolicy:
    """The production policy: `decide()` on the live worker views; request headers are
    not read."""

    def decide(self, req: SubmitRequest, prefills: list[WorkerView],
               decodes: list[WorkerView], headers: Mapping[str, str]) -> Admitted | Rejected:
        return decide(len(req.prompt_ids), req.max_tokens, prefills, decodes,
                      spread=req.request_id)

    def dispatch_headers(self, headers: Mapping[str, str]) -> dict[str, str] | None:
        return None

    def reserve_headers(self, request_id: str, headers: Mapping[str, str],
                        attempt: int) -> dict[str, str] | None:
        return None


def prefill_cost(prompt_len: int, worker: WorkerView) -> int:
    """Tokens the worker must compute before this request's first token, estimating each
    queued prompt at this one's length: cache affinity, balanced against queue depth (a
    full cache hit is worth about one queued request). Without cache hits it orders by
    queue depth alone, as before."""
    cached = min(max(worker.cached_prefix_tokens, 0), max(prompt_len - 1, 0))
    return (worker.queue_depth + 1) * prompt_len - cached


def tie_break(spread: str, worker_id: str) -> int:
    """Rendezvous order of equally good workers for one request: a stable, per-request
    shuffle, so an idle mesh spreads requests over every equal worker instead of sending
    all of them to the same one (a worker id as the tie-break did exactly that)."""
    digest = hashlib.blake2b(f"{spread}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def context_rejection(prompt_len: int, max_tokens: int, context: int) -> Rejected | None:
    """The rejection of a request longer than the served `context` (None when it fits);
    the gateway applies it too, before any control message is sent."""
    total = prompt_len + max_tokens
    if total <= context:
        return None
    return Rejected(Code.CONTEXT_LENGTH_EXCEEDED,
                    f"This model's maximum context length is {context} tokens. However, "
                    f"you requested {total} tokens ({prompt_len} in the prompt, "
                    f"{max_tokens} for the completion).", limit=context)


def paired_groups(prefills: list[WorkerView], decodes: list[WorkerView]
                  ) -> list[tuple[list[WorkerView], list[WorkerView]]]:
    """(prefills, decodes) of each engine fingerprint that both roles have: the only pairs
    that compute the same bits. Workers of a fingerprint the other role lacks are left out."""
    groups: dict[str, tuple[list[WorkerView], list[WorkerView]]] = {}
    for side, views in enumerate((prefills, decodes)):
        for v in views:
            groups.setdefault(v.fingerprint, ([], []))[side].append(v)  # guard: fingerprint-pairing
    return [(p, d) for p, d in groups.values() if p and d]


def mismatch_rejection(prefills: list[WorkerView], decodes: list[WorkerView]) -> Rejected:
    """NO_WORKERS: live prefill and decode workers, but no pair with equal fingerprints."""

    def named(views: list[WorkerView]) -> str:
        prints = sorted({v.fingerprint or "(none announced)" for v in views})
        more = f" and {len(prints) - MISMATCH_SHOWN} more" if len(prints) > MISMATCH_SHOWN else ""
        return ", ".join(prints[:MISMATCH_SHOWN]) + more

    return Rejected(Code.NO_WORKERS,
                    "engine fingerprint mismatch: no live prefill and decode worker compute "
                    f"the same bits (prefill: {named(prefills)}; decode: {named(decodes)}); "
                    "a mesh's workers must run one model file, kernel build, torch, dtype "
                    "and device")


MISMATCH_SHOWN = 3  # distinct fingerprints a mismatch rejection names per role


def decide(prompt_len: int, max_tokens: int, prefills: list[WorkerView],
           decodes: list[WorkerView], spread: str = "") -> Admitted | Rejected:
    """Admit to the least-loaded pair that can hold the request now, or reject with a reason.
    Only workers of one engine fingerprint pair (`paired_groups`); within each group the
    prefill worker is the one with the least work ahead of this request's first token
    (`prefill_cost`: queue depth less its cached prefix of this request), the decode
    worker the one with the most free KV, then the fewest requests in flight; among equals
    the order is `tie_break(spread, worker)` (admission passes the request id). With
    several groups (a mesh during an upgrade), the pair with the most free decode KV wins.

    Order of checks matters for the message a client sees: static limits (context, pool
    sizes) first, so an over-long prompt is always `context_length_exceeded`-class and
    never a transient 429.
    """
    if prompt_len <= 0:
        return Rejected(Code.INVALID, "prompt is empty")
    if max_tokens <= 0:
        return Rejected(Code.INVALID, "max_tokens must be at least 1")
    if not prefills or not decodes:
        return Rejected(Code.NO_WORKERS,
                        "no live prefill or decode worker; try again shortly")
    groups = paired_groups(prefills, decodes)
    if not groups:
        return mismatch_rejection(prefills, decodes)
    decisions = [_decide_within(prompt_len, max_tokens, p, d, spread) for p, d in groups]
    admitted = [x for x in decisions if isinstance(x, Admitted)]
    if admitted:
        return min(admitted, key=lambda a: (-a.decode.available_tokens, a.decode.queue_depth,
                                            prefill_cost(prompt_len, a.prefill),
                                            tie_break(spread, a.decode.worker_id)))
    rejections = [x for x in decisions if isinstance(x, Rejected)]
    # A busy group may take it later (the caller waits); otherwise the group closest to
    # holding it says why not.
    return min(rejections, key=lambda r: (r.reason is not Code.SATURATED, -r.limit))


def _decide_within(prompt_len: int, max_tokens: int, prefills: list[WorkerView],
                   decodes: list[WorkerView], spread: str) -> Admitted | Rejected:
    """`decide` among workers of one fingerprint (both lists non-empty)."""
    total = prompt_len + max_tokens
    # Decode holds prompt + every generated token; prefill holds the prompt.
    context = max(max(d.served_context for d in decodes), 0)
    over = context_rejection(prompt_len, max_tokens, context)
    if over is not None:
        return over
    prefill_ok = [p for p in prefills if not prefill_refusal(
        prompt_len, p.capacity_tokens, p.page_tokens, p.served_context)]
    if not prefill_ok:
        limit = max(p.capacity_tokens for p in prefills)
        return Rejected(Code.PROMPT_EXCEEDS_PREFILL_POOL,
                        f"prompt of {prompt_len} tokens exceeds the prefill KV pool "
                        f"({limit} tokens)", limit=limit)
    decode_ok = [d for d in decodes if not decode_refusal(
        prompt_len, max_tokens, d.capacity_tokens, d.page_tokens, d.served_context)]
    if not decode_ok:
        limit = max(d.capacity_tokens for d in decodes)
        return Rejected(Code.EXCEEDS_DECODE_POOL,
                        f"prompt + max_tokens = {total} tokens exceeds the decode KV pool "
                        f"({limit} tokens)", limit=limit)
    prefill_now = [p for p in prefill_ok if fits(prompt_len, p.available_tokens, p.page_tokens)]
    decode_now = [d for d in decode_ok if fits(total, d.available_tokens, d.page_tokens)]
    if not prefill_now or not decode_now:
        # Prefill queues requests whose pages are busy, so a full prefill pool only
        # delays; decode must hold the whole lease now.
        if not decode_now:
            return Rejected(Code.SATURATED,
                            "all decode workers are busy; retry later")
        prefill_now = prefill_ok
    prefill = min(prefill_now, key=lambda p: (prefill_cost(prompt_len, p), p.queue_depth,
                                              -p.available_tokens,
                                              tie_break(spread, p.worker_id)))
    decode = min(decode_now, key=lambda d: (-d.available_tokens, d.queue_depth,
                                            tie_break(spread, d.worker_id)))
    return Admitted(prefill=prefill, decode=decode)
