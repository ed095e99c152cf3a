"""A whole decode step of an int4 Llama-family model on the CPU in one C++ call.

At batch 1 a CPU decode step of a small model is mostly fixed costs: for each of SmolLM2's 30
layers about a dozen Python calls, torch ops and output buffers around the C++ kernels, and one
OpenMP parallel region per kernel (each waking the pool, each a barrier that a descheduled
thread holds up on a busy machine). This kernel runs every layer of a decode batch
(1..``gguf_cpu.MAX_ROWS`` rows) and the final norm in one parallel region:

    add + RMSNorm, QKV Q4_1 GEMV, rope + K/V write + paged attention, o GEMV,
    add + RMSNorm, gate/up GEMV, silu * mul, down GEMV        (per layer)
    add + final RMSNorm, the Q8_0 LM head (int4 mode's, where given)

Stages: the GEMVs (in chunks of 32 output rows), the attention's (request, KV head) items, the
final norm's rows and the head's rows (chunks of 512) are taken chunk by chunk by whichever
thread is running, once the stage before is complete: each thread first the chunks of its own
region of the stage (its share, in order: one stream of weight rows), then any left in the
others' regions; the norms (and silu * mul
of 1-2 rows) that feed a GEMV run in each thread that takes a chunk of it, on its own copy (as
does the activations' int8 quantisation); silu * mul of more rows is a stage of its own. So
there are no barriers: a thread the OS has descheduled holds the others up only while it holds
a chunk.

It adds no arithmetic of its own: every piece is the existing kernels' code (``cpu_decode.py``'s
rope, attention, add+RMSNorm and silu*mul, ``gguf_cpu.py``'s Q4_1 GEMV) through entry points
that run one item, row or span of rows on the calling thread. Its results equal those kernels
called one by one, bit for bit, and so the layer-by-layer int4 path's (whose torch RMSNorm and
silu round as those kernels do).

Buffers: the caller owns them (:class:`Int4DecodeStep` keeps one scratch tensor per batch size
and thread count); nothing is allocated per step but the output. ``RADIXLM_CPU_STEP=0``, or
either library switched off (``RADIXLM_CPU_KERNELS=0``, ``RADIXLM_CPU_GEMV=0``), keeps the
layer-by-layer path; :func:`disabled` does it for a block of code (benchmarks, tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixlm.kernels import cpu_decode, cpu_decode_kernels, gguf_cpu
from radixlm.kernels.switch import KernelSwitch

SOURCE = (
    r"""
#include <omp.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RADIXLM_PAUSE() _mm_pause()
#else
#define RADIXLM_PAUSE() ((void)0)
#endif

