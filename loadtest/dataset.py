"""A local ShareGPT-format dataset as the workload (`--dataset-name sharegpt --dataset-path
FILE`, as `vllm bench serve` spells it).

The file is a JSON list of records with `conversations` (or `conversation`): a list of
turns `{"from": "human" | "gpt" | ..., "value": text}`. As vLLM does, each record's first
turn is the prompt and its second the reference completion, whose token count is the
request's `max_tokens` (or `--sharegpt-output-len`); records whose prompt or completion
is under 4 tokens, whose prompt is over 1024 or whose prompt + completion is over 2048
tokens are skipped. Records are shuffled with the seed, then the first `--num-requests`
valid ones are used; tenants are assigned round-robin.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pdmesh.loadtest.tokens import TokenCounter
from pdmesh.loadtest.workload import RequestSpec

MIN_TOKENS, MAX_PROMPT_TOKENS, MAX_TOTAL_TOKENS = 4, 1024, 2048


def load_pairs(path: Path, seed: int) -> list[tuple[str, str]]:
    """(prompt, completion) of every record with two text turns, shuffled with `seed`."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset {path}: expected a JSON list of conversations")
    pairs = []
    for record in data:
        turns = record.get("conversations", record.get("conversation")) if isinstance(
            record, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if all(isinstance(t, str) and t for t in texts):
            pairs.append((texts[0], texts[1]))
    random.Random(seed).shuffle(pairs)
    return pairs


async def sharegpt_requests(path: Path, num_requests: int, seed: int, num_tenants: int,
                            counter: TokenCounter, output_len: int | None = None,
                            context_length: int | None = None) -> list[RequestSpec]:
    pairs = load_pairs(path, seed)
    requests: list[RequestSpec] = []
    batch = max(64, num_requests)
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        counts = await counter.count([t for pair in chunk for t in pair])
        for k, (prompt, _completion) in enumerate(chunk):
            prompt_len, completion_len = counts[2 * k], counts[2 * k + 1]
            max_tokens = output_len or completion_len
            if prompt_len < MIN_TOKENS or (output_len is None and completion_len < MIN_TOKENS):
                continue
            if prompt_len > MAX_PROMPT_TOKENS or prompt_len + max_tokens > MAX_TOTAL_TOKENS:
                continue
            if context_length is not None and prompt_len + max_tokens > context_length:
                continue
            i = len(requests)
            requests.append(RequestSpec(i, i % num_tenants, prompt, max_tokens,
                                        num_tokens=prompt_len, seed=seed, fixed_text=True))
            if len(requests) == num_requests:
                return requests
    if not requests:
        raise ValueError(f"dataset {path}: no usable conversation")
    return requests
