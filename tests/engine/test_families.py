"""Each served family computes what transformers computes, from the same files.

Small random-weight checkpoints (tests/support/families.py: 2 layers, dim 256, 4 query and
2 KV heads of 64, a byte-level BPE of about 600 tokens) are written as a transformers directory and
as a llama.cpp GGUF. The engine's logits at every position of a 520-token prompt (across
pages and the 512-token prefill chunk boundary) and of 160 greedy decode steps after it, on
both decode paths, are compared with transformers' forward over the same tokens: the
largest difference, and transformers' own greedy choice at every decode step.

transformers' GGUF loader reads neither `rope_freqs.weight` nor a llama-architecture
sliding window, so a Llama 3.1 or Mistral GGUF is compared with transformers on the
safetensors twin (the same weights); a Qwen2 GGUF with transformers on the GGUF itself.
"""

from __future__ import annotations

import pytest
import torch

from pdmesh.services.engine import native
from pdmesh.services.engine.checkpoint import load_gguf_tokenizer
from pdmesh.services.engine.model import ContiguousKV, LlamaModel, prefill_windows
from pdmesh.services.engine.models import load_model
from tests.support.families import (
    CORPUS,
    FAMILIES,
    LLAMA3,
    QWEN2,
    Family,
    hf_weights,
    train_tokenizer,
    write_gguf,
    write_safetensors,
)

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 520  # pages of 16, and the chunk boundary at 512
DECODE_STEPS = 160
MAX_LOGIT_DIFF = 1e-3  # fp32, 2 layers: ~1e-5 here; a wrong detail is ~1 or more
NEAR_TIE = 1e-3  # a greedy step whose top two logits are closer than this may differ


class Checkpoints:
    def __init__(self, family: Family, root) -> None:
        self.family = family
        self.tokenizer = train_tokenizer(family)
        weights = hf_weights(family, self.tokenizer.get_vocab_size())
        self.directory = write_safetensors(root / family.name, family, self.tokenizer,
                                           weights)
        self.gguf = write_gguf(root / f"{family.name}.gguf", family, self.tokenizer, weights)
        self._hf: dict[str, torch.nn.Module] = {}

    def hf_model(self, source: str) -> torch.nn.Module:
        """transformers' model from the directory ("safetensors") or the GGUF."""
        if source not in self._hf:
            kwargs = {"gguf_file": self.gguf.name} if source == "gguf" else {}
            self._hf[source] = transformers.AutoModelForCausalLM.from_pretrained(
                str(self.gguf.parent if source == "gguf" else self.directory),
                dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
        return self._hf[source]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoints]:
    root = tmp_path_factory.mktemp("families")
    return {f.name: Checkpoints(f, root) for f in FAMILIES}


def engine_run(spec: str, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits [len(prompt) + steps, vocab] at every position the engine computes (the
    prompt in PREFILL_CHUNK windows, then greedy decode steps) and the greedy tokens."""
    loaded = load_model(spec)
    model = LlamaModel(loaded.config, loaded.weights)
    kv = ContiguousKV(loaded.config, len(prompt) + steps, torch.device("cpu"))
    rows = [model.logits(model.prefill_chunk(kv, prompt[start:start + n], start,
                                             all_rows=True))
            for start, n in prefill_windows(0, len(prompt))]
    tokens: list[int] = []
    for step in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        rows.append(model.decode_tile([kv], tokens[-1:], [len(prompt) + step]))
    return torch.cat(rows), tokens


def compare(checkpoints: Checkpoints, spec: str, hf_source: str, path: str,
            monkeypatch) -> tuple[float, int, int]:
    """(max abs logit difference, greedy steps agreeing, steps compared)."""
    if path == "torch":
        monkeypatch.setattr(native, "usable", lambda device, dtype: False)
    elif native.setting() == "off":
        pytest.skip("PDMESH_NATIVE_KERNELS=off")
    else:
        assert native.available(), "the native decode kernels did not build here"
    vocab = checkpoints.tokenizer.get_vocab_size()
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    ours, tokens = engine_run(spec, prompt.tolist(), DECODE_STEPS)
    sequence = torch.cat((prompt, torch.tensor(tokens)))[None]
    with torch.no_grad():
        theirs = checkpoints.hf_model(hf_source)(sequence).logits[0]
    diff = float((ours - theirs).abs().max())
    top2 = theirs[PROMPT_LEN - 1:-1].topk(2, dim=-1)  # the logits each token was chosen by
    agree = [int(t) == int(top2.indices[i, 0])
             or float(top2.values[i, 0] - top2.values[i, 1]) < NEAR_TIE
             for i, t in enumerate(tokens)]
    return diff, sum(agree), len(agree)


# (family, checkpoint the engine loads, the one transformers loads, decode path). The
# loaders do not depend on the decode path: the torch path runs on one format per family.
CASES = [(f, source, hf, path) for f in FAMILIES
         for source, hf in (("safetensors", "safetensors"),
                            ("gguf", "gguf" if f is QWEN2 else "safetensors"))
         for path in (("native", "torch") if source == "safetensors" else ("native",))]


@pytest.mark.parametrize(("family", "source", "hf_source", "path"), CASES,
                         ids=[f"{f.name}-{s}-{p}" for f, s, _, p in CASES])
def test_logits_and_greedy_tokens_equal_transformers(checkpoints, family, source, hf_source,
                                                      path, monkeypatch) -> None:
    ckpt = checkpoints[family.name]
    spec = str(ckpt.gguf if source == "gguf" else ckpt.directory)
    diff, agree, steps = compare(ckpt, spec, hf_source, path, monkeypatch)
    print(f"{family.name} {source} {path}: max |logit diff| {diff:.2e}, greedy {agree}/{steps}")
    assert diff < MAX_LOGIT_DIFF
    assert agree == steps


@pytest.mark.parametrize("family", [LLAMA3, QWEN2], ids=lambda f: f.pre)
def test_gguf_tokenizer_equals_transformers(checkpoints, family) -> None:
    """pdmesh's tokenizer from the GGUF and transformers' own, on a multilingual, code and
    digits corpus and on text the vocabulary was not trained on."""
    ckpt = checkpoints[family.name]
    ours = load_gguf_tokenizer(ckpt.gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(str(ckpt.gguf.parent),
                                                        gguf_file=ckpt.gguf.name)
    texts = [*CORPUS, "\n".join(CORPUS), "x = 123456789012 + 0.5e-10  # 42 apples\n",
             "They'RE here; we'LL see... 'tis 1,000,000 — ok?", "   \n\t\n  ",
             "<|im_end|> plain text " + family.specials[1] + " after"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "user", "content": "Hi 123"}, {"role": "assistant", "content": "Yo"},
                {"role": "user", "content": "Count to 3"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
