"""C++/OpenMP kernels for the CPU forward: rope in place, and paged decode attention.

On a CPU each torch op costs about a microsecond or more to issue from Python, and decode
attention through torch ops costs one SDPA call per request per layer plus a gather copy of every
request's cached K/V. Two small kernels replace those paths:

* :func:`rope_inplace` rotates the q and k columns of the QKV projection's output in place
  (neox halves, the same rounding as torch's ops: ``x * cos`` rounded, then one fused
  multiply-add of ``swap(x) * signed_sin``, as ``torch.addcmul``), one call instead of eight ops
  per layer;
* :func:`rmsnorm` adds the residual and normalises rows (float32) in one call instead of the
  add and rms_norm's seven ops, and :func:`silu_and_mul` the gated MLP's activation; both round
  as torch's float32 CPU ops do, bit for bit: the sum of squares in the order of torch's sum
  kernel (vectors of 8, four partial sums, a cascade of levels of 16), silu's exp as SLEEF's
  ``expf_u10`` over torch's vector steps and the C library's ``expf`` on each row's rest
  (:func:`silu_vec`);
* :func:`decode_attention` writes the new tokens' K/V into the layer's pool buffers and computes
  every request's attention in one call per layer: OpenMP threads over (request, KV head), each
  reading its request's keys in place through the ``req_to_token`` row (no gather copy), all the
  GQA group's query heads per key row, float32 sums, an exact two-pass softmax. On CPUs with
  AVX2 and FMA, float32 pools with a head dim that is a multiple of 8 take a vector version
  (``attend_item_avx2``: fused multiply-adds, a polynomial exp within about 2e-7 relative, the
  next key rows prefetched through the page table, V summed in registers 64 dims at a time),
  about twice as fast (``srt/bench/bench_cpu_attention.py``; docs/results/cpu.md).

The source is compiled once per machine with the system's C++ compiler (``c++ -O3
-march=native -fopenmp``, about a second) into ``$RADIXLM_CACHE_DIR`` (default
``~/.cache/radixlm``)/cpu_kernels, keyed by the source, the flags and the CPU's feature flags, and
loaded with ctypes (no torch headers, no Python extension module). It links the OpenMP runtime by
its soname, so it shares torch's thread pool (the library torch loaded first); the thread count is
torch's (``torch.get_num_threads()``), passed on every call. Where no compiler is found or the
build fails, :func:`available` is False and the callers keep their torch paths;
``RADIXLM_CPU_KERNELS=0`` turns the kernels off.

Tensors: float32 or bfloat16, the last dim contiguous; index tensors int64 and contiguous.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from radixlm.kernels.cpu_decode_kernels import SOURCE
from radixlm.kernels.switch import KernelSwitch

logger = logging.getLogger(__name__)


# -ffp-contract=off: fused multiply-adds only where written (std::fma), so that rope rounds as
# torch's ops do
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_ROPE_ARGS = [_P, _I, _I, _I, _I, _P, _P, _I, ctypes.c_int]
_DECODE_ARGS = [_P, _I, _P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I]
_DECODE_ARGS += [ctypes.c_float, _I, ctypes.c_int]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_switch = KernelSwitch()  # off inside `disabled()` (benchmarks and tests comparing the torch paths)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    base = os.environ.get("RADIXLM_CACHE_DIR") or os.path.join("~", ".cache", "radixlm")
    return Path(base).expanduser() / "cpu_kernels"


def compile_library(stem: str, source: str, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` into the cache (once per source, flags and CPU) and
    loaded; None where no compiler is found or the build fails (logged). The CPU kernel modules
    share it (``gguf_cpu.py`` builds its GEMVs here too)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        logger.info("no C++ compiler found: the CPU forward keeps its torch paths")
        return None
    key = hashlib.sha256("\n".join([source, *flags, _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{stem}_{key}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{stem}.cpp"
            src.write_text(source)
            out = Path(tmp) / target.name
            proc = subprocess.run(
                [compiler, *flags, str(src), "-o", str(out)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                logger.warning("building %s failed (torch paths kept): %s", stem, proc.stderr)
                return None
            os.replace(out, target)  # atomic: concurrent builders each write a whole file
    return ctypes.CDLL(str(target))


def _build() -> ctypes.CDLL | None:
    lib = compile_library("radixlm_cpu", SOURCE, FLAGS)
    if lib is None:
        return None
    lib.rope_f32.argtypes = lib.rope_bf16.argtypes = _ROPE_ARGS
    lib.decode_f32.argtypes = lib.decode_bf16.argtypes = _DECODE_ARGS
    lib.rope_f32.restype = lib.rope_bf16.restype = None
    lib.rmsnorm_f32.argtypes = [_P, _P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int]
    lib.rmsnorm_f32.restype = None
    lib.silu_mul_f32.argtypes = [_P, _P, _I, _I, _I, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.decode_f32.restype = lib.decode_bf16.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first use; None where they cannot be built or are off."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("RADIXLM_CPU_KERNELS", "1") != "0":
                try:
                    _lib = _build()
                except OSError as e:
                    logger.warning("the CPU kernels could not be loaded (torch paths kept): %s", e)
            _tried = True
    return _lib


def available() -> bool:
    """Whether the kernels are built, loaded and on (the first call builds them)."""
    return _switch.is_on and library() is not None


def disabled() -> contextlib.AbstractContextManager[None]:
    """Inside the block :func:`available` is False: callers take their torch paths (the same
    process can time or check both; the cpu attention backend then decodes as torch does)."""
    return _switch.disabled()


def serves(x: torch.Tensor) -> bool:
    """Whether the kernels take tensors like ``x``: CPU, float32 or bfloat16, kernels built."""
    return x.device.type == "cpu" and x.dtype in DTYPES and available()


def rope_inplace(
    x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates the first ``heads`` heads of each row of ``x`` ``[T, >= heads * head_dim]`` (rows
    may be strided, the last dim contiguous) in place. ``cos``/``sin``: ``[T, 1, head_dim]`` in
    x's dtype, as ``RotaryEmbedding.cos_sin`` gives them (cos twice, signed sin)."""
    lib = library()
    assert lib is not None and x.stride(-1) == 1 and cos.stride() == sin.stride()
    fn = lib.rope_f32 if x.dtype == torch.float32 else lib.rope_bf16
    fn(
        x.data_ptr(),
        x.shape[0],
        x.stride(0),
        heads,
        head_dim,
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        torch.get_num_threads(),
    )