namespace {

using SpanFn = void (*)(const float*, int64_t, int64_t, int64_t, const uint8_t*,
                        const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*, int);
using ItemFn = void (*)(const void*, int64_t, float*, const float*, const float*, int64_t,
                        float*, float*, float*);
using NormFn = void (*)(const float*, const float*, float*, float*, const float*, int64_t, float);
using SiluFn = void (*)(const float*, float*, int64_t, int64_t);
using HeadFn = void (*)(const float*, int64_t, int64_t, int64_t, const int8_t*, const float*,
                        int64_t, int64_t, int64_t, float*, int);

struct Kernels {  // the libraries' entry points, each run by the calling thread alone
  SpanFn q4_1;  // output rows [j0, j1) of a Q4_1 GEMV
  ItemFn attend;  // one (request, KV head) item: rope, K/V write, attention
  NormFn norm;  // one row of add + RMSNorm
  SiluFn silu;  // one row of silu * mul
  HeadFn head;  // output rows [j0, j1) of the Q8_0 LM head (int16 activations)
};

struct Head {  // the LM head's Q8_0 weight [vocab, hidden]; codes null: no head in the step
  const int8_t* codes;
  const float* d;
  int64_t vocab;
};

struct Q4 {  // a Q4_1 weight [n, k]: codes, float16 scales and mins
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
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

"""
    + cpu_decode_kernels.DECODE_ARGS
    + r"""
struct Dims {
  int64_t hidden, heads, kv_heads, head_dim, inter;
  int64_t silu_vec;  // cpu_decode.silu_vec()
};

// The step is a sequence of stages (5 or 6 per layer, then the final norm), each cut into chunks
// (GEMV output rows, attention items, rows) that any thread takes once the stage before is
// complete. A thread the OS has descheduled holds the others up only while it holds a chunk (an
// OpenMP barrier per stage would wait for it at every stage). The chunks of a stage are split
// into one region per thread, each with its own counter: a thread takes the chunks of its own
// region first, in order, so its weight rows are one stream the prefetchers follow, then those
// left in the others' regions.
struct alignas(64) Stage {
  std::atomic<int64_t> done{0};
};
struct alignas(64) Region {
  std::atomic<int64_t> taken{0};  // chunks of the region handed out
};

constexpr int64_t GEMV_CHUNK = 32;  // output rows per chunk
constexpr int64_t HEAD_CHUNK = 512;  // LM head rows (vocabulary entries) per chunk
// up to this many rows each thread computes silu * mul itself before its first chunk of the
// down GEMV; more rows are a stage of their own (the rows' work shared, one wait more)
constexpr int64_t PRIVATE_SILU_ROWS = 2;

struct Shared {
  const Kernels* f;
  const Layer* layers;
  int64_t num_layers;
  const Dims* dims;
  DecodeArgs args;
  const float* cos;
  const float* sin;
  int64_t cs_stride;
  float eps;
  int64_t B;
  float* res[2];  // [B, hidden] the residual stream, read from one and written to the other
  float* x;  // [B, hidden] the last GEMV's output
  float* qkv;
  float* att;
  float* gate_up;
  float* act;  // [B, inter] silu * mul (more than PRIVATE_SILU_ROWS rows)
  float* out;
  const float* final_norm;
  Head head;
  float* logits;  // [B, vocab]
  Stage* stages;
  Region* regions;  // [stages, threads]
  int threads;  // regions a stage has (the threads asked for; the team may be smaller)
};

// one thread's walk through the stages; `own_sum` and `own` are its private rows
class Walker {
 public:
  Walker(const Shared& sh, float* own_sum, float* own, int me)
      : sh_(sh), own_sum_(own_sum), own_(own), me_(me % sh.threads) {}

  void run() {
    const Dims& dm = *sh_.dims;
    const int64_t D = dm.hidden, q_size = dm.heads * dm.head_dim;
    for (int64_t l = 0; l < sh_.num_layers; ++l) {
      const Layer& L = sh_.layers[l];
      gemv(L.qkv, D, sh_.qkv, own_, [&] { add_norm(L.norm1, l == 0); }, l > 0);
      DecodeArgs a = sh_.args;
      a.window = L.window;
      stage(sh_.B * dm.kv_heads, [] {}, [&](int64_t it, bool) {
        sh_.f->attend(&a, it, sh_.qkv, sh_.cos, sh_.sin, sh_.cs_stride, L.k_buf, L.v_buf,
                      sh_.att);
      });
      gemv(L.o, q_size, sh_.x, sh_.att, [] {}, false);
      gemv(L.gate_up, D, sh_.gate_up, own_, [&] { add_norm(L.norm2, false); }, true);
      if (sh_.B <= PRIVATE_SILU_ROWS) {  // each thread takes the few rows itself
        gemv(L.down, dm.inter, sh_.x, own_, [&] { silu(own_); }, false);
      } else {  // a stage of its own, a row per chunk, into the shared rows
        stage(sh_.B, [] {}, [&](int64_t b, bool) { silu_row(b, sh_.act); });
        gemv(L.down, dm.inter, sh_.x, sh_.act, [] {}, false);
      }
    }
    stage(sh_.B, [] {}, [&](int64_t b, bool) {  // the final norm, a row per chunk
      sh_.f->norm(sh_.x + b * D, sh_.res[cur_] + b * D, own_sum_ + b * D, sh_.out + b * D,
                  sh_.final_norm, D, sh_.eps);
    });
    const Head& h = sh_.head;
    if (h.codes == nullptr) return;
    stage((h.vocab + HEAD_CHUNK - 1) / HEAD_CHUNK, [] {}, [&](int64_t c, bool fresh) {
      const int64_t j0 = c * HEAD_CHUNK, j1 = j0 + HEAD_CHUNK < h.vocab ? j0 + HEAD_CHUNK : h.vocab;
      sh_.f->head(sh_.out, sh_.B, D, D, h.codes, h.d, h.vocab, j0, j1, sh_.logits, fresh ? 1 : 0);
    });
  }

