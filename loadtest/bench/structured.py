"""`pdmesh bench structured`: what a structured output's grammar mask costs.

In one run, with the model's own vocabulary and a real grammar engine state (a JSON schema
followed token by token: each constrained token is sampled under the mask from the model's
logits, and a new reply starts when one completes):
* `mask_us_median` / `mask_us_p99`: computing one token's mask (grammar.Constraint.allowed)
  and applying it to the logits (`Sampler.constrain`), per token, nothing else running;
  `mask_us_in_step_median` the same while the engine thread runs a step beside it (the
  two share the interpreter: slower, but off the batch's path, as the ratio below shows);
* `step_ms_unconstrained_b<N>`: a decode step of N requests (the engine's batched step,
  then each request's sampling, as the decode loop does), none constrained;
* `step_ms_one_constrained_b<N>`: the same with one of the N constrained, its mask computed
  while the engine thread runs the step (Sampler.prepare, as the decode loop does);
* `step_ratio_one_constrained`: the second over the first (target <= 1.02: a mask must not
  slow the requests it is batched with).
The two step kinds take turns, so load on the machine hits both alike. Bounded: `--steps`
steps of each kind. With --json the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time

import numpy as np
import torch

from pdmesh.kvstore.spec import pages_for
from pdmesh.loadtest.bench import print_report
from pdmesh.services.engine.grammar import Grammars
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.runner import DecodeSlot, Engine, make_pool
from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.protocol import messages as m

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string",
                                                            "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdmesh bench structured")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40, help="steps of each kind")
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--mask-tokens", type=int, default=500,
                        help="tokens of the mask-alone measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.batch < 2 or args.steps < 2:
        parser.error("--batch >= 2, --steps >= 2")
    load_start = os.getloadavg()[0]
    model = load_model(args.model)
    vocab = model.config.vocab_size
    grammars = Grammars(model.tokenizer, vocab)
    structured = m.Structured(kind="json", spec=json.dumps(SCHEMA))
    grammars.check(structured)  # builds the grammar engine's vocabulary: not timed
    rng = np.random.default_rng(0)
    ctx, steps, batch = args.context_len, args.steps, args.batch
    need = ctx + 2 * steps + 8
    pool = make_pool(model, num_pages=pages_for(need, 16) * (batch + 1), page_tokens=16)
    engine = Engine(model, pool)
    leases = []
    for i in range(batch):
        lease = pool.allocate(f"bench-{i}", need)
        engine.prefill(lease, rng.integers(0, min(vocab, 256), ctx).tolist())
        leases.append(lease)
    position = [ctx]
    eos = model.tokenizer.eos_token_ids
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=1 << 20)
    free = [Sampler(params, eos) for _ in range(batch)]
    constrained = [Sampler(params, eos, grammars.constraint(structured))]
    engine_thread = concurrent.futures.ThreadPoolExecutor(1)
    mask_s: list[float] = []

    def step(samplers: list[Sampler]) -> float:
        slots = [DecodeSlot(lease, 1, position[0]) for lease in leases]
        started = time.perf_counter()
        fut = engine_thread.submit(engine.decode_step, slots)
        for s in samplers:  # what the decode loop does while the step runs
            t0 = time.perf_counter()
            s.prepare()
            if s.constraint is not None:
                mask_s.append(time.perf_counter() - t0)
        logits = fut.result()
        for i, s in enumerate(samplers):
            t0 = time.perf_counter()
            token = s.sample(logits[i])
            if s.constraint is not None:
                mask_s[-1] += time.perf_counter() - t0  # the masking inside sample()
                if s.accept(token) or s.constraint.complete:  # a reply done: a new one
                    constrained[0] = Sampler(params, eos, grammars.constraint(structured))
        took = time.perf_counter() - started
        position[0] += 1
        return took

    plain_s, mixed_s = [], []
    step(free)  # warm-up
    for i in range(steps):  # the two kinds take turns at going first
        for with_grammar, out in ((False, plain_s), (True, mixed_s))[::1 - 2 * (i % 2)]:
            out.append(step([constrained[0], *free[1:]] if with_grammar else free))
    for lease in leases:
        pool.release(lease, "bench")
    engine_thread.shutdown()
    # The mask alone, nothing running beside it: replies through the schema, token by token,
    # sampled under the mask from logits of the model's shape.
    alone_s: list[float] = []
    logits = torch.from_numpy(rng.standard_normal(vocab).astype(np.float32))
    sampler = Sampler(params, eos, grammars.constraint(structured))
    for _ in range(args.mask_tokens):
        t0 = time.perf_counter()
        masked = sampler.constrain(logits)
        alone_s.append(time.perf_counter() - t0)
        token = int(torch.argmax(masked))
        if sampler.accept(token) or sampler.constraint.complete:  # (accept advances it)
            sampler = Sampler(params, eos, grammars.constraint(structured))
    plain, mixed_ms = float(np.median(plain_s)) * 1e3, float(np.median(mixed_s)) * 1e3
    report = {"model": args.model, "vocab_size": vocab, "batch": batch, "steps": steps,
              "mask_us_median": float(np.median(alone_s)) * 1e6,
              "mask_us_p99": float(np.percentile(alone_s, 99)) * 1e6,
              "mask_us_in_step_median": float(np.median(mask_s)) * 1e6,
              f"step_ms_unconstrained_b{batch}": plain,
              f"step_ms_one_constrained_b{batch}": mixed_ms,
              "step_ratio_one_constrained": mixed_ms / plain if plain > 0 else None,
              "target_step_ratio_one_constrained": 1.02,
              "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0]}
    print_report(report, args.json, 3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