def serves_norm(x: torch.Tensor) -> bool:
    """Whether :func:`rmsnorm` takes ``x``: 2-D contiguous float32 on the CPU, kernels on."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.is_contiguous()
        and available()
    )


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual) * weight, x + residual)`` in one call (``residual`` None: ``(norm(x)
    * weight, x)``); ``x``, ``residual`` ``[T, D]`` contiguous float32, ``weight`` ``[D]``."""
    lib = library()
    assert lib is not None and weight.dtype == torch.float32 and weight.is_contiguous()
    rows, d = x.shape
    out = torch.empty_like(x)
    summed = x
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        summed = torch.empty_like(x)
    lib.rmsnorm_f32(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        None if residual is None else summed.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        rows,
        d,
        eps,
        torch.get_num_threads(),
    )
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` ``[T, 2n]`` contiguous float32 (:func:`serves_norm`
    says which tensors), one call instead of chunk, silu and mul."""
    lib = library()
    assert lib is not None and x.dim() == 2 and x.is_contiguous()
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, n), dtype=x.dtype)
    lib.silu_mul_f32(x.data_ptr(), out.data_ptr(), rows, n, silu_vec(), torch.get_num_threads())
    return out


def silu_vec() -> int:
    """The elements per step of torch's vectorised float32 silu on this CPU (two vectors: 32
    floats with AVX-512, 16 with AVX2; 0 where it has no SLEEF exp): the silu kernel rounds as
    torch does by taking SLEEF's exp over those steps and the C library's on each row's rest."""
    return {"AVX512": 32, "AVX2": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


class DecodeBatch:
    """A decode batch's index tensors, held for the step's layers (:func:`decode_attention`):
    ``req_to_token`` ``[R, C]``, ``req_slots``, ``seq_lens`` and ``out_slots`` ``[B]``, int64."""

    def __init__(
        self,
        req_to_token: torch.Tensor,
        req_slots: torch.Tensor,
        seq_lens: torch.Tensor,
        out_slots: torch.Tensor,
    ):
        tensors = (req_to_token, req_slots, seq_lens, out_slots)
        if any(t.dtype != torch.int64 or t.device.type != "cpu" for t in tensors):
            raise ValueError("decode index tensors must be int64 CPU tensors")
        self._keep = tuple(t.contiguous() for t in tensors[1:])  # alive while the step runs
        self.batch = int(req_slots.shape[0])
        if req_to_token.stride(1) != 1:
            raise ValueError("req_to_token rows must be contiguous")
        self.table = (req_to_token.data_ptr(), req_to_token.stride(0))
        self._table_ref = req_to_token
        self.ptrs = tuple(t.data_ptr() for t in self._keep)  # req_slots, seq_lens, out_slots


def decode_attention(
    batch: DecodeBatch,
    q: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    num_heads: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Writes ``k_new``/``v_new`` ``[B, kv_heads * d]`` (None: already written) at the batch's
    out slots of ``k_buf``/``v_buf`` ``[slots, kv_heads, d]``, then returns the attention of
    ``q`` ``[B, num_heads * d]`` (rows may be strided) over each request's ``seq_len`` cached
    tokens (its last ``window`` ones when ``window`` > 0): ``[B, num_heads * d]`` in q's dtype."""
    lib = library()
    assert lib is not None
    _, kv_heads, d = k_buf.shape
    if q.stride(-1) != 1 or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError("decode_attention needs contiguous pool buffers and q's last dim")
    if k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
        raise ValueError(f"the pool's dtype {k_buf.dtype} must be q's ({q.dtype})")
    k_stride = v_stride = 0
    if k_new is not None:
        assert v_new is not None and k_new.stride(-1) == 1 and v_new.stride(-1) == 1
        k_stride, v_stride = k_new.stride(0), v_new.stride(0)
    out = torch.empty((batch.batch, num_heads * d), dtype=q.dtype)
    fn = lib.decode_f32 if q.dtype == torch.float32 else lib.decode_bf16
    req_slots, seq_lens, out_slots = batch.ptrs
    fn(
        batch.table[0],
        batch.table[1],
        req_slots,
        seq_lens,
        out_slots,
        batch.batch,
        q.data_ptr(),
        q.stride(0),
        None if k_new is None else k_new.data_ptr(),
        None if v_new is None else v_new.data_ptr(),
        k_stride,
        v_stride,
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        out.data_ptr(),
        num_heads,
        kv_heads,
        d,
        scale,
        window,
        torch.get_num_threads(),
    )
    return out
