"""Integrity oracle: every loaded reply must equal the reply to the same prompt run alone.

"It returned 200" is not a test (docs/INCIDENT.md, lesson 5). With greedy decoding
(temperature 0) a prompt has exactly one correct output; each distinct prompt is sent
alone, one at a time, before (or after) the load, and every successful loaded reply for it
is compared with that reference, character for character.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence

from pdmesh.loadtest.client import RequestResult
from pdmesh.loadtest.workload import RequestSpec

PromptKey = tuple[str, int]  # (prompt, max_tokens)


def prompt_key(req: RequestSpec) -> PromptKey:
    return (req.prompt, req.max_tokens)


async def run_references(requests: Sequence[RequestSpec],
                         send: Callable[[RequestSpec], Awaitable[RequestResult]],
                         stop: asyncio.Event,
                         on_done: Callable[[RequestResult], None] | None = None,
                         ) -> dict[PromptKey, RequestResult]:
    """Send each distinct valid prompt alone, sequentially; stop early on the stop event."""
    references: dict[PromptKey, RequestResult] = {}
    for req in requests:
        key = prompt_key(req)
        if req.expect_reject or key in references:
            continue
        if stop.is_set():
            break
        references[key] = result = await send(req)
        if on_done is not None:
            on_done(result)
    return references


def first_difference(a: str, b: str) -> int:
    """Index of the first character where `a` and `b` differ (the shorter length if one is
    a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def prompt_fingerprint(prompt: str) -> dict:
    """What a mismatch record keeps of a prompt: its hash and its first characters."""
    return {"prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
            "prompt_head": prompt[:80]}


def check_integrity(requests: Sequence[RequestSpec], results: Sequence[RequestResult],
                    references: dict[PromptKey, RequestResult]) -> tuple[dict, list[dict]]:
    """Compare loaded replies with their references: (summary counts, mismatch records)."""
    by_index = {req.index: req for req in requests}
    summary = {"integrity_checked": 0, "integrity_mismatches": 0, "integrity_unchecked": 0,
               "integrity_reference_failures": sum(not r.success for r in references.values())}
    mismatches: list[dict] = []
    for result in results:
        req = by_index.get(result.index)
        if req is None or result.warmup or req.expect_reject or not result.success:
            continue
        reference = references.get(prompt_key(req))
        if reference is None or not reference.success:
            summary["integrity_unchecked"] += 1
            continue
        summary["integrity_checked"] += 1
        if result.generated_text != reference.generated_text:
            summary["integrity_mismatches"] += 1
            mismatches.append({
                "index": req.index,
                "tenant": req.tenant,
                "prompt_len": req.prompt_len,
                "max_tokens": req.max_tokens,
                **prompt_fingerprint(req.prompt),
                "first_difference_at": first_difference(result.generated_text,
                                                        reference.generated_text),
                "expected_text": reference.generated_text,
                "loaded_text": result.generated_text,
                "expected_output_tokens": reference.output_tokens,
                "loaded_output_tokens": result.output_tokens,
            })
    return summary, mismatches