 private:
  // stage `next_` in `chunks` chunks: waits for the previous stage, then takes chunks;
  // prepare() runs before this thread's first chunk, work(c, first) does chunk c
  template <typename Prep, typename Work>
  void stage(int64_t chunks, Prep prepare, Work work) {
    if (next_ > 0) wait(sh_.stages[next_ - 1], last_chunks_);
    Stage& st = sh_.stages[next_];
    bool ready = false;
    const int T = sh_.threads;
    for (int k = 0; k < T; ++k) {  // the own region first, then the others'
      const int r = (me_ + k) % T;
      const int64_t first = chunks * r / T, end = chunks * (r + 1) / T;
      Region& region = sh_.regions[next_ * T + r];
      for (int64_t c; (c = first + region.taken.fetch_add(1, std::memory_order_relaxed)) < end;) {
        if (!ready) prepare();
        work(c, !ready);
        ready = true;
        st.done.fetch_add(1, std::memory_order_release);
      }
    }
    ++next_;
    last_chunks_ = chunks;
  }

  // out = in . W^T, GEMV_CHUNK rows per chunk; `in` is computed by prepare() when it is the
  // thread's own buffer; the taker of chunk 0 stores the residual sum when `stores_residual`
  template <typename Prep>
  void gemv(const Q4& w, int64_t k, float* out, const float* in, Prep prepare,
            bool stores_residual) {
    const int64_t chunks = (w.n + GEMV_CHUNK - 1) / GEMV_CHUNK;
    stage(chunks, prepare, [&](int64_t c, bool fresh) {
      if (c == 0 && stores_residual) {
        std::memcpy(sh_.res[1 - cur_], own_sum_, sh_.B * sh_.dims->hidden * sizeof(float));
      }
      const int64_t j0 = c * GEMV_CHUNK, j1 = j0 + GEMV_CHUNK < w.n ? j0 + GEMV_CHUNK : w.n;
      sh_.f->q4_1(in, sh_.B, k, k, w.codes, w.d, w.m, w.n, j0, j1, out, fresh ? 1 : 0);
    });
    if (stores_residual) cur_ = 1 - cur_;  // every thread, taker or not
  }

  // own = norm(x + residual) * w, own_sum = x + residual (first layer: own = norm(residual) * w)
  void add_norm(const float* w, bool first) {
    const int64_t D = sh_.dims->hidden;
    for (int64_t b = 0; b < sh_.B; ++b) {
      const float* r = sh_.res[cur_] + b * D;
      if (first) sh_.f->norm(r, nullptr, nullptr, own_ + b * D, w, D, sh_.eps);
      else sh_.f->norm(sh_.x + b * D, r, own_sum_ + b * D, own_ + b * D, w, D, sh_.eps);
    }
  }

  void silu_row(int64_t b, float* act) {
    const Dims& dm = *sh_.dims;
    sh_.f->silu(sh_.gate_up + b * 2 * dm.inter, act + b * dm.inter, dm.inter, dm.silu_vec);
  }

  void silu(float* act) {
    for (int64_t b = 0; b < sh_.B; ++b) silu_row(b, act);
  }

