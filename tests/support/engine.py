"""Drive the paged Engine the way the services will: prefill, then continuous batching."""

from __future__ import annotations

import numpy as np

from pdmesh.kvstore import KVPool, Lease
from pdmesh.services.engine.runner import DecodeSlot, Engine
from pdmesh.services.engine.sampling import Sampler, SamplingParams


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=length).tolist()


def batched_generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams,
    leases: list[Lease] | None = None, first_tokens: list[int] | None = None,
) -> list[list[int]]:
    """Generate for all prompts at once; requests join the batch one by one and leave when
    done (continuous batching). With `leases` + `first_tokens`, the prompts are assumed
    already prefilled into those leases (disaggregated mode)."""
    pool: KVPool = engine.pool
    eos = engine.loaded.tokenizer.eos_token_ids
    samplers = [Sampler(params) for _ in prompts]
    if leases is None:
        leases = [pool.allocate(f"r{i}", len(p) + params.max_tokens) for i, p in enumerate(prompts)]
        first_tokens = None
    outputs: list[list[int]] = [[] for _ in prompts]
    active: list[int] = []
    pending = list(range(len(prompts)))
    while pending or active:
        if pending:  # admit one new request per step: batches of shifting composition
            i = pending.pop(0)
            if first_tokens is None:
                outputs[i].append(samplers[i].sample(engine.prefill(leases[i], prompts[i])))
            else:
                outputs[i].append(first_tokens[i])
            if outputs[i][-1] not in eos and params.max_tokens > 1:
                active.append(i)
        if not active:
            continue
        slots = [DecodeSlot(leases[i], outputs[i][-1], len(prompts[i]) + len(outputs[i]) - 1)
                 for i in active]
        logits = engine.decode_step(slots)
        for row, i in enumerate(list(active)):
            token = samplers[i].sample(logits[row])
            outputs[i].append(token)
            if token in eos or len(outputs[i]) >= params.max_tokens:
                active.remove(i)
    for lease in leases:
        pool.release(lease, "finished")
    return outputs
