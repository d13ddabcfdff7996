"""Incremental detokenization with stop strings, for streaming and non-streaming replies."""

from __future__ import annotations

from pdmesh.services.engine.tokenizer import Tokenizer


class TextStream:
    """Turns generated token ids into text deltas; finds stop strings across deltas.

    Text is re-decoded from all ids each time (tokenizers merge bytes across tokens), a
    trailing U+FFFD (an incomplete UTF-8 sequence) is held back, and so is any tail that
    could still become a stop string, so a client never sees part of a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self._tok = tokenizer
        self._eos = set(tokenizer.eos_token_ids)
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def push(self, token_ids: list[int], final: bool) -> str:
        """Add tokens; return the text that may be shown now. Sets `stopped` on a stop hit."""
        self.ids.extend(t for t in token_ids if t not in self._eos)
        text = self._tok.decode(self.ids)
        for stop in self._stops:
            idx = text.find(stop, max(len(self.emitted) - len(stop), 0))
            if idx != -1:
                text = text[:idx]
                self.stopped = True
                final = True
        if not final:
            if text.endswith("\ufffd"):
                text = text[:-1]
            if self._stops and self._hold:
                text = text[: max(len(text) - self._hold, len(self.emitted))]
        if len(text) < len(self.emitted) or not text.startswith(self.emitted):
            # A re-decode changed earlier text (rare merges): only ever append.
            return ""
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta
