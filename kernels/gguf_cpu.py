"""C++ GEMVs for GGUF's block formats on the CPU: Q4_1 and Q8_0 weights, int8 activations.

At batch 1 a CPU decode step reads every weight once per token, and torch's packed int4 kernel
(``int4_cpu.py``) multiplies in bfloat16 floats. These kernels keep the weights in GGUF's own
blocks of 32 along the input dim and multiply in integers, as llama.cpp does:

* weights: Q4_1 (``w = code * d + m``, codes 0..15, one ``d`` and ``m`` per block; the int4
  linear layers) or Q8_0 (``w = code * d``, codes -127..127; the LM head). A Q4_1 weight is
  three tensors (:class:`Q4_1`): the codes, 16 bytes a block, and ``d`` and ``m`` in float16
  as GGUF stores them (0.625 bytes a weight; the kernels convert them with F16C), so a GGUF
  file's values are kept exactly and weights quantised at load have float16 scales and mins
  (``int4_cpu.quantize_int4`` rounds them before it picks the codes);
* activations: each row quantised per block of 32 to int8 (``a = q * da``, ``da = max|a| / 127``;
  llama.cpp's q8_1, with the block's ``sa = da * sum(q)`` kept so that a Q4_1 block's min term
  is one multiply): ``dot = sum_blocks d * da * sum(code * q) + m * sa``. ``da`` and ``sa`` are
  rounded to float16 as llama.cpp stores them;
* the integer dot products: AVX-512 VNNI (``vpdpbusd``) or AVX-VNNI where the compiler targets
  them, AVX2 (``vpmaddubsw`` + ``vpmaddwd``) else, a plain scalar loop without AVX2; float32
  sums per block; OpenMP threads over spans of output rows. Q4_1 multiplies in tiles of up to
  eight (weight row, activation row) accumulators: 8 activation rows against each weight block
  pair unpacked, or, for 1-4 rows, 2-4 weight rows against each activation pair loaded (so at
  least four independent accumulation chains); the min terms eight blocks a step, and one
  horizontal reduction for the tile's eight sums. A row's result does not depend on the rows
  beside it or the span it is computed in (same additions, same order). Q8_0 takes the
  activation rows four at a time against each weight block read. The Q4_1 and LM head tiles
  of 1-4 activation rows prefetch the weight rows 8 rows ahead (the hardware's prefetchers
  fall behind on a tile's several short rows).

The LM head takes int16 activations instead (``q8_0_matmul(..., int16=True)``: steps of
``max|a_block| / 32767``, ``vpmaddwd`` on sign-extended weights): its argmax often sits on near
ties, which int8 activations flip (SmolLM2's first answer token to "What is the capital of
France?" is 0.08 ahead of the next).

The int8 activations add an error of about ``max|a_block| / 254`` per element (a uniform
rounding error of at most half a step), so results differ from the float reference by that much
times the weights, and greedy tokens may differ from bfloat16-activation paths on near ties.

Built once per machine through ``cpu_decode.compile_library`` (same cache, ``-march=native``).
``RADIXLM_CPU_GEMV=0`` (or ``RADIXLM_CPU_KERNELS=0``, which turns every CPU kernel off) keeps
the torch paths; :func:`disabled` does it for a block of code. ``variant="avx2"`` /
``"scalar"`` build the narrower paths on the same machine (tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from radixlm.kernels.cpu_decode import compile_library
from radixlm.kernels.gguf_cpu_kernels import SOURCE
from radixlm.kernels.switch import KernelSwitch

BLOCK = 32
MAX_ROWS = 16  # activation rows of the one-call int4 decode step (cpu_step.py, int4_step.py)
# Activation rows up to which an int4 model's linear layers and LM head multiply through these
# kernels in a decode forward (forwards with prompt tokens: int4_cpu.PROMPT_ROWS);
# more rows take the layers' float32 dense weights. Measured on the 2-core AVX2 EPYC
# (bench_gguf_cpu against float32 F.linear of the same shapes, 2026-12-07): the step's 120 Q4_1
# GEMVs 31 / 59 / 127 / 255 / 511 ms at 16 / 32 / 64 / 128 / 256 rows against 105 / 124 / 159 /
# 291 / 458 ms dense; the Q8_0 head 24 / 41 / 85 ms at 32 / 64 / 128 rows against 52 / 74 / 94.
MATMUL_ROWS = 128


FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
VARIANTS = {"native": (), "avx2": ("-DRADIXLM_NO_VNNI",), "scalar": ("-DRADIXLM_SCALAR",)}
ISA_NAMES = ("scalar", "AVX2", "AVX-VNNI", "AVX-512 VNNI")

Q4_1_LAYOUT = 1  # the kernels' ``radixlm_q4_1_layout()``: float16 d and m (0: float32, older)

_P, _I = ctypes.c_void_p, ctypes.c_int64
_Q4_ARGS = [_P, _I, _I, _I, _P, _P, _P, _I, _P, ctypes.c_int]
_Q8_ARGS = [_P, _I, _I, _I, _P, _P, _I, _P, ctypes.c_int]
_Q4_SPAN_ARGS = [_P, _I, _I, _I, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int]
_Q8_SPAN_ARGS = [_P, _I, _I, _I, _P, _P, _I, _I, _I, _P, ctypes.c_int]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_switch = KernelSwitch()  # off inside `disabled()` (benchmarks and tests comparing the torch paths)


def _switched_off() -> bool:
    return any(os.environ.get(v, "1") == "0" for v in ("RADIXLM_CPU_KERNELS", "RADIXLM_CPU_GEMV"))


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the entry points' argument and result types on a loaded build of ``SOURCE``."""
    lib.radixlm_gguf_isa.restype = ctypes.c_int
    lib.q4_1_layout = lib.radixlm_q4_1_layout() if hasattr(lib, "radixlm_q4_1_layout") else 0
    lib.q4_1_f32.argtypes = lib.q4_1_bf16.argtypes = _Q4_ARGS
    lib.q8_0_f32.argtypes = lib.q8_0_bf16.argtypes = _Q8_ARGS
    lib.q8_0_x16_f32.argtypes = lib.q8_0_x16_bf16.argtypes = _Q8_ARGS
    for fn in ("q4_1_f32", "q4_1_bf16", "q8_0_f32", "q8_0_bf16", "q8_0_x16_f32", "q8_0_x16_bf16"):
        getattr(lib, fn).restype = None
    if hasattr(lib, "q4_1_span_f32"):  # older builds may lack the one-call step's spans
        lib.q4_1_span_f32.argtypes = _Q4_SPAN_ARGS
        lib.q8_0_x16_span_f32.argtypes = _Q8_SPAN_ARGS
        lib.q4_1_span_f32.restype = lib.q8_0_x16_span_f32.restype = None
    return lib


