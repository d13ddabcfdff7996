"""Capacity rules shared by admission, prefill and decode, so the three always agree.

Admission decides with these on the live figures from heartbeats; prefill and decode check
the same rules again on their own pools (defence in depth). A property test drives all three
over random contexts, pools and requests.
"""

from __future__ import annotations

import logging

from pdmesh.kvstore.spec import pages_for
from pdmesh.services.protocol.errors import StartupError

log = logging.getLogger("pdmesh.capacity")


def fits(num_tokens: int, capacity_tokens: int, page_tokens: int) -> bool:
    """True when `num_tokens` fit in whole pages of a pool of `capacity_tokens`."""
    return pages_for(num_tokens, page_tokens) * page_tokens <= capacity_tokens


def prefill_refusal(prompt_len: int, capacity_tokens: int, page_tokens: int,
                    served_context: int) -> str:
    """Why a prefill worker cannot ever run this prompt ("" when it can)."""
    if prompt_len <= 0:
        return "empty prompt"
    if not fits(prompt_len, capacity_tokens, page_tokens) or prompt_len > served_context:
        return (f"prompt of {prompt_len} tokens exceeds this prefill worker "
                f"(pool {capacity_tokens}, context {served_context})")
    return ""


def decode_refusal(prompt_len: int, max_tokens: int, capacity_tokens: int, page_tokens: int,
                   served_context: int) -> str:  # guard: decode-gate
    """Why a decode worker cannot ever hold this request ("" when it can)."""
    total = prompt_len + max_tokens
    if prompt_len <= 0 or max_tokens <= 0:
        return "empty prompt or max_tokens < 1"
    if total > served_context:
        return f"{total} tokens exceed served context {served_context}"
    if not fits(total, capacity_tokens, page_tokens):
        return f"{total} tokens exceed the decode pool ({capacity_tokens} tokens)"
    return ""


def audit_capacity(configured_context: int, pool_capacity_tokens: int, policy: str,
                   role: str) -> tuple[int, bool]:
    """Return (served_context, mismatch) for a worker whose pool holds
    `pool_capacity_tokens`; under the `fail` policy a mismatch raises StartupError (I5)."""
    if configured_context <= pool_capacity_tokens:  # guard: capacity-audit
        return configured_context, False
    msg = (f"configured context {configured_context} tokens exceeds the real KV pool of this "
           f"{role} worker ({pool_capacity_tokens} tokens)")
    if policy == "fail":
        raise StartupError(role, "capacity audit", msg + " (--on-capacity-mismatch fail)")
    log.error("CAPACITY MISMATCH: %s; serving a clamped context of %d tokens "
              "(--on-capacity-mismatch clamp). Admission uses the live figure.",
              msg, pool_capacity_tokens)
    return pool_capacity_tokens, True
