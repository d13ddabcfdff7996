"""The engine's one native kernel: paged decode attention (kernels/decode_attention.c).

Built on first use with the machine's C compiler (`cc`, or `$CC`) into the cache
directory (`PDMESH_CACHE_DIR`, default `~/.cache/pdmesh`, under `kernels/`), named by a
hash of the source, the compiler's version, the flags and the CPU's feature flags, so a
process never loads a library built for another CPU or from other source. Loaded with
ctypes (no torch headers: it builds in well under a second).

`PDMESH_NATIVE_ATTENTION`: `auto` (default: use it when it builds, else decode attention
runs in torch), `off` (torch always) or `on` (refuse to run without it). The two paths give
different bits (another reduction order), so every process of a mesh and its oracle must
take the same one: on one machine, or one image, they do (same compiler, same setting).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-ffp-contract=fast", "-shared", "-fPIC", "-fopenmp")
SETTING = "PDMESH_NATIVE_ATTENTION"
_I64 = ctypes.POINTER(ctypes.c_int64)


class NativeUnavailable(RuntimeError):
    """PDMESH_NATIVE_ATTENTION=on but the kernel could not be built or loaded."""


def setting() -> str:
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{SETTING}={value!r}: expected auto, on or off")
    return value


def _cache_dir() -> Path:
    root = os.environ.get("PDMESH_CACHE_DIR") or str(Path.home() / ".cache" / "pdmesh")
    return Path(root) / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    named = os.environ.get("CC")
    compiler = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeUnavailable(f"no C compiler ({f'CC={named}' if named else 'cc or gcc'})"
                                " on this machine")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), compiler, version, " ".join(FLAGS),
                                    platform.machine(), _cpu_flags())).encode()).hexdigest()
    target = _cache_dir() / f"decode_attention-{key[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise NativeUnavailable(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)  # atomic: concurrent builders agree on the result
    return target


@cache
def _library() -> ctypes.CDLL | None:
    if setting() == "off":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError, NativeUnavailable) as exc:
        if setting() == "on":
            raise NativeUnavailable(f"{SETTING}=on: {exc}") from exc
        log.warning("native decode attention unavailable, torch runs it: %s", exc)
        return None
    fn = lib.pd_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 5 + [_I64] * 6 + [ctypes.c_void_p, ctypes.c_void_p,
                                                      ctypes.c_float, ctypes.c_int64]
    return lib


def available() -> bool:
    """Whether decode attention runs natively in this process (builds it on first call)."""
    return _library() is not None


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and available()


class DecodeAttention:
    """The native call for one forward's decode rows: the storage of each request (base
    address, page size, page stride, its page ids) fixed once, then one call per layer."""

    def __init__(self, bases: list[int], page_tokens: list[int], page_strides: list[int],
                 pages: list[np.ndarray], lengths: list[int], keep: list[torch.Tensor],
                 page_counts: list[int]) -> None:
        """`page_counts[i]`: how many pages storage i has. The kernel reads through raw
        addresses, so every page id is checked against it here (the engine's lease checks
        ran before; this keeps a wrong page table from reading outside the storage)."""
        for i, (ids, count) in enumerate(zip(pages, page_counts, strict=True)):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= count):
                raise ValueError(f"segment {i}: page ids outside its storage of {count} "
                                 "pages")
        self._keep = keep  # the tensors the addresses point into stay alive
        self.n = len(bases)
        self.bases = np.asarray(bases, dtype=np.int64)
        self.page_tokens = np.asarray(page_tokens, dtype=np.int64)
        self.page_strides = np.asarray(page_strides, dtype=np.int64)
        self.page_start = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pages], out=self.page_start[1:])
        self.pages = np.ascontiguousarray(np.concatenate(pages), dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self._fn = _library().pd_decode_attention  # type: ignore[union-attr]
        self._ptrs = [a.ctypes.data_as(_I64) for a in (
            self.bases, self.page_tokens, self.page_strides, self.page_start, self.pages,
            self.lengths)]

    def __call__(self, layer: int, q: torch.Tensor, kv_heads: int, head_dim: int
                 ) -> torch.Tensor:
        """Attention of q [n, heads, head_dim] (one row per request, in order) over each
        request's keys 0..length; returns [n, heads, head_dim]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        group = q.shape[1] // kv_heads
        status = self._fn(self.n, layer, kv_heads, group, head_dim, *self._ptrs,
                          q.data_ptr(), out.data_ptr(), head_dim ** -0.5,
                          min(torch.get_num_threads(), 16))
        if status != 0:
            raise ValueError("native decode attention refused its arguments")
        return out