  static void wait(const Stage& st, int64_t chunks) {
    for (int spins = 0; st.done.load(std::memory_order_acquire) < chunks;) {
      if (++spins < 1000) RADIXLM_PAUSE();
      else sched_yield();  // on a busy machine: let the holder of the chunk run
    }
  }

  const Shared& sh_;
  float* own_sum_;
  float* own_;
  int me_;
  int cur_ = 0;
  int64_t next_ = 0;
  int64_t last_chunks_ = 0;
};

}  // namespace

extern "C" {

int radixlm_step_abi_version() { return 4; }

// residual [B, hidden]: the embeddings (overwritten); scratch: B * (2 * hidden + qkv +
// heads * head_dim + 3 * inter) shared floats, then per thread B * (hidden + max(hidden,
// inter)); out [B, hidden]: the final norm's output; logits [B, vocab]: the LM head's (when
// head->codes is set). idx: the batch's (table, table stride, req_slots, seq_lens, out_slots).
void decode_step_f32(const Kernels* f, const Layer* layers, int64_t num_layers,
                     const int64_t* idx, int64_t batch, const float* cos, const float* sin,
                     int64_t cs_stride, float* residual, float* scratch, const float* final_norm,
                     float* out, const Dims* dims, float eps, float scale, const Head* head,
                     float* logits, int threads) {
  const int64_t D = dims->hidden, hd = dims->head_dim, B = batch;
  const int64_t q_size = dims->heads * hd, qkv_size = q_size + 2 * dims->kv_heads * hd;
  const int64_t wide = D > dims->inter ? D : dims->inter;
  std::vector<Stage> stages(6 * num_layers + 2);
  std::vector<Region> regions(stages.size() * threads);
  Shared sh{};
  sh.f = f;
  sh.layers = layers;
  sh.num_layers = num_layers;
  sh.dims = dims;
  sh.args = DecodeArgs{reinterpret_cast<const int64_t*>(idx[0]), idx[1],
                       reinterpret_cast<const int64_t*>(idx[2]),
                       reinterpret_cast<const int64_t*>(idx[3]),
                       reinterpret_cast<const int64_t*>(idx[4]), B, qkv_size, qkv_size,
                       qkv_size, dims->heads, dims->kv_heads, hd, scale, 0};
  sh.cos = cos;
  sh.sin = sin;
  sh.cs_stride = cs_stride;
  sh.eps = eps;
  sh.B = B;
  sh.x = scratch;
  sh.res[0] = residual;
  sh.res[1] = sh.x + B * D;
  sh.qkv = sh.res[1] + B * D;
  sh.att = sh.qkv + B * qkv_size;
  sh.gate_up = sh.att + B * q_size;
  sh.out = out;
  sh.final_norm = final_norm;
  sh.head = *head;
  sh.logits = logits;
  sh.stages = stages.data();
  sh.regions = regions.data();
  sh.threads = threads;
  sh.act = sh.gate_up + B * 2 * dims->inter;
  float* own_base = sh.act + B * dims->inter;
  #pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num();
    float* own_sum = own_base + me * B * (D + wide);
    Walker(sh, own_sum, own_sum + B * D, me).run();
  }
}

}  // extern "C"
"""
)

FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_STEP_ARGS = [_P, _P, _I, _P, _I, _P, _P, _I, _P, _P, _P, _P, _P, ctypes.c_float]
_STEP_ARGS += [ctypes.c_float, _P, _P, ctypes.c_int]
_ENTRY_POINTS = (  # the Kernels struct's fields, in order
    (gguf_cpu, "q4_1_span_f32"),
    (cpu_decode, "rope_decode_item_f32"),
    (cpu_decode, "rmsnorm_row_f32"),
    (cpu_decode, "silu_mul_row_f32"),
    (gguf_cpu, "q8_0_x16_span_f32"),
)

_lock = threading.Lock()
_state: dict[int, object] = {}  # id(GEMV library) -> (lib, kernel table) once built, or None
_switch = KernelSwitch()  # off inside `disabled()` (benchmarks and tests comparing the torch paths)


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
    """The step's library with the kernel table of the GEMV library in use (one per GEMV
    build: ``gguf_cpu.library_override`` swaps it in benchmarks)."""
    key = id(gguf_cpu.library())
    if key not in _state:
        with _lock:
            if key not in _state:
                built = None
                if os.environ.get("RADIXLM_CPU_STEP", "1") != "0":
                    try:
                        built = _build()
                    except OSError:
                        built = None
                _state[key] = built
    return _state[key]  # type: ignore[return-value]


def available() -> bool:
    """Whether the step is built, loaded and on, with both kernel libraries it calls."""
    return (
        _switch.is_on and cpu_decode.available() and gguf_cpu.available() and _library() is not None
    )


def disabled() -> contextlib.AbstractContextManager[None]:
    """Inside the block :func:`available` is False: models run layer by layer."""
    return _switch.disabled()


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
        head: gguf_cpu.Q8_0 | None = None,
    ):
        """``head``: the LM head's Q8_0 weight ``[vocab, hidden]``, multiplied in the same call
        (int16 activations, as ``quantize.SmallBatchLMHead``); None: the caller's."""
        self._check(layers, final_norm, dims)
        if head is not None and (
            head.codes.shape[1] != dims.hidden or head.codes.dtype != torch.int8
        ):
            raise ValueError(f"the head must be a Q8_0 weight of [vocab, {dims.hidden}]")
        self.dims, self.eps, self.scale = dims, eps, scale
        self._layers = list(layers)  # keeps the weights the table points at alive
        self._final_norm = final_norm
        self._head = head
        vocab = 0 if head is None else head.codes.shape[0]
        ptrs = [0, 0] if head is None else [head.codes.data_ptr(), head.d.data_ptr()]
        self._head_args = torch.tensor([*ptrs, vocab], dtype=torch.int64)  # the C++ Head
        self._vocab = vocab
        self._table = self._weight_table()  # [L, 21] int64; K/V columns set by bind_pool
        self._dims = torch.tensor([*dims, cpu_decode.silu_vec()], dtype=torch.int64)
        self._pool: tuple[torch.Tensor, ...] = ()
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}  # (rows, threads) -> floats

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

    def _scratch_for(self, rows: int, threads: int) -> torch.Tensor:
        """Shared buffers, then each thread's own (``decode_step_f32`` says the sizes)."""
        buf = self._scratch.get((rows, threads))
        if buf is None:
            d = self.dims
            shared = 2 * d.hidden + (d.heads + 2 * d.kv_heads) * d.head_dim
            shared += d.heads * d.head_dim + 3 * d.inter
            own = d.hidden + max(d.hidden, d.inter)
            size = rows * (shared + threads * own)
            buf = self._scratch[(rows, threads)] = torch.empty(size, dtype=torch.float32)
        return buf

    def run(
        self,
        residual: torch.Tensor,
        batch: cpu_decode.DecodeBatch,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer for the batch's rows, then the final norm (and the LM head): ``residual``
        ``[B, hidden]`` contiguous float32 (the embeddings; overwritten) -> (the final norm's
        output ``[B, hidden]``, the logits ``[B, vocab]`` float32 or None without a head).
        ``cos``/``sin``: ``RotaryEmbedding.cos_sin`` of the batch's positions (float32);
        ``batch``: its indices, as the attention kernel takes them. Writes the new tokens' K/V
        into the bound pool."""
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
        vocab = self._vocab
        logits = torch.empty((rows, vocab), dtype=torch.float32) if vocab else None
        threads = torch.get_num_threads()
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
            self._scratch_for(rows, threads).data_ptr(),
            self._final_norm.data_ptr(),
            out.data_ptr(),
            self._dims.data_ptr(),
            self.eps,
            self.scale,
            self._head_args.data_ptr(),
            None if logits is None else logits.data_ptr(),
            threads,
        )
        return out, logits
