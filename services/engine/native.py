"""The engine's native decode kernels: paged decode attention (kernels/decode_attention.c),
the decode matmuls and RMSNorm (kernels/decode_linear.c), RoPE with the K/V append and
SiLU * up (kernels/decode_pointwise.c), and every layer of a decode step in one call
(kernels/decode_layers.c), one library.

Built on first use with the machine's C compiler (`cc`, or `$CC`) into the cache
directory (`PDMESH_CACHE_DIR`, default `~/.cache/pdmesh`, under `kernels/`), named by a
hash of the source, the compiler's version, the flags and the CPU's feature flags, so a
process never loads a library built for another CPU or from other source. Loaded with
ctypes (no torch headers: it builds in well under a second).

`PDMESH_NATIVE_KERNELS`: `auto` (default: use them when they build, else decode runs in
torch), `off` (torch always) or `on` (refuse to run without them). The two paths give
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
import threading
from dataclasses import dataclass
from functools import cache
from itertools import accumulate
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name("kernels") / name
                for name in ("decode_attention.c", "decode_linear.c", "decode_linear_q.c",
                             "decode_pointwise.c", "decode_layers.c"))
HEADERS = (Path(__file__).with_name("kernels") / "vec_exp.h",)  # hashed with the sources
FLAGS = ("-O3", "-march=native", "-std=gnu11", "-ffp-contract=fast", "-fno-math-errno", "-shared",
         "-fPIC", "-fopenmp")
SETTING = "PDMESH_NATIVE_KERNELS"


class NativeUnavailable(RuntimeError):
    """PDMESH_NATIVE_KERNELS=on but the kernels could not be built or loaded."""


def setting() -> str:
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{SETTING}={value!r}: expected auto, on or off")
    return value


def _cache_dir() -> Path:
    # Imported here: checkpoint loads gguf and tokenizers, which only a build needs.
    from pdmesh.services.engine.checkpoint import cache_dir

    return cache_dir() / "kernels"


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
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join((*texts, compiler, version, " ".join(FLAGS),
                                    platform.machine(), _cpu_flags())).encode()).hexdigest()
    target = _cache_dir() / f"decode_kernels-{key[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(built), *map(str, SOURCES)],
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
        log.warning("native decode kernels unavailable, torch runs decode: %s", exc)
        return None
    fn = lib.pd_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 6 + [ctypes.c_void_p, ctypes.c_void_p,
                                                      ctypes.c_float, ctypes.c_int64,
                                                      ctypes.c_int64]
    fn = lib.pd_decode_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    for fn in (lib.pd_decode_linear_q, lib.pd_decode_linear_q_portable):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.pd_quant_row_bytes.restype = ctypes.c_int64
    lib.pd_quant_row_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64]
    fn = lib.pd_decode_rms_norm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
    fn = lib.pd_decode_rope_kv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [
        ctypes.c_int64] + [ctypes.c_void_p] * 3
    fn = lib.pd_decode_silu_mul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn = lib.pd_decode_layers
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_float]
    lib.pd_decode_layers_fields.restype = ctypes.c_int64
    lib.pd_decode_layers_fields.argtypes = []
    return lib


def available() -> bool:
    """Whether the native decode kernels run in this process (built on the first call)."""
    return _library() is not None


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and available()


def _loaded() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise NativeUnavailable("the native decode kernels are not loaded here")
    return lib


LINEAR_LANES = 16  # decode_linear.c: in-features a multiple of this
LINEAR_MIN_OUT = 16  # ... and at least this many out-features


def linear_takes(shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether `linear` takes a weight of this shape [out, in]."""
    out_features, in_features = shape
    return (in_features >= LINEAR_LANES and in_features % LINEAR_LANES == 0
            and out_features >= LINEAR_MIN_OUT)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T for the rows of a decode step (x [m, in], weight [out, in], fp32 CPU),
    each output in one fixed order whatever m, the row's place or the thread count
    (kernels/decode_linear.c), so a row's bits do not depend on the batch."""
    lib = _loaded()
    # Checked on every call (the kernel reads through raw addresses), in the cheapest
    # order: a decode step makes one call per weight (tiny: 17, ~1 us of checks each).
    if (x.dim() != 2 or weight.dim() != 2 or not (x.is_cpu and weight.is_cpu)
            or x.dtype != torch.float32 or weight.dtype != torch.float32
            or not weight.is_contiguous() or x.shape[1] != weight.shape[1]
            or not linear_takes(weight.shape)):
        raise ValueError(f"native linear takes fp32 CPU x [m, in] and a contiguous weight "
                         f"[out >= {LINEAR_MIN_OUT}, in = k * {LINEAR_LANES}]; got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    if x.shape[0] == 0:
        return out
    status = lib.pd_decode_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                                  weight.shape[0], out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native linear refused its arguments (status {status})")
    return out


QUANT_SETTING = "PDMESH_QUANTIZED_DECODE"
QUANT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # the GGML types it takes
# per type: (values, bytes) of a block (Q4_K, Q6_K: a super-block of 8 sub-blocks)
QUANT_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


def quant_row_bytes(kind: int, cols: int) -> int:
    """Bytes of a row of `cols` values of GGML type `kind` (0: a type or width
    decode_linear_q.c does not take)."""
    values, size = QUANT_BLOCKS.get(kind, (0, 0))
    return cols // values * size if values and cols >= values and cols % values == 0 else 0


def quantized_decode() -> bool:
    """`PDMESH_QUANTIZED_DECODE`: `on` (default: decode's matmuls on a GGUF's own Q4_0 / Q4_1 /
    Q8_0 / Q4_K / Q6_K blocks with int8 activations, kernels/decode_linear_q.c; other
    matrices stay fp32) or `off` (on the fp32 weights: the reference path). It changes the
    bits: every process of a mesh and its oracle take the same setting (the engine
    fingerprint says which)."""
    value = os.environ.get(QUANT_SETTING, "on").strip().lower() or "on"
    if value not in ("on", "off"):
        raise ValueError(f"{QUANT_SETTING}={value!r}: expected on or off")
    return value == "on"


@dataclass(frozen=True)
class QuantMatrix:
    """A weight [rows, cols] kept as a GGUF stores it: per row, the blocks of GGML type
    `type` (Q4_0, Q4_1, Q8_0: 32 values a block; Q4_K, Q6_K: 256), `data` uint8 [rows, row
    bytes], C-contiguous."""

    type: int
    cols: int
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.type not in QUANT_BLOCKS:
            raise ValueError(f"GGML type {self.type}: not one of {sorted(QUANT_TYPES)}")
        row = quant_row_bytes(self.type, self.cols)
        if (not row or self.data.dtype != np.uint8 or self.data.ndim != 2
                or self.data.shape[1] != row or not self.data.flags.c_contiguous):
            raise ValueError(f"type {self.type} blocks of {self.cols} columns: expected "
                             f"C-contiguous uint8 [rows, {row}] (a width the type takes), "
                             f"got {self.data.dtype} {self.data.shape}")

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @staticmethod
    def cat(parts: list[QuantMatrix | None]) -> QuantMatrix | None:
        """The parts' rows one after another (the fused qkv / gate-up), or None unless every
        part is quantized, all of one type and width."""
        if not parts or any(p is None for p in parts):
            return None
        first = parts[0]
        assert first is not None
        if any(p.type != first.type or p.cols != first.cols for p in parts if p is not None):
            return None
        return QuantMatrix(first.type, first.cols,
                           np.ascontiguousarray(np.concatenate([p.data for p in parts
                                                                if p is not None])))


def linear_q(x: torch.Tensor, weight: QuantMatrix, portable: bool = False) -> torch.Tensor:
    """x @ weight^T for the rows of a decode step (x [m, in] fp32 CPU) on quantized blocks
    (kernels/decode_linear_q.c): each row of x quantized to int8 per block of 32, each
    output one fixed sequence, so a row's bits do not depend on the batch. `portable`: the
    kernel's portable C path (the same bits as the vectorised one; for the tests)."""
    lib = _loaded()
    if (x.dim() != 2 or not x.is_cpu or x.dtype != torch.float32
            or x.shape[1] != weight.cols):
        raise ValueError(f"quantized linear takes fp32 CPU x [m, {weight.cols}]; got "
                         f"{tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.rows, dtype=torch.float32)
    if x.shape[0] == 0:
        return out
    fn = lib.pd_decode_linear_q_portable if portable else lib.pd_decode_linear_q
    status = fn(x.data_ptr(), x.shape[0], x.shape[1], weight.data.ctypes.data, weight.type,
                weight.rows, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"quantized linear refused its arguments (status {status})")
    return out


class DecodeAttention:
    """The native call for one forward's decode rows: the storage of each request (base
    address, page size, page stride, its page ids) fixed once, then one call per layer."""

    def __init__(self, bases: list[int], page_tokens: list[int], page_strides: list[int],
                 pages: list[np.ndarray], lengths: list[int], keep: list[torch.Tensor],
                 page_counts: list[int]) -> None:
        """`page_counts[i]`: how many pages storage i has. The kernel reads through raw
        addresses, so every page id is checked against it here (the engine's lease checks
        ran before; this keeps a wrong page table from reading outside the storage)."""
        n = len(bases)
        if not (len(page_tokens) == len(page_strides) == len(pages) == len(lengths)
                == len(page_counts) == n):
            raise ValueError("one base, page size, stride, page table, length and page "
                             "count per segment")
        self._setup(n, keep, pages, (bases, page_tokens, page_strides, lengths), page_counts)

    @classmethod
    def over_pool(cls, pool: torch.Tensor, page_tokens: int, pages: list[np.ndarray],
                  lengths: list[int]) -> DecodeAttention:
        """Every segment's pages in one pool tensor [pages, ...] (page p starts p *
        pool[0].numel() floats in): the per-step set-up of a paged decode, made cheap."""
        self = cls.__new__(cls)
        n = len(pages)
        if len(lengths) != n:
            raise ValueError("one length per segment")
        if not pool.is_contiguous():
            raise ValueError("the pool must be contiguous")
        self._setup(n, [pool], pages, (pool.data_ptr(), page_tokens, pool.stride(0), lengths),
                    pool.shape[0])
        return self

    def _setup(self, n: int, keep: list[torch.Tensor], pages: list[np.ndarray],
               columns: tuple, page_counts: list[int] | int) -> None:
        """One int64 buffer: bases, page sizes, strides, lengths (n each), the n + 1 offsets
        of each segment's pages, then the page ids: one address to hand to ctypes."""
        self._keep = keep  # the tensors the addresses point into stay alive
        self.n = n
        sizes = [len(p) for p in pages]
        ends = list(accumulate(sizes))  # a few segments: plain ints are cheaper than numpy
        buffer = np.empty(5 * n + 1 + (ends[-1] if n else 0), dtype=np.int64)
        for i, column in enumerate(columns):
            buffer[i * n:(i + 1) * n] = column
        starts = buffer[4 * n:5 * n + 1]
        starts[0] = 0
        starts[1:] = ends
        ids = buffer[5 * n + 1:]
        if n:
            np.concatenate(pages, out=ids, casting="same_kind")
        if isinstance(page_counts, int):  # one storage: two reductions (every decode step)
            outside = None
            bad = ids.size and (ids.min() < 0 or ids.max() >= page_counts)
        else:
            outside = (ids < 0) | (ids >= np.repeat(np.asarray(page_counts, np.int64), sizes))
            bad = outside.any()
        if bad:  # which segment, for the message
            if outside is None:
                outside = (ids < 0) | (ids >= page_counts)
            i = int(np.searchsorted(starts[1:], int(np.argmax(outside)), side="right"))
            count = page_counts if isinstance(page_counts, int) else page_counts[i]
            raise ValueError(f"segment {i}: page ids outside its storage of {count} pages")
        self._buffer = buffer
        self.pages, self.lengths = ids, buffer[3 * n:4 * n]
        self._fn = _library().pd_decode_attention  # type: ignore[union-attr]
        address = buffer.ctypes.data
        # the kernel's order: bases, page sizes, strides, page offsets, page ids, lengths
        self._ptrs = [address + 8 * offset for offset in (0, n, 2 * n, 4 * n, 5 * n + 1,
                                                          3 * n)]

    def addresses(self) -> list[int]:
        """The storage description's addresses in the kernel's argument order (bases, page
        sizes, strides, page offsets, page ids, lengths); valid while this object lives."""
        return self._ptrs

    def __call__(self, layer: int, q: torch.Tensor, kv_heads: int, head_dim: int,
                 window: int = 0) -> torch.Tensor:
        """Attention of q [n, heads, head_dim] (one row per request, in order) over each
        request's keys 0..length (its last `window` with a sliding window > 0); returns
        [n, heads, head_dim]."""
        q = q.contiguous()
        out = torch.empty_like(q)
        group = q.shape[1] // kv_heads
        status = self._fn(self.n, layer, kv_heads, group, head_dim, *self._ptrs,
                          q.data_ptr(), out.data_ptr(), head_dim ** -0.5,
                          min(torch.get_num_threads(), 16), window)
        if status != 0:
            raise ValueError("native decode attention refused its arguments")
        return out


def _plain(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return (tuple(t.shape) == shape and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of a decode step's rows x [m, dim] (fp32 CPU, contiguous) in one fixed order
    per row (kernels/decode_linear.c). With `delta`, the residual add comes first, in
    place: x += delta, then the norm of the new x."""
    lib = _loaded()
    m, dim = x.shape if x.dim() == 2 else (-1, -1)
    if (not _plain(x, (m, dim)) or not _plain(weight, (dim,))
            or (delta is not None and not _plain(delta, (m, dim)))
            or dim < LINEAR_LANES or dim % LINEAR_LANES):
        raise ValueError(f"native rms_norm takes contiguous fp32 CPU x [m, dim = k * "
                         f"{LINEAR_LANES}], weight [dim] and delta like x; got "
                         f"{tuple(x.shape)} {x.dtype}, {tuple(weight.shape)}")
    out = torch.empty_like(x)
    status = lib.pd_decode_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                                    m, dim, weight.data_ptr(), eps, out.data_ptr())
    if status != 0:
        raise ValueError(f"native rms_norm refused its arguments (status {status})")
    return out


class KVAppend:
    """RoPE of a decode step's q and k, and the append of its k and v
    (kernels/decode_pointwise.c), one layer per call: the kernel alone, as the tests run it
    (a decode step runs it inside `DecodeLayers`). `targets` [layers, 2, m] int64: the
    byte addresses of each row's K and V slot in every layer, which the caller computed
    from the request's own checked pages (`SegmentsKV.decode_targets`); its address is
    taken once here."""

    def __init__(self, targets: np.ndarray) -> None:
        if (targets.ndim != 3 or targets.shape[1] != 2 or targets.dtype != np.int64
                or not targets.flags.c_contiguous):
            raise ValueError(f"native K/V append targets are int64 [layers, 2, m], "
                             f"contiguous; got {targets.shape} {targets.dtype}")
        self._fn = _loaded().pd_decode_rope_kv
        self.targets, self.layers, self.m = targets, targets.shape[0], targets.shape[2]
        self._address = targets.ctypes.data

    def __call__(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
                 ) -> torch.Tensor:
        """qkv [m, (heads + 2 * kv_heads) * head_dim] (the fused matmul's rows), positions
        [m] (int64), cos/sin [max_context, head_dim / 2] (the model's tables). The same
        bits as the torch RoPE. Returns the rotated queries [m, heads, head_dim]."""
        m, half = self.m, cos.shape[1] if cos.dim() == 2 else -1
        head_dim = 2 * half
        if (not 0 <= layer < self.layers or head_dim < 2
                or not _plain(qkv, (m, (heads + 2 * kv_heads) * head_dim))
                or not _plain(cos, (cos.shape[0], half)) or not _plain(sin, tuple(cos.shape))
                or tuple(positions.shape) != (m,) or positions.dtype != torch.int64
                or not positions.is_contiguous()):
            raise ValueError(f"native rope_kv takes a layer < {self.layers}, contiguous "
                             f"fp32 CPU qkv [{m}, (heads + 2 * kv_heads) * head_dim], int64 "
                             f"positions [{m}] and cos/sin [rows, head_dim / 2]; got layer "
                             f"{layer}, {tuple(qkv.shape)}, {tuple(positions.shape)}, "
                             f"{tuple(cos.shape)}")
        q = torch.empty(m, heads, head_dim, dtype=torch.float32)
        k_dst = self._address + 16 * m * layer
        status = self._fn(qkv.data_ptr(), m, heads, kv_heads, head_dim, positions.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), cos.shape[0], q.data_ptr(), k_dst,
                          k_dst + 8 * m)
        if status != 0:
            raise ValueError(f"native rope_kv refused its arguments (status {status}): a "
                             "position outside the tables or a null target")
        return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a decode step's rows, gate_up [m, 2 * ffn] (the fused gate/up
    matmul's output; fp32 CPU, contiguous, ffn a multiple of 16): [m, ffn]. Each value
    from its own row only (kernels/decode_pointwise.c). The kernel alone, as the tests run
    it; a decode step runs it inside `DecodeLayers`."""
    lib = _loaded()
    m, width = gate_up.shape if gate_up.dim() == 2 else (-1, -1)
    ffn = width // 2
    if not _plain(gate_up, (m, width)) or width % 32:
        raise ValueError(f"native silu_mul takes contiguous fp32 CPU gate_up [m, 2 * ffn], "
                         f"ffn a multiple of 16; got {tuple(gate_up.shape)} {gate_up.dtype}")
    out = torch.empty(m, ffn, dtype=torch.float32)
    status = lib.pd_decode_silu_mul(gate_up.data_ptr(), m, ffn, out.data_ptr())
    if status != 0:
        raise ValueError(f"native silu_mul refused its arguments (status {status})")
    return out


# kernels/decode_layers.c: the order of the step array and of a layer's weights
_STEP_FIELDS = ("m", "dim", "heads", "kv_heads", "head_dim", "ffn", "layers", "threads", "x",
                "delta", "h", "qkv", "q", "attn", "gate_up", "act", "positions", "cos", "sin",
                "table_rows", "targets", "bases", "page_tokens", "page_stride", "page_start",
                "pages", "lengths", "norm", "hidden", "window")
LAYER_WEIGHTS = ("attn_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down")
QUANT_MATMULS = ("wqkv", "wo", "w_gate_up", "w_down")  # a layer's slots after its bias
_STAGES = ("", "attention norm", "qkv matmul", "RoPE / K-V append", "attention", "o matmul",
           "ffn norm", "gate/up matmul", "SiLU * up", "down matmul", "final norm")


class DecodeLayers:
    """Every layer of a decode step and the final norm in one native call
    (kernels/decode_layers.c): the same kernels in the same order as the per-layer calls
    (`rms_norm`, `linear`, `KVAppend`, `DecodeAttention`, `silu_mul`), hence the same bits,
    without Python between them. Built once per model: the weights are checked here (fp32
    CPU contiguous, the shapes the kernels take) and their addresses kept. The step's
    scratch is kept too (allocated per step it was ~0.24 MB for tiny at 16 rows: fresh pages
    from the OS every step); a lock keeps two threads from sharing it."""

    def __init__(self, layers: list, norm: torch.Tensor, heads: int, kv_heads: int,
                 head_dim: int, eps: float, window: int = 0,
                 quant: list[dict[str, QuantMatrix | None]] | None = None) -> None:
        """`layers`: `model.FusedLayer`s (a `bqkv` of None: no q/k/v bias); `window`: the
        sliding window in keys (0: none); `quant`: per layer, the matmuls (QUANT_MATMULS)
        that run on quantized blocks instead of the layer's fp32 rows."""
        if not layers or heads % kv_heads:
            raise ValueError("decode layers need at least one layer and heads a multiple "
                             "of kv_heads")
        dim = layers[0].attn_norm.shape[0]
        ffn = layers[0].w_down.shape[1]
        q_dim, qkv_dim = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        shapes = {"attn_norm": (dim,), "wqkv": (qkv_dim, dim), "wo": (dim, q_dim),
                  "ffn_norm": (dim,), "w_gate_up": (2 * ffn, dim), "w_down": (dim, ffn)}
        for i, layer in enumerate(layers):
            for name in LAYER_WEIGHTS:
                t = getattr(layer, name)
                if not _plain(t, shapes[name]) or (t.dim() == 2 and not linear_takes(t.shape)):
                    raise ValueError(f"layer {i} {name}: {tuple(t.shape)} {t.dtype} is not a "
                                     f"contiguous fp32 CPU {shapes[name]} the kernels take")
            if layer.bqkv is not None and not _plain(layer.bqkv, (qkv_dim,)):
                raise ValueError(f"layer {i} bqkv: {tuple(layer.bqkv.shape)} is not a "
                                 f"contiguous fp32 CPU ({qkv_dim},)")
        if window < 0:
            raise ValueError(f"window {window}: expected >= 0")
        if not _plain(norm, (dim,)):
            raise ValueError(f"the final norm: {tuple(norm.shape)} is not fp32 CPU ({dim},)")
        if dim % LINEAR_LANES or ffn % LINEAR_LANES or head_dim % 8:
            raise ValueError(f"dim {dim}, ffn {ffn} (multiples of {LINEAR_LANES}) and "
                             f"head_dim {head_dim} (of 8) do not suit the kernels")
        lib = _loaded()
        if lib.pd_decode_layers_fields() != len(_STEP_FIELDS):
            raise NativeUnavailable("kernels/decode_layers.c and native.py disagree on the "
                                    "step's fields")
        self._fn = lib.pd_decode_layers
        quant = quant or [{} for _ in layers]
        if len(quant) != len(layers):
            raise ValueError(f"{len(quant)} layers of quantized matmuls for {len(layers)}")
        per_layer = [[getattr(layer, name) for name in LAYER_WEIGHTS] + [layer.bqkv]
                     for layer in layers]
        self._keep: list[object] = [t for ts in per_layer for t in ts if t is not None]
        self._keep.append(norm)
        slots: list[int] = []
        self.quantized = 0  # matmuls on quantized blocks
        for i, (ts, qs) in enumerate(zip(per_layer, quant, strict=True)):
            addresses = [0 if t is None else t.data_ptr() for t in ts]
            types = []
            for name in QUANT_MATMULS:
                qm = qs.get(name)
                if qm is None:
                    types.append(0)
                    continue
                if qm.shape != shapes[name]:
                    raise ValueError(f"layer {i} {name}: quantized {qm.shape}, expected "
                                     f"{shapes[name]}")
                addresses[LAYER_WEIGHTS.index(name)] = qm.data.ctypes.data
                types.append(qm.type)
                self._keep.append(qm)
                self.quantized += 1
            slots.extend(addresses + types)
        self.weights = np.array(slots, dtype=np.int64)
        self._weights_address = self.weights.ctypes.data
        self._norm_address = norm.data_ptr()
        self.layers, self.dim, self.ffn = len(layers), dim, ffn
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.eps, self.scale, self.window = eps, head_dim ** -0.5, window
        self._sizes = (dim, qkv_dim, q_dim, q_dim, 2 * ffn, ffn, dim)  # h .. act, delta
        self._scratch: list[int] = []  # the buffers' addresses, for `_rows` rows
        self._rows = 0
        self._buffer = torch.empty(0)
        self._lock = threading.Lock()

    def _scratch_for(self, m: int) -> list[int]:
        if m > self._rows:
            self._rows = max(m, 16)
            self._buffer = torch.empty(self._rows * sum(self._sizes), dtype=torch.float32)
            parts = self._buffer.split([self._rows * n for n in self._sizes])
            self._scratch = [part.data_ptr() for part in parts]
        return self._scratch

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, attend: DecodeAttention, targets: np.ndarray
                 ) -> torch.Tensor:
        """Run every layer over x [m, dim] (the embeddings; updated in place: the residual
        stream) and return the final norm of the result [m, dim]. `attend`: the step's
        attention storage (m rows), `targets` [layers, 2, m]: where each row's K and V go
        (`SegmentsKV.decode_targets`)."""
        m = x.shape[0] if x.dim() == 2 else -1
        half = self.head_dim // 2
        if (not _plain(x, (m, self.dim)) or m < 1
                or tuple(positions.shape) != (m,) or positions.dtype != torch.int64
                or not positions.is_contiguous() or not _plain(cos, (cos.shape[0], half))
                or not _plain(sin, tuple(cos.shape)) or attend.n != m
                or targets.shape != (self.layers, 2, m) or targets.dtype != np.int64
                or not targets.flags.c_contiguous):
            raise ValueError(f"decode layers take contiguous fp32 CPU x [m >= 1, {self.dim}], "
                             f"int64 positions [m], cos/sin [rows, {half}], attention over m "
                             f"rows and int64 targets [{self.layers}, 2, m]; got x "
                             f"{tuple(x.shape)}, positions {tuple(positions.shape)}, "
                             f"{attend.n} attention rows, targets {targets.shape}")
        hidden = torch.empty(m, self.dim, dtype=torch.float32)
        with self._lock:
            h, qkv, q, attn, gate_up, act, delta = self._scratch_for(m)
            step = np.array([m, self.dim, self.heads, self.kv_heads, self.head_dim, self.ffn,
                             self.layers, torch.get_num_threads(), x.data_ptr(), delta, h, qkv,
                             q, attn, gate_up, act, positions.data_ptr(), cos.data_ptr(),
                             sin.data_ptr(), cos.shape[0], targets.ctypes.data,
                             *attend.addresses(), self._norm_address, hidden.data_ptr(),
                             self.window],
                            dtype=np.int64)
            status = self._fn(step.ctypes.data, self._weights_address, self.eps, self.scale)
        if status != 0:
            raise ValueError(f"native decode layers refused their arguments at the "
                             f"{_STAGES[(status >> 8) % len(_STAGES)]} (status {status & 0xff})")
        return hidden
