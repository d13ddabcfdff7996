"""Structured-output constraints read byte by byte: the tiny model's vocabulary is its bytes
(`ByteTokenizer`), so a text is a token sequence and the mask a constraint gives is the one
the sampler applies."""

from __future__ import annotations

from pdmesh.services.engine.grammar import Constraint, Grammars
from pdmesh.services.engine.tokenizer import ByteTokenizer
from pdmesh.services.protocol import messages as m

BYTE_GRAMMARS = Grammars(ByteTokenizer())


def takes(c: Constraint | m.Structured, text: str) -> bool:
    """Whether the constraint (or a fresh one for a structured output, on BYTE_GRAMMARS)
    lets the whole of `text` be sampled and the output end there."""
    if isinstance(c, m.Structured):
        c = BYTE_GRAMMARS.constraint(c)
    for byte in text.encode():
        if not c.allowed()[byte]:
            return False
        c.advance(byte)
    return c.complete
