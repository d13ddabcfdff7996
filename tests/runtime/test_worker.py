"""A worker refuses to serve a context longer than its model's positions: advertising it
would admit prompts the engine then fails after admission (a 502, not a 400)."""

from __future__ import annotations

import pytest

from pdmesh.services.decode.service import DecodeService
from pdmesh.services.engine.tiny import TINY_CONFIG
from pdmesh.services.runtime.config import resolve


def test_a_context_past_the_models_positions_is_refused_at_start() -> None:
    over = TINY_CONFIG.max_context + 1
    cfg = resolve("decode", {}, {"PDMESH_WORKER_ID": "decode-c", "PDMESH_KV_TOKENS": "1024",
                                 "PDMESH_MAX_CONTEXT": str(over)})
    with pytest.raises(ValueError, match=f"--max-context {over} exceeds the "
                                         f"{TINY_CONFIG.max_context} positions"):
        DecodeService(cfg)
