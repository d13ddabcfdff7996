"""Text and token ids: the tokenizer's work off the event loop (`TokenizerPool`), and
incremental detokenization with stop strings for streaming and non-streaming replies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdmesh.gateway.schema import RETRY_AFTER_S, ApiError
from pdmesh.services.engine.tokenizer import HFTokenizer, Tokenizer

T = TypeVar("T")
TOKENIZER_THREADS = 4  # threads that tokenize and detokenize for the whole gateway
TENANT_THREADS = 2  # the most of them one tenant's work occupies at a time
TENANT_QUEUED_BODIES = 2  # a tenant's work queued or running: this many bodies' worth


@dataclass
class _TenantLoad:
    threads: asyncio.Semaphore
    queued: int = 0  # characters (or token ids) of this tenant's jobs not yet done


class TokenizerPool:
    """Tokenization, the chat template and detokenization, run in a bounded thread pool so
    the event loop (every stream, every NATS callback) never waits for one prompt.

    HF `tokenizers` releases the GIL in its batch calls, so a 4 MiB prompt tokenizing in a
    thread costs the loop only the conversion of its ids to a Python list (~50 ms). Each tenant's
    jobs run at most `TENANT_THREADS` at a time (the rest wait on the loop, holding no
    thread), and a tenant may have at most `budget` characters (token ids, to detokenize)
    queued or running: past that its job is refused with 429 `tokenizer_busy` (a job alone
    is always taken, whatever its size). A job whose client went away still holds its
    share until its thread is done with it.
    """

    def __init__(self, tokenizer: Tokenizer, budget: int,
                 threads: int = TOKENIZER_THREADS, tenant_threads: int = TENANT_THREADS) -> None:
        self.tokenizer = tokenizer
        self.budget = budget
        self.tenant_threads = tenant_threads
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="pdmesh-tokenizer")
        self._loads: dict[str, _TenantLoad] = {}
        if isinstance(tokenizer, HFTokenizer):
            # The batch calls release the GIL; encode()/decode() of one text hold it. The
            # fast batch skips the offsets: the same ids, and dropping its result (done with
            # the GIL held) takes milliseconds instead of ~0.4 s for a 4 MiB prompt.
            core = tokenizer.core
            batch = getattr(core, "encode_batch_fast", core.encode_batch)
            self._encode: Callable[[str], list[int]] = lambda text: batch(
                [text], add_special_tokens=False)[0].ids
            self._decode: Callable[[list[int]], str] = lambda ids: core.decode_batch(
                [ids], skip_special_tokens=True)[0]
        else:
            self._encode, self._decode = tokenizer.encode, tokenizer.decode

    async def encode(self, tenant_id: str, text: str) -> list[int]:
        return await self.run(tenant_id, len(text), self._encode, text)

    async def decode(self, tenant_id: str, ids: list[int]) -> str:
        return await self.run(tenant_id, len(ids), self._decode, ids)

    async def chat(self, tenant_id: str, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat template (raises ChatTemplateError), then the rendered text's ids."""
        size = sum(len(msg["content"]) for msg in messages) + len(str(tools or ""))
        return await self.run(tenant_id, size, lambda: self._encode(
            self.tokenizer.apply_chat_template(messages, tools=tools) if tools
            else self.tokenizer.apply_chat_template(messages)))

    async def run(self, tenant_id: str, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a tokenizer thread, counted against the tenant's share."""
        load = self._loads.get(tenant_id)
        if load is None:
            load = self._loads[tenant_id] = _TenantLoad(asyncio.Semaphore(self.tenant_threads))
        if load.queued and load.queued + size > self.budget:  # guard: tokenizer-budget
            raise ApiError(429, f"too much tokenization in flight for this API key "
                           f"({load.queued} characters queued, at most {self.budget}); "
                           "retry once your earlier requests have been tokenized",
                           type_="rate_limit_error", code="tokenizer_busy",
                           retry_after_s=RETRY_AFTER_S)
        load.queued += size
        try:
            await load.threads.acquire()  # guard: tokenizer-tenant-threads
        except BaseException:
            load.queued -= size
            raise
        loop = asyncio.get_running_loop()

        def done() -> None:
            load.queued -= size
            load.threads.release()

        def done_in_thread(_future: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(done)

        try:
            future = self._executor.submit(fn, *args)  # guard: tokenizer-off-loop
        except BaseException:
            done()
            raise
        future.add_done_callback(done_in_thread)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        """Drop queued jobs; a running one ends in its thread (nothing waits for it)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class TextStream:
    """Turns generated token ids into text deltas; finds stop strings across deltas.

    Linear in the output length: each push decodes only a short window of ids, the tokens
    since the last clean delta plus the chunk before them as context (vLLM's
    prefix/read-offset scheme: tokenizers merge bytes and spaces across tokens, so a
    token's text depends on its left neighbour). A window whose text ends in U+FFFD (an
    incomplete UTF-8 sequence) waits for more ids. Text that could still become the start
    of a stop string (the last `max(len(stop)) - 1` characters) is held back, so a client
    never sees part of a stop string; hence a stop string can only begin in held-back text
    and only that is searched.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._tok = tokenizer
        self._eos = set(tokenizer.eos_token_ids)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self._prefix = 0  # window start: context ids already shown
        self._read = 0  # ids up to here are shown (as text, or pending below)
        self._pending = ""  # decoded but not yet shown (stop-string hold-back)
        self.emitted_chars = 0
        self.stopped = False
        self.stop_string: str | None = None

    def push(self, token_ids: list[int], final: bool, check_stops: bool = True) -> str:
        """Add tokens; return the text that may be shown now. Sets `stopped` on a stop hit
        (only searched when `check_stops`: vLLM ignores stop strings before min_tokens)."""
        self.ids.extend(t for t in token_ids if t not in self._eos)
        self._pending += self._decode_new(final)
        if check_stops and self._stops:
            hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) != -1]
            if hits:
                cut, self.stop_string = min(hits)
                self._pending = self._pending[:cut]
                self.stopped = final = True
        keep = 0 if final else self._hold if self._stops else 0
        shown = self._pending[: max(len(self._pending) - keep, 0)]
        self._pending = self._pending[len(shown):]
        self.emitted_chars += len(shown)
        return shown

    def _decode_new(self, final: bool) -> str:
        before = self._tok.decode(self.ids[self._prefix:self._read])
        after = self._tok.decode(self.ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            # Shown text is never rewritten: what lies beyond the context's length is new.
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""
