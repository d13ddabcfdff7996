"""Small random-weight checkpoints of each served family, written as real files.

`Family` says what one checkpoint has (architecture, pre-tokenizer, biases, RoPE scaling,
sliding window); `hf_weights` draws its weights under transformers' names, and
`write_safetensors` / `write_gguf` write them as a transformers checkpoint directory and as
a llama.cpp GGUF (through the `gguf` package's own writer, q/k permuted as llama.cpp's
converter does). Both carry a byte-level BPE vocabulary trained here on a small corpus with
the family's own pre-split regex, and the family's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from pdmesh.services.engine.checkpoint import LLAMA3_SPLIT, QWEN2_SPLIT

CORPUS = [
    "The quick brown fox jumps over the lazy dog. I'm sure they'll say we've DONE it.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n",
    "for (int i = 0; i < 1024; i++) { total += values[i] * 3.14159; }",
    "Prices: 1234567 apples, 89 pears, 2026-12-03 at 15:15, pi ~ 3.1415926535.",
    "Grüße aus München! Ça coûte 12,50 €. ¿Dónde está la biblioteca?",
    "Привет, как дела? Всё хорошо, спасибо. 今天天气很好，我们去公园吧。",
    "東京は晴れです。 مرحبا بالعالم 안녕하세요 세계 🙂🚀 naïve café résumé",
    "  indented\tline\r\nwindows line\n\n\nthree newlines   trailing spaces   ",
]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>"
    "{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}")


@dataclass(frozen=True)
class Family:
    name: str
    gguf_arch: str  # general.architecture
    model_type: str  # config.json
    pre: str  # tokenizer.ggml.pre
    specials: tuple[str, ...]  # bos, eos, then others
    template: str
    qkv_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # config.json rope_scaling
    sliding_window: int | None = None
    geometry: dict = field(default_factory=lambda: dict(
        dim=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, context=2048))

    @property
    def split(self) -> str:
        return QWEN2_SPLIT if self.pre == "qwen2" else LLAMA3_SPLIT


LLAMA3 = Family("llama3", "llama", "llama", "llama-bpe",
                ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"),
                LLAMA3_TEMPLATE, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
QWEN2 = Family("qwen2", "qwen2", "qwen2", "qwen2",
               ("<|endoftext|>", "<|im_end|>", "<|im_start|>"), QWEN2_TEMPLATE,
               qkv_bias=True, rope_theta=1000000.0)
MISTRAL = Family("mistral", "llama", "mistral", "llama-bpe", ("<s>", "</s>"),
                 MISTRAL_TEMPLATE, sliding_window=48)
FAMILIES = (LLAMA3, QWEN2, MISTRAL)


def train_tokenizer(family: Family, vocab_size: int = 700) -> Tokenizer:
    """A byte-level BPE trained on CORPUS, split by the family's regex; its special tokens
    come first (ids 0..)."""
    tok = Tokenizer(models.BPE(fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(family.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def vocab_and_merges(tok: Tokenizer) -> tuple[list[str], list[str]]:
    state = json.loads(tok.to_str())["model"]
    vocab = sorted(state["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["merges"]]
    return [t for t, _ in vocab], merges


def hf_weights(family: Family, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under transformers' names: std 1/sqrt(in) matmuls, norms near 1,
    biases of std 0.5 and an lm_head wide enough that greedy tokens are clear."""
    g = family.geometry
    gen = torch.Generator().manual_seed(seed)
    dim, hd = g["dim"], g["head_dim"]
    q_dim, kv_dim = g["heads"] * hd, g["kv_heads"] * hd

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {"model.embed_tokens.weight": normal(vocab, dim, std=1.0),
         "model.norm.weight": 1 + normal(dim, std=0.1),
         "lm_head.weight": normal(vocab, dim, std=3 * dim ** -0.5)}
    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + normal(dim, std=0.1),
              p + "post_attention_layernorm.weight": 1 + normal(dim, std=0.1),
              p + "self_attn.q_proj.weight": normal(q_dim, dim, std=2 * dim ** -0.5),
              p + "self_attn.k_proj.weight": normal(kv_dim, dim, std=2 * dim ** -0.5),
              p + "self_attn.v_proj.weight": normal(kv_dim, dim, std=dim ** -0.5),
              p + "self_attn.o_proj.weight": normal(dim, q_dim, std=q_dim ** -0.5),
              p + "mlp.gate_proj.weight": normal(g["ffn"], dim, std=dim ** -0.5),
              p + "mlp.up_proj.weight": normal(g["ffn"], dim, std=dim ** -0.5),
              p + "mlp.down_proj.weight": normal(dim, g["ffn"], std=g["ffn"] ** -0.5)}
        if family.qkv_bias:
            w |= {p + "self_attn.q_proj.bias": normal(q_dim, std=0.5),
                  p + "self_attn.k_proj.bias": normal(kv_dim, std=0.5),
                  p + "self_attn.v_proj.bias": normal(kv_dim, std=0.5)}
    return w


