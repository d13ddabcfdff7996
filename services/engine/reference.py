"""Single-process reference engine: the oracle for every isolation test (I4).

It shares the model math and the fixed-shape schedules (prefill windows, decode tiles) with
the paged Engine but keeps K/V in a plain contiguous per-request cache: no pool, no leases,
no pages. Paged, disaggregated output must equal its output token for token.
"""

from __future__ import annotations

import torch

from pdmesh.services.engine.model import ContiguousKV, LlamaModel, LoadedModel, prefill_windows
from pdmesh.services.engine.sampling import Sampler, SamplingParams


class ReferenceEngine:
    def __init__(self, model: LoadedModel, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        self.loaded = model
        self.config = model.config
        self.model = LlamaModel(model.config, model.weights, device=device, dtype=dtype)

    def new_cache(self, max_tokens: int) -> ContiguousKV:
        return ContiguousKV(self.config, max_tokens, self.model.device, self.model.dtype)

    @torch.inference_mode()
    def prefill(self, cache: ContiguousKV, token_ids: list[int]) -> torch.Tensor:
        hidden = None
        for start, length in prefill_windows(0, len(token_ids)):
            hidden = self.model.prefill_chunk(cache, token_ids[start:start + length], start)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: list[int], k: int
                        ) -> list[tuple[float, list[tuple[int, float]]]]:
        """The logprob (and top `k`) of each prompt token after the first, given the tokens
        before it: what prefill reports for `Sampling.prompt_logprobs`."""
        cache = self.new_cache(len(token_ids))
        out: list[tuple[float, list[tuple[int, float]]]] = []
        for start, length in prefill_windows(0, len(token_ids)):
            hidden = self.model.prefill_chunk(cache, token_ids[start:start + length], start,
                                              all_rows=True)
            out += self.model.row_logprobs(hidden, token_ids[start + 1:start + length + 1], k)
        return out

    @torch.inference_mode()
    def decode(self, caches: list[ContiguousKV], token_ids: list[int],
               positions: list[int]) -> torch.Tensor:
        """One contiguous-cache decode step (at most DECODE_TILE requests)."""
        return self.model.decode_tile(caches, token_ids, positions)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """Generated tokens (not the prompt). Stops after max_tokens or at an eos token,
        which is included as the last token."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        total = len(prompt_ids) + params.max_tokens
        if total > self.config.max_context:
            raise ValueError(f"prompt + max_tokens = {total} > max_context "
                             f"{self.config.max_context}")
        eos = self.loaded.tokenizer.eos_token_ids
        sampler = Sampler(params)
        cache = self.new_cache(total)
        token = sampler.sample(self.prefill(cache, list(prompt_ids)))
        out = [token]
        position = len(prompt_ids)
        while len(out) < params.max_tokens and token not in eos:
            token = sampler.sample(self.decode([cache], [token], [position])[0])
            out.append(token)
            position += 1
        return out
