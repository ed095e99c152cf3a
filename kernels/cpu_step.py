"""A whole decode step of an int4 Llama-family model on the CPU in one C++ call.

At batch 1 a CPU decode step of a small model is mostly fixed costs: for each of SmolLM2's 30
layers about a dozen Python calls, torch ops and output buffers around the C++ kernels, and one
OpenMP parallel region per kernel (each waking the pool). This kernel runs every layer of a
decode batch (1..``gguf_cpu.MAX_ROWS`` rows) in one parallel region:

    add + RMSNorm, QKV Q4_1 GEMV, rope, K/V write + paged attention, o GEMV,
    add + RMSNorm, gate/up GEMV, silu * mul, down GEMV        (per layer)
    add + final RMSNorm                                       (then the LM head, as before)

It adds no arithmetic of its own: every stage is the existing kernel's code
(``cpu_decode.py``'s rope, attention, add+RMSNorm and silu*mul, ``gguf_cpu.py``'s Q4_1 GEMV),
called through the ``*_rows_f32`` entry points those libraries export for a caller's parallel
region (their loops are orphaned ``omp for``s: the team shares each stage, with a barrier after
it). So the step's results equal those kernels called one by one, bit for bit; they differ from
the layer-by-layer path of an int4 model only where that path uses torch ops instead (its
RMSNorm and silu * mul: float32 ulps).

Buffers: the caller owns them (:class:`Int4DecodeStep` keeps one scratch tensor per batch
size); nothing is allocated per step but the hidden state's output. ``RADIXLM_CPU_STEP=0``, or
either library switched off (``RADIXLM_CPU_KERNELS=0``, ``RADIXLM_CPU_GEMV=0``), keeps the
layer-by-layer path; :func:`disabled` does it for a block of code (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from radixlm.kernels import cpu_decode, gguf_cpu

SOURCE = r"""
#include <cstdint>

namespace {

using Q41Fn = void (*)(const float*, int64_t, int64_t, int64_t, const uint8_t*, const float*,
                       const float*, int64_t, float*);
using RopeFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*,
                        int64_t);
using DecodeFn = void (*)(const void*, const float*, const float*, const float*, float*, float*,
                          float*);
using NormFn = void (*)(const float*, const float*, float*, float*, const float*, int64_t,
                        int64_t, float);
using SiluFn = void (*)(const float*, float*, int64_t, int64_t, int64_t);

struct Kernels {  // the libraries' *_rows_f32 entry points
  Q41Fn q4_1;
  RopeFn rope;
  DecodeFn attend;
  NormFn norm;
  SiluFn silu;
};

struct Q4 {  // a Q4_1 weight [n, k]
  const uint8_t* codes;
  const float* d;
  const float* m;
  int64_t n;
};

struct Layer {  // one row of the layer table (int64 fields, filled by cpu_step.py)
  const float* norm1;
  const float* norm2;
  Q4 qkv, o, gate_up, down;
  float* k_buf;
  float* v_buf;
  int64_t window;
};

struct DecodeArgs {  // cpu_decode.py's, field for field
  const int64_t* table;
  int64_t table_stride;
  const int64_t* req_slots;
  const int64_t* seq_lens;
  const int64_t* out_slots;
  int64_t batch;
  int64_t q_stride, k_stride, v_stride;
  int64_t heads, kv_heads, d;
  float scale;
  int64_t window;
};

struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  int64_t silu_vec;  // cpu_decode.silu_vec()
};

void q4(const Kernels& f, const float* x, int64_t m, int64_t k, const Q4& w, float* out) {
  f.q4_1(x, m, k, k, w.codes, w.d, w.m, w.n, out);
}

}  // namespace

