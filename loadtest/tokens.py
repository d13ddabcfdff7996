"""Prompt lengths counted with the served model's tokenizer.

`--tokenizer auto` (the default) asks the server's `/tokenize` (pdmesh and vLLM have it)
and falls back to one token per byte, saying so, when it has none; `--tokenizer bytes`
assumes one token per byte; any other value is a pdmesh model spec (`tiny`, `smollm2`, a
.gguf path, a checkpoint directory) whose tokenizer is loaded here, without torch.

`fit` then resizes each generated prompt until its count is the length the workload asked
for (valid prompts never above it, so prompt + max_tokens stays within the context;
over-long prompts strictly above the context), and records the count in the request.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import aiohttp

from pdmesh.loadtest.workload import RequestSpec, WorkloadSpec, max_valid_input_len, resize

FIT_ROUNDS = 8
TOKENIZE_CONCURRENCY = 16


class TokenCounter(Protocol):
    name: str

    async def count(self, texts: Sequence[str]) -> list[int]: ...


class ByteCounter:
    name = "bytes (1 token per byte, assumed)"

    async def count(self, texts: Sequence[str]) -> list[int]:
        return [len(t.encode()) for t in texts]


class LocalCounter:
    """A tokenizer in this process: a pdmesh model spec's (`load`, metadata only, no
    torch) or any object with `encode(text) -> ids`."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name

    @classmethod
    def load(cls, spec: str) -> LocalCounter:
        from pdmesh.services.engine.checkpoint import load_tokenizer

        tokenizer, model_name = load_tokenizer(spec)
        return cls(tokenizer, f"{model_name} (local tokenizer)")

    async def count(self, texts: Sequence[str]) -> list[int]:
        return [len(self.tokenizer.encode(t)) for t in texts]


class ServerCounter:
    """POST {root}/tokenize for each text (vLLM's and pdmesh's endpoint)."""

    def __init__(self, root: str, api_key: str | None, model: str) -> None:
        self.root = root.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.name = f"{model} (server /tokenize)"

    async def count(self, texts: Sequence[str]) -> list[int]:
        limit = asyncio.Semaphore(TOKENIZE_CONCURRENCY)
        async with aiohttp.ClientSession(headers=self.headers) as session:

            async def one(text: str) -> int:
                async with limit, session.post(
                        f"{self.root}/tokenize", json={"model": self.model, "prompt": text},
                        timeout=aiohttp.ClientTimeout(total=60)) as resp:
                    resp.raise_for_status()
                    body = await resp.json(content_type=None)
                    return int(body["count"])

            return list(await asyncio.gather(*(one(t) for t in texts)))


async def make_counter(choice: str, root: str, api_key: str | None,
                       model: str) -> TokenCounter:
    if choice == "bytes":
        return ByteCounter()
    if choice != "auto":
        return LocalCounter.load(choice)
    server = ServerCounter(root, api_key, model)
    try:
        await server.count(["hello"])
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
        print(f"loadtest: {root}/tokenize is not usable ({exc}); counting 1 token per byte "
              "(pass --tokenizer MODEL to count with a local tokenizer)", file=sys.stderr)
        return ByteCounter()
    return server


def _target(req: RequestSpec, spec: WorkloadSpec, wanted: int) -> tuple[int, int]:
    """(lowest, highest) acceptable token count of this request's prompt."""
    ctx = spec.context_length
    if req.expect_reject:
        assert ctx is not None
        return ctx + 1, max(wanted, ctx + 1)
    limit = max_valid_input_len(spec, req.max_tokens)
    high = wanted if limit is None else max(1, min(wanted, limit))
    return max(1, high - max(1, high // 50)), high  # within 2 % below the wanted length


async def fit(requests: list[RequestSpec], spec: WorkloadSpec, counter: TokenCounter,
              prefix: str) -> list[RequestSpec]:
    """The requests with prompts resized to their token lengths and `num_tokens` set.
    Dataset prompts (`fixed_text`) are counted only."""
    wanted = {r.index: len(r.prompt) for r in requests}  # built as 1 char per token
    current = list(requests)
    counts = await counter.count([r.prompt for r in current])
    for _ in range(FIT_ROUNDS):
        todo = []
        for i, (req, n) in enumerate(zip(current, counts, strict=True)):
            current[i] = replace(req, num_tokens=n)
            low, high = _target(req, spec, wanted[req.index])
            if not req.fixed_text and not low <= n <= high:
                chars = len(req.prompt)
                goal = (low + high) / 2
                scaled = max(1, round(chars * goal / max(n, 1)))
                if scaled == chars:
                    scaled = chars + (1 if n < low else -1)
                todo.append(i)
                current[i] = resize(req, scaled, prefix)
        if not todo:
            return current
        fresh = await counter.count([current[i].prompt for i in todo])
        for i, n in zip(todo, fresh, strict=True):
            counts[i] = n
    for req, n in zip(current, counts, strict=True):
        low, high = _target(req, spec, wanted[req.index])
        if not req.fixed_text and not low <= n <= high and (
                req.expect_reject or n > high):
            raise ValueError(f"request {req.index}: could not size its prompt to "
                             f"{low}..{high} tokens (got {n})")
    return [replace(r, num_tokens=n) for r, n in zip(current, counts, strict=True)]
