"""Incremental detokenization (gateway/text.py): the streamed deltas add up to the whole
decode, stop strings are cut and never shown in part, and the work is linear in the
output (a byte-level BPE trained here stands for a checkpoint's tokenizer)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdmesh.gateway.text import TextStream
from pdmesh.services.engine.tokenizer import ByteTokenizer, HFTokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog. ", "Grüße aus Köln — 東京 🚀! ",
          "stop here STOP and continue ", "def f(x):\n    return x * 2\n"]


class Counting:
    """A tokenizer that counts how many ids it was asked to decode."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded_ids = 0
        self.eos_token_ids = inner.eos_token_ids

    def decode(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        self.decoded_ids += len(ids)
        return self.inner.decode(ids)


@pytest.fixture(scope="module")
def hf() -> HFTokenizer:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["</s>"]))
    return HFTokenizer(core, eos_token_ids=[core.token_to_id("</s>")])


def stream(tok, ids: list[int], stops: list[str], step: int = 1) -> tuple[str, TextStream]:
    text = TextStream(tok, stops)
    out = []
    for i in range(0, len(ids), step):
        final = i + step >= len(ids)
        out.append(text.push(ids[i:i + step], final=final))
        if text.stopped:
            break
    return "".join(out), text


@pytest.mark.parametrize("which", ["bytes", "bpe"])
@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_whole_decode(hf: HFTokenizer, which: str, step: int) -> None:
    tok = ByteTokenizer() if which == "bytes" else hf
    text = "".join(CORPUS) * 3
    ids = tok.encode(text)
    shown, _ = stream(tok, ids, [], step)
    assert shown == tok.decode(ids) == text


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_stop_strings_cut_and_never_leak(hf: HFTokenizer, which: str) -> None:
    tok = ByteTokenizer() if which == "bytes" else hf
    text = "".join(CORPUS)
    ids = tok.encode(text)
    stops = ["STOP", "東京 🚀"]
    want = text[:min(text.index(s) for s in stops)]
    shown, ts = stream(tok, ids, stops)
    assert shown == want and ts.stopped and ts.stop_string == "東京 🚀"
    # Every prefix shown while streaming is a prefix of the answer (nothing taken back).
    ts2 = TextStream(tok, ["STOP"])
    seen = ""
    for t in ids:
        seen += ts2.push([t], final=False)
        assert "STOP" not in seen and text.startswith(seen)
        if ts2.stopped:
            break
    assert seen == text[:text.index("STOP")]


def test_eos_is_not_text_and_min_tokens_defers_stops() -> None:
    tok = ByteTokenizer()
    ts = TextStream(tok, ["xy"])
    assert ts.push([ord("a"), ByteTokenizer.EOS], final=False) == ""  # "a" held back
    assert ts.push([ord("x")], final=False, check_stops=False) == "a"
    assert ts.push([ord("y")], final=True, check_stops=False) == "xy"
    assert not ts.stopped
    checked = TextStream(tok, ["xy"])
    shown = [checked.push([t], final=False) for t in b"axy"]
    assert "".join(shown) == "a" and checked.stopped


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_work_is_linear_in_the_output(hf: HFTokenizer, which: str) -> None:
    tok = Counting(ByteTokenizer() if which == "bytes" else hf)
    rng = np.random.default_rng(1)
    corpus = "".join(CORPUS)
    text = "".join(corpus[i:i + 40] for i in rng.integers(0, len(corpus) - 40, 200))
    ids = tok.inner.encode(text)
    shown, _ = stream(tok, ids, ["never appears"])
    assert shown == tok.inner.decode(ids)
    # Each id is decoded a bounded number of times (a re-decode of everything per token
    # would be ~len(ids) / 2 times each).
    assert tok.decoded_ids <= 8 * len(ids), (tok.decoded_ids, len(ids))
