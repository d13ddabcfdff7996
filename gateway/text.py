"""Incremental detokenization with stop strings, for streaming and non-streaming replies."""

from __future__ import annotations

from pdmesh.services.engine.tokenizer import Tokenizer


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
