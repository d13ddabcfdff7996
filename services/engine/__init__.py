"""Torch Llama engine over the paged KV pool, model loaders and the reference engine."""

from services.engine.config import ModelConfig
from services.engine.models import LoadedModel, load_model
from services.engine.reference import ReferenceEngine
from services.engine.runner import DecodeSlot, Engine, make_pool, pool_spec_for
from services.engine.sampling import Sampler, SamplingParams
from services.engine.tokenizer import Tokenizer

__all__ = [
    "DecodeSlot",
    "Engine",
    "LoadedModel",
    "ModelConfig",
    "ReferenceEngine",
    "Sampler",
    "SamplingParams",
    "Tokenizer",
    "load_model",
    "make_pool",
    "pool_spec_for",
]