extern "C" {

int radixlm_step_abi_version() { return 1; }

// residual [B, hidden]: the embeddings in, the last layer's residual stream out; x: scratch
// of B * (3 * hidden + qkv + heads * head_dim + 3 * inter) floats; out [B, hidden]: the final
// norm's output. idx: the batch's (table, table stride, req_slots, seq_lens, out_slots).
void decode_step_f32(const Kernels* f, const Layer* layers, int64_t num_layers,
                     const int64_t* idx, int64_t batch, const float* cos, const float* sin,
                     int64_t cs_stride, float* residual, float* scratch, const float* final_norm,
                     float* out, const Dims* dims, float eps, float scale, int threads) {
  const int64_t D = dims->hidden, hd = dims->head_dim;
  const int64_t q_size = dims->heads * hd, kv_size = dims->kv_heads * hd;
  const int64_t qkv_size = q_size + 2 * kv_size, B = batch;
  float* x = scratch;  // the stage's output that the next add + norm takes
  float* hn = x + B * D;  // normalised rows, a GEMV's input
  float* qkv = hn + B * D;
  float* att = qkv + B * qkv_size;
  float* gu = att + B * q_size;
  float* act = gu + B * 2 * dims->inter;
  DecodeArgs a{reinterpret_cast<const int64_t*>(idx[0]), idx[1],
               reinterpret_cast<const int64_t*>(idx[2]), reinterpret_cast<const int64_t*>(idx[3]),
               reinterpret_cast<const int64_t*>(idx[4]), B, qkv_size, qkv_size, qkv_size,
               dims->heads, dims->kv_heads, hd, scale, 0};
  #pragma omp parallel num_threads(threads) firstprivate(a)
  {
    for (int64_t l = 0; l < num_layers; ++l) {
      const Layer& L = layers[l];
      if (l == 0) f->norm(residual, nullptr, nullptr, hn, L.norm1, B, D, eps);
      else f->norm(x, residual, residual, hn, L.norm1, B, D, eps);
      q4(*f, hn, B, D, L.qkv, qkv);
      f->rope(qkv, B, qkv_size, dims->heads + dims->kv_heads, hd, cos, sin, cs_stride);
      a.window = L.window;
      f->attend(&a, qkv, qkv + q_size, qkv + q_size + kv_size, L.k_buf, L.v_buf, att);
      q4(*f, att, B, q_size, L.o, x);
      f->norm(x, residual, residual, hn, L.norm2, B, D, eps);
      q4(*f, hn, B, D, L.gate_up, gu);
      f->silu(gu, act, B, dims->inter, dims->silu_vec);
      q4(*f, act, B, dims->inter, L.down, x);
    }
    f->norm(x, residual, residual, out, final_norm, B, D, eps);
  }
}

}  // extern "C"
"""

FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_STEP_ARGS = [_P, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, ctypes.c_float]
_STEP_ARGS += [ctypes.c_float, ctypes.c_int]
_ENTRY_POINTS = (  # the Kernels struct's fields, in order
    (gguf_cpu, "q4_1_rows_f32"),
    (cpu_decode, "rope_rows_f32"),
    (cpu_decode, "decode_rows_f32"),
    (cpu_decode, "rmsnorm_rows_f32"),
    (cpu_decode, "silu_mul_rows_f32"),
)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib", "kernels" once built (None where not)
_enabled = True


def _build() -> tuple[ctypes.CDLL, torch.Tensor] | None:
    libs = {gguf_cpu: gguf_cpu.library(), cpu_decode: cpu_decode.library()}
    if any(lib is None for lib in libs.values()):
        return None
    lib = cpu_decode.compile_library("radixlm_step", SOURCE, FLAGS)
    if lib is None:
        return None
    lib.decode_step_f32.argtypes = _STEP_ARGS
    lib.decode_step_f32.restype = None
    addresses = [ctypes.cast(getattr(libs[m], name), _P).value for m, name in _ENTRY_POINTS]
    return lib, torch.tensor(addresses, dtype=torch.int64)


def _library() -> tuple[ctypes.CDLL, torch.Tensor] | None:
    if "built" not in _state:
        with _lock:
            if "built" not in _state:
                built = None
                if os.environ.get("RADIXLM_CPU_STEP", "1") != "0":
                    try:
                        built = _build()
                    except OSError:
                        built = None
                _state["built"] = built
    return _state["built"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the step is built, loaded and on, with both kernel libraries it calls."""
    return _enabled and cpu_decode.available() and gguf_cpu.available() and _library() is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside the block :func:`available` is False: models run layer by layer."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the step reads them."""

    input_norm: torch.Tensor  # [hidden] float32
    post_attention_norm: torch.Tensor  # [hidden] float32
    qkv: gguf_cpu.Q4_1  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o: gguf_cpu.Q4_1  # [hidden, heads * head_dim]
    gate_up: gguf_cpu.Q4_1  # [2 * inter, hidden]: gate rows, then up rows
    down: gguf_cpu.Q4_1  # [hidden, inter]
    window: int  # sliding window (0: none)


class Dims(NamedTuple):
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int