@contextlib.contextmanager
def library_override(lib: ctypes.CDLL) -> Iterator[None]:
    """Inside the block the native kernels are ``lib``, another build of this module's entry
    points (an older revision's, bound with :func:`bind`: benchmarks compare the two in one
    engine). Its Q4_1 weights must be laid out as this module packs them (``Q4_1_LAYOUT``).
    Not thread-safe against other callers of :func:`library`."""
    if getattr(lib, "q4_1_layout", 0) != Q4_1_LAYOUT:
        raise ValueError("that build takes another Q4_1 layout than pack_q4_1 gives")
    library()  # the native build exists before it is set aside
    saved = _libs["native"]
    _libs["native"] = lib
    try:
        yield
    finally:
        _libs["native"] = saved


def library(variant: str = "native") -> ctypes.CDLL | None:
    """The kernels built for ``variant`` (see ``VARIANTS``), on first use; None where they
    cannot be built or are switched off by the environment."""
    if variant in _libs:
        return _libs[variant]
    with _lock:
        if variant not in _libs:
            lib = None
            if not _switched_off():
                try:
                    lib = compile_library("radixlm_gguf", SOURCE, FLAGS + VARIANTS[variant])
                except OSError:
                    lib = None
            _libs[variant] = None if lib is None else bind(lib)
    return _libs[variant]


def isa(variant: str = "native") -> str:
    """The dot-product path ``variant``'s build runs on this machine ("" where not built)."""
    lib = library(variant)
    return "" if lib is None else ISA_NAMES[lib.radixlm_gguf_isa()]


def available() -> bool:
    """Whether the kernels are built, loaded and on (the first call builds them)."""
    return _switch.is_on and library() is not None


def disabled() -> contextlib.AbstractContextManager[None]:
    """Inside the block :func:`available` is False: the int4 layers and the LM head take their
    torch paths (benchmarks and tests compare both in one process)."""
    return _switch.disabled()