def hf_config(family: Family, vocab: int) -> dict:
    g = family.geometry
    config = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "mistral": "MistralForCausalLM"}[family.model_type]],
        "model_type": family.model_type, "vocab_size": vocab, "hidden_size": g["dim"],
        "intermediate_size": g["ffn"], "num_hidden_layers": g["layers"],
        "num_attention_heads": g["heads"], "num_key_value_heads": g["kv_heads"],
        "head_dim": g["head_dim"], "max_position_embeddings": g["context"],
        "rms_norm_eps": 1e-5, "rope_theta": family.rope_theta, "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    if family.rope_scaling is not None:
        config["rope_scaling"] = family.rope_scaling
    if family.model_type == "mistral":
        config["sliding_window"] = family.sliding_window
    if family.model_type == "qwen2":
        config["use_sliding_window"] = False
    return config


def write_safetensors(directory: Path, family: Family, tok: Tokenizer,
                      weights: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    vocab = tok.get_vocab_size()
    (directory / "config.json").write_text(json.dumps(hf_config(family, vocab)))
    save_file({k: v.contiguous() for k, v in weights.items()},
              str(directory / "model.safetensors"))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": family.template, "bos_token": family.specials[0],
        "eos_token": family.specials[1], "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of attn_q / attn_k rows (rotate-half to
    interleaved pairs)."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path: Path, family: Family, tok: Tokenizer,
               weights: dict[str, torch.Tensor], rope_freqs: bool = True) -> Path:
    """The checkpoint as llama.cpp's converter writes it: q/k permuted for the llama
    architecture, Llama 3.1's scaling as a `rope_freqs.weight` tensor, Mistral's window as
    `<arch>.attention.sliding_window`."""
    from pdmesh.services.engine.families import llama3_freq_factors

    g, arch = family.geometry, family.gguf_arch
    tokens, merges = vocab_and_merges(tok)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(g["layers"])
    writer.add_context_length(g["context"])
    writer.add_embedding_length(g["dim"])
    writer.add_feed_forward_length(g["ffn"])
    writer.add_head_count(g["heads"])
    writer.add_head_count_kv(g["kv_heads"])
    writer.add_key_length(g["head_dim"])
    writer.add_value_length(g["head_dim"])
    writer.add_rope_dimension_count(g["head_dim"])
    writer.add_rope_freq_base(family.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    if family.sliding_window is not None:
        writer.add_sliding_window(family.sliding_window)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(family.pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in family.specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(family.template)
    permute = arch == "llama"
    heads = {"attn_q": g["heads"], "attn_k": g["kv_heads"]}
    out: dict[str, np.ndarray] = {
        "token_embd.weight": weights["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": weights["model.norm.weight"].numpy(),
        "output.weight": weights["lm_head.weight"].numpy()}
    for name, t in weights.items():
        if not name.startswith("model.layers."):
            continue
        _, _, i, rest = name.split(".", 3)
        for hf_name, gguf_name in GGUF_NAMES.items():
            if rest.startswith(hf_name):
                target = gguf_name + rest[len(hf_name):]
                array = t.numpy()
                if permute and gguf_name in heads:
                    array = llamacpp_permute(array, heads[gguf_name])
                out[f"blk.{i}.{target}"] = array
    if family.rope_scaling is not None and rope_freqs:
        s = family.rope_scaling
        factors = llama3_freq_factors(g["head_dim"], family.rope_theta, s["factor"],
                                      s["low_freq_factor"], s["high_freq_factor"],
                                      s["original_max_position_embeddings"])
        out["rope_freqs.weight"] = np.asarray(factors, dtype=np.float32)
    for name, array in out.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