class Int4DecodeStep:
    """The decoder stack of one model for decode batches: built once from its weights, then
    :meth:`bind_pool` per KV pool and :meth:`run` per step."""

    def __init__(
        self,
        layers: Sequence[LayerWeights],
        final_norm: torch.Tensor,
        dims: Dims,
        eps: float,
        scale: float,
    ):
        self._check(layers, final_norm, dims)
        self.dims, self.eps, self.scale = dims, eps, scale
        self._layers = list(layers)  # keeps the weights the table points at alive
        self._final_norm = final_norm
        self._table = self._weight_table()  # [L, 21] int64; K/V columns set by bind_pool
        self._dims = torch.tensor([*dims, cpu_decode.silu_vec()], dtype=torch.int64)
        self._pool: tuple[torch.Tensor, ...] = ()
        self._scratch: dict[int, torch.Tensor] = {}  # batch rows -> scratch floats

    @staticmethod
    def _check(layers: Sequence[LayerWeights], final_norm: torch.Tensor, dims: Dims) -> None:
        qkv_rows = (dims.heads + 2 * dims.kv_heads) * dims.head_dim
        shapes = {"qkv": (qkv_rows, dims.hidden), "o": (dims.hidden, dims.heads * dims.head_dim)}
        shapes |= {"gate_up": (2 * dims.inter, dims.hidden), "down": (dims.hidden, dims.inter)}
        for w in layers:
            norms = (w.input_norm, w.post_attention_norm, final_norm)
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms):
                raise ValueError("the step's norm weights must be contiguous float32")
            for name, (n, k) in shapes.items():
                q = getattr(w, name)
                if q.codes.shape != (n, k // 2) or not q.codes.is_contiguous():
                    raise ValueError(f"{name}: a Q4_1 weight of [{n}, {k}] expected")

    def _weight_table(self) -> torch.Tensor:
        rows = []
        for w in self._layers:
            row = [w.input_norm.data_ptr(), w.post_attention_norm.data_ptr()]
            for q in (w.qkv, w.o, w.gate_up, w.down):
                row += [q.codes.data_ptr(), q.d.data_ptr(), q.m.data_ptr(), q.codes.shape[0]]
            rows.append([*row, 0, 0, w.window])
        return torch.tensor(rows, dtype=torch.int64)

    def bind_pool(self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]):
        """Points the step at a KV pool's per-layer buffers ``[slots, kv_heads, head_dim]``
        float32 (kept alive while bound)."""
        shape = (self.dims.kv_heads, self.dims.head_dim)
        for buf in (*k_buffers, *v_buffers):
            if buf.dtype != torch.float32 or not buf.is_contiguous() or buf.shape[1:] != shape:
                raise ValueError(f"the pool's buffers must be contiguous float32 [*, {shape}]")
        self._table[:, 18] = torch.tensor([b.data_ptr() for b in k_buffers])
        self._table[:, 19] = torch.tensor([b.data_ptr() for b in v_buffers])
        self._pool = (*k_buffers, *v_buffers)

    def _scratch_for(self, rows: int) -> torch.Tensor:
        buf = self._scratch.get(rows)
        if buf is None:
            d = self.dims
            per_row = 3 * d.hidden + (d.heads + 2 * d.kv_heads) * d.head_dim
            per_row += d.heads * d.head_dim + 3 * d.inter
            buf = self._scratch[rows] = torch.empty(rows * per_row, dtype=torch.float32)
        return buf

    def run(
        self,
        residual: torch.Tensor,
        batch: cpu_decode.DecodeBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Every layer for the batch's rows, then the final norm: ``residual`` ``[B, hidden]``
        contiguous float32 (the embeddings; overwritten with the residual stream) -> the final
        norm's output ``[B, hidden]``. ``cos``/``sin``: ``RotaryEmbedding.cos_sin`` of the
        batch's positions (float32); ``batch``: its indices, as the attention kernel takes them.
        Writes the new tokens' K/V into the bound pool."""
        if not self._pool:
            raise RuntimeError("bind_pool first")
        lib, kernels = _library()  # type: ignore[misc]
        rows = residual.shape[0]
        if not (
            residual.dtype == torch.float32
            and residual.is_contiguous()
            and rows == batch.batch
            and 0 < rows <= gguf_cpu.MAX_ROWS
            and residual.shape[1] == self.dims.hidden
        ):
            raise ValueError(f"residual must be [1..{gguf_cpu.MAX_ROWS}, hidden] float32")
        out = torch.empty_like(residual)
        idx = torch.tensor([batch.table[0], batch.table[1], *batch.ptrs], dtype=torch.int64)
        lib.decode_step_f32(
            kernels.data_ptr(),
            self._table.data_ptr(),
            self._table.shape[0],
            idx.data_ptr(),
            rows,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(0),
            residual.data_ptr(),
            self._scratch_for(rows).data_ptr(),
            self._final_norm.data_ptr(),
            out.data_ptr(),
            self._dims.data_ptr(),
            self.eps,
            self.scale,
            torch.get_num_threads(),
        )
        return out
