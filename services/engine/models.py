"""`load_model(spec)`: "tiny", "smollm2", a .gguf path, or a safetensors checkpoint dir.

Which model a spec names (and its tokenizer alone, for the gateway) is `checkpoint`'s job,
without torch; this module adds the weights.
"""

from __future__ import annotations

from pdmesh.services.engine.checkpoint import resolve
from pdmesh.services.engine.gguf_loader import load_gguf
from pdmesh.services.engine.model import LoadedModel
from pdmesh.services.engine.safetensors_loader import load_safetensors
from pdmesh.services.engine.tiny import TINY_CONFIG, tiny_weights
from pdmesh.services.engine.tokenizer import ByteTokenizer

__all__ = ["LoadedModel", "load_model"]


def load_model(spec: str) -> LoadedModel:
    """Config, weights and tokenizer of the model `spec` names (see `checkpoint.resolve`).
    Raises ConfigError for a spec that names nothing."""
    source = resolve(spec)
    if source.kind == "tiny":
        return LoadedModel(TINY_CONFIG, tiny_weights(), ByteTokenizer(), source.name)
    assert source.path is not None
    model = load_gguf(source.path) if source.kind == "gguf" else load_safetensors(source.path)
    model.name = source.name
    return model