_matmul_rows: contextvars.ContextVar[int] = contextvars.ContextVar("gguf_matmul_rows")


def matmul_rows() -> int:
    """The row limit :func:`serves` applies now (``MATMUL_ROWS`` outside :func:`rows_limit`)."""
    return _matmul_rows.get(MATMUL_ROWS)


@contextlib.contextmanager
def rows_limit(rows: int) -> Iterator[None]:
    """Inside the block (this thread's context) :func:`serves` takes at most ``rows`` rows: the
    model runner keeps forwards with prompt tokens to ``int4_cpu.PROMPT_ROWS``, benchmarks
    compare limits."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    token = _matmul_rows.set(rows)
    try:
        yield
    finally:
        _matmul_rows.reset(token)


def serves(x: torch.Tensor, rows: int) -> bool:
    """Whether the kernels take ``rows`` rows of activations like ``x`` (CPU, float32 or
    bfloat16, at most :func:`matmul_rows` rows)."""
    return (
        rows <= matmul_rows()
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and available()
    )


class Q4_1(NamedTuple):
    codes: torch.Tensor  # [N, K / 2] uint8: per block of 32, byte i = code i | code (i + 16) << 4
    d: torch.Tensor  # [N, K / 32] float16
    m: torch.Tensor  # [N, K / 32] float16


class Q8_0(NamedTuple):
    codes: torch.Tensor  # [N, K] int8, -127..127
    d: torch.Tensor  # [N, K / 32] float32


def pack_q4_1(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4_1:
    """GGUF's Q4_1 block layout from codes ``[N, K]`` (0..15) and per-32 scales and mins
    (rounded to float16: exact for float16 values, as ``int4_cpu.quantize_int4`` gives)."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or mins.shape != scales.shape:
        raise ValueError(f"Q4_1 needs K divisible by {BLOCK} and one scale and min per block")
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)
    return Q4_1(
        packed.reshape(n, k // 2).contiguous(),
        scales.half().contiguous(),
        mins.half().contiguous(),
    )


def quantize_q8_0(weight: torch.Tensor) -> Q8_0:
    """GGUF's Q8_0 of ``weight`` ``[N, K]``: ``d = max|w_block| / 127``, codes rounded. For a
    weight dequantized from Q8_0 this recovers the file's codes."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs K divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    codes = (blocks * inv[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return Q8_0(codes.reshape(n, k).contiguous(), d.contiguous())


def dequantize_q8_0(q: Q8_0) -> torch.Tensor:
    n, k = q.codes.shape
    return (q.codes.float().reshape(n, k // BLOCK, BLOCK) * q.d[..., None]).reshape(n, k)


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"activations must be [M, {k}] with a contiguous last dim")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activations must be float32 or bfloat16, got {x.dtype}")


def q4_1_matmul(x: torch.Tensor, w: Q4_1, variant: str = "native") -> torch.Tensor:
    """``x`` ``[M, K]`` (rows may be strided) times the Q4_1 weight ``[N, K]`` transposed:
    ``[M, N]`` float32."""
    lib = library(variant)
    assert lib is not None
    n, k = w.codes.shape[0], w.codes.shape[1] * 2
    _check(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    fn = lib.q4_1_f32 if x.dtype == torch.float32 else lib.q4_1_bf16
    fn(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        k,
        w.codes.data_ptr(),
        w.d.data_ptr(),
        w.m.data_ptr(),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def q8_0_matmul(
    x: torch.Tensor, w: Q8_0, variant: str = "native", int16: bool = False
) -> torch.Tensor:
    """``x`` ``[M, K]`` times the Q8_0 weight ``[N, K]`` transposed: ``[M, N]`` float32.
    ``int16``: activations quantised to int16 per block (``max|a| / 32767`` steps) instead of
    int8, for the LM head."""
    lib = library(variant)
    assert lib is not None
    n, k = w.codes.shape
    _check(x, k)
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    if int16:
        fn = lib.q8_0_x16_f32 if x.dtype == torch.float32 else lib.q8_0_x16_bf16
    else:
        fn = lib.q8_0_f32 if x.dtype == torch.float32 else lib.q8_0_bf16
    fn(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        k,
        w.codes.data_ptr(),
        w.d.data_ptr(),
        n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """The float values the kernels multiply for ``x`` ``[M, K]`` (float32): per-32-block int8
    codes times float16-rounded scales (the reference for tests)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    return (q * d.half().float()[..., None]).reshape(m, k)
