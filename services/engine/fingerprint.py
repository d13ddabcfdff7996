"""The engine fingerprint: one short string naming what decides the bits a process computes.

Two processes with equal fingerprints compute the same bits for the same request (the
engine is batch-invariant; see README "One build everywhere"); unequal ones may not.
Workers announce theirs in every heartbeat, admission pairs a prefill with a decode only
when theirs are equal, and `pdmesh soak` judges replies only with an oracle of the same
fingerprint. The parts, joined by "|":

    sha256:<12 hex>        the checkpoint: a GGUF file, or a safetensors directory's
                           config.json and *.safetensors (the digest of their digests);
    tiny:<12 hex>          or the seeded `tiny` model's weights and config
    native-step:<12 hex>   the decode path (README "Decode paths") and, on a native one,
    native-step-q:<12 hex> the SHA-256 of the kernel library loaded (its build: sources,
    native-attn:<12 hex>   compiler, flags, the CPU it was built for); `native-step-q`:
    torch                  the native step on a GGUF's quantized blocks
                           (PDMESH_QUANTIZED_DECODE=on, the default)
    torch-<version>        torch.__version__ (its kernels, its RNG for `tiny`)
    float32 ...            the compute dtype
    cpu-<isa> | cuda-<gpu> the device: on CPU the instruction set torch dispatches to

e.g. `sha256:9f3c2e1ab004|native-step:5a760f39aafb|torch-2.13.0+cpu|float32|cpu-avx2`.

A checkpoint's digest is cached on disk (`$PDMESH_CACHE_DIR/fingerprints/`, one record per
file: path, size, mtime), so a 270 MB GGUF is hashed once, not at every start; a file whose
size or mtime changed is hashed again. The engine's own Python code and the torch thread
count are not in it: a mesh runs one image (README).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from pdmesh.services.engine import native
from pdmesh.services.engine.checkpoint import ModelSource, cache_dir, resolve
from pdmesh.services.engine.model import LlamaModel, LoadedModel

DIGEST_CHARS = 12  # hex characters of each digest the fingerprint shows
_CHUNK_BYTES = 1 << 20
_BY_NAME = ("tiny", "smollm2")  # model names that are also specs (`checkpoint.resolve`)


class ComputesWith(Protocol):
    """What the fingerprint reads of an engine: its model math (device, dtype, decode
    path). `runner.Engine` and `reference.ReferenceEngine` both have one."""

    model: LlamaModel


def engine_fingerprint(model: LoadedModel, engine: ComputesWith,
                       spec: str | None = None) -> str:
    """The fingerprint of `engine` running `model` (loaded from the model spec `spec`,
    e.g. the worker's `--model`; "tiny" and "smollm2" are found by the model's name).
    Raises ValueError when the checkpoint cannot be found from them."""
    llama = engine.model
    return "|".join((model_digest(model, spec), decode_path(llama),
                     f"torch-{torch.__version__}", str(llama.dtype).removeprefix("torch."),
                     device_name(llama.device)))


def model_digest(model: LoadedModel, spec: str | None = None) -> str:
    """`sha256:<hex>` of the checkpoint file(s), or `tiny:<hex>` of the seeded weights."""
    if spec is None:
        if model.name not in _BY_NAME:
            raise ValueError(f"model {model.name!r}: pass the model spec it was loaded from "
                             "(a .gguf file or a safetensors directory)")
        spec = model.name
    source: ModelSource = resolve(spec)
    if source.kind == "tiny":
        return f"tiny:{weights_digest(model)[:DIGEST_CHARS]}"
    assert source.path is not None
    if source.kind == "gguf":
        return f"sha256:{file_digest(source.path)[:DIGEST_CHARS]}"
    files = sorted([source.path / "config.json", *source.path.glob("*.safetensors")])
    combined = hashlib.sha256()
    for path in files:
        combined.update(f"{path.name}\0{file_digest(path)}\n".encode())
    return f"sha256:{combined.hexdigest()[:DIGEST_CHARS]}"


def weights_digest(model: LoadedModel) -> str:
    """SHA-256 of the model's config and every weight (shape, dtype, bytes) in a fixed
    order: for models made in the process (`tiny`), with no file to hash."""
    digest = hashlib.sha256(repr(model.config).encode())
    w = model.weights
    tensors = [("embed", w.embed)]
    for i, layer in enumerate(w.layers):
        tensors.extend((f"layers.{i}.{name}", t) for name, t in vars(layer).items()
                       if t is not None)  # a bias the model does not have
    tensors.extend((("norm", w.norm), ("lm_head", w.lm_head)))
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}\0".encode())
        digest.update(t.view(torch.uint8).numpy())
    return digest.hexdigest()


def decode_path(llama: LlamaModel) -> str:
    """`native-step:<hex>`, `native-attn:<hex>` or `torch`: the decode path the model
    takes (fixed per model at start) and, on a native one, its library's digest."""
    if llama.native_linear():
        quantized = llama.quantized is not None and (
            llama._native_layers().quantized > 0 or llama.quantized.lm_head is not None)
        kind = "native-step-q" if quantized else "native-step"  # guard: fingerprint-quantized
        return f"{kind}:{kernels_digest()[:DIGEST_CHARS]}"
    if native.usable(llama.device, llama.dtype):
        return f"native-attn:{kernels_digest()[:DIGEST_CHARS]}"
    return "torch"


@cache
def kernels_digest() -> str:
    """SHA-256 of the native kernel library this process loaded. A build from the same
    sources, compiler, flags and CPU gives the same bytes (wherever the sources lie); a
    library built for another CPU or by another compiler gives others."""
    lib = native._library()  # built and loaded once per process; None when unavailable
    if lib is None:
        raise ValueError("the native decode kernels are not loaded in this process")
    return _hash_file(Path(lib._name))


def device_name(device: torch.device) -> str:
    """`cpu-<isa>` (the instruction set torch's CPU kernels dispatch to) or
    `<type>-<device name>` for an accelerator."""
    if device.type == "cpu":
        return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"cuda-{re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('-')}"
    return device.type


def file_digest(path: Path) -> str:
    """SHA-256 of `path`, from its cache record when the file's size and mtime are those
    recorded, else hashed (and recorded; a cache directory we cannot write is skipped)."""
    path = path.resolve()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    record = _records_dir() / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"
    try:
        cached = json.loads(record.read_text())
        if {k: cached.get(k) for k in key} == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError):
        pass
    digest = _hash_file(path)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, delete=False,
                                         suffix=".tmp") as tmp:
            json.dump({**key, "sha256": digest}, tmp)
        try:
            os.replace(tmp.name, record)  # atomic: concurrent workers agree on the record
        finally:
            Path(tmp.name).unlink(missing_ok=True)
    except OSError:
        pass
    return digest


def _records_dir() -> Path:
    return cache_dir() / "fingerprints"


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
