"""The C++ source of ``cpu_decode.py``'s kernels (rope, add + RMSNorm, silu * mul, paged
decode attention, with its AVX2 + FMA path for float32 pools), built by ``cpu_decode.library``;
``DECODE_ARGS`` is the attention call's argument layout, which ``cpu_step.py`` passes too."""

# the decode attention call's arguments, one layout for every library that passes them
# (``cpu_step.py`` calls this library's entry points with a pointer to one)
DECODE_ARGS = r"""
struct DecodeArgs {  // one decode attention call (decode() below says what each field is)
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
"""

SOURCE = (
    r"""
#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t b = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline float round_to(float x, const float*) { return x; }
inline uint16_t to_bf16(float x) {  // round to nearest even, as torch
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}
inline float round_to(float x, const uint16_t*) {
  uint32_t b = uint32_t(to_bf16(x)) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline void put(float* p, int64_t i, float x) { p[i] = x; }
inline void put(uint16_t* p, int64_t i, float x) { p[i] = to_bf16(x); }

// every function named *_rows below runs its loop as an orphaned `omp for`: inside a parallel
// region (cpu_step.py's whole-model step) the team shares it, outside one the caller runs it all;
// each item is computed the same way either way
// one head of d values rotated in place (neox halves): x * cos rounded, then one fused
// multiply-add of swap(x) * signed sin, as torch.addcmul
template <typename T>
void rope_head(T* p, const T* c, const T* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load(p, i), x2 = load(p, i + half);
    const float a1 = round_to(x1 * load(c, i), p);
    const float a2 = round_to(x2 * load(c, i + half), p);
    put(p, i, std::fma(x2, load(s, i), a1));
    put(p, i + half, std::fma(x1, load(s, i + half), a2));
  }
}

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const T* cos,
               const T* sin, int64_t cs_stride) {
  const int64_t items = rows * heads;
  #pragma omp for schedule(static)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t r = it / heads, h = it % heads;
    rope_head(x + r * row_stride + h * d, cos + r * cs_stride, sin + r * cs_stride, d);
  }
}

template <typename T>
void rope(T* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const T* cos,
          const T* sin, int64_t cs_stride, int threads) {
  #pragma omp parallel num_threads(threads) if (threads > 1 && rows * heads >= 64)
  rope_rows(x, rows, row_stride, heads, d, cos, sin, cs_stride);
}

"""
    + DECODE_ARGS
    + r"""
// request b's attention for KV head kh: all of the GQA group's query heads per key row, an
// exact two-pass softmax, float32 sums; qf, acc, scores: the calling thread's scratch
template <typename T>
void attend_item(const DecodeArgs& a, int64_t b, int64_t kh, const T* q, const T* k_buf,
                 const T* v_buf, T* out, std::vector<float>& qf, std::vector<float>& acc,
                 std::vector<float>& scores) {
  const int64_t d = a.d, row = a.kv_heads * d, group = a.heads / a.kv_heads;
  const int64_t len = a.seq_lens[b];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - lo;
  const int64_t* slots = a.table + a.req_slots[b] * a.table_stride + lo;
  const T* qb = q + b * a.q_stride + kh * group * d;
  qf.resize(group * d);
  acc.assign(group * d, 0.f);
  for (int64_t i = 0; i < group * d; ++i) qf[i] = load(qb, i);
  scores.resize(group * n);
  std::vector<float> mx(group, -INFINITY), sum(group, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = k_buf + slots[j] * row + kh * d;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * d;
      float s = 0.f;
      #pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += qg[i] * load(kr, i);
      s *= a.scale;
      scores[g * n + j] = s;
      mx[g] = std::max(mx[g], s);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * n;
    float total = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = std::exp(sg[j] - mx[g]);
      total += sg[j];
    }
    sum[g] = total;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = v_buf + slots[j] * row + kh * d;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * n + j];
      float* ag = acc.data() + g * d;
      #pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += p * load(vr, i);
    }
  }
  T* ob = out + (b * a.heads + kh * group) * d;
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / sum[g];
    for (int64_t i = 0; i < d; ++i) put(ob, g * d + i, acc[g * d + i] * inv);
  }
}

// the item through the plain loops (bf16 pools, or no AVX2 + FMA)
template <typename T>
inline void attend(const DecodeArgs& a, int64_t b, int64_t kh, const T* q, const T* k_buf,
                   const T* v_buf, T* out, std::vector<float>& qf, std::vector<float>& acc,
                   std::vector<float>& scores) {
  attend_item(a, b, kh, q, k_buf, v_buf, out, qf, acc, scores);
}

#if defined(__AVX2__) && defined(__FMA__)
// e^x for x <= 0 (8 lanes): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two parts, p a
// degree-6 polynomial (relative error about 2e-7); 0 below -69 (e^-69 is about 1e-30: weights
// that small next to the largest, 1, change no float32 sum, and products of them with V could
// be denormal, which some CPUs compute in slow microcode)
inline __m256 exp_neg8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-69.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
inline float hsum_ps(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane t of the result: the sum of v[t]'s 8 lanes
inline __m256 sum8(const __m256* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 lo4 = _mm256_hadd_ps(s01, s23), hi4 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                       _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
// acc[0..NV) += p * v[0..8 NV) over the keys, then out = acc / sum
template <int NV>
void weighted_sum(const float* v_buf, const int64_t* slots, int64_t row, int64_t off,
                  const float* p, int64_t n, float inv, float* out) {
  __m256 acc[NV];
  for (int t = 0; t < NV; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = v_buf + slots[j] * row + off;
    const __m256 pj = _mm256_broadcast_ss(p + j);
    for (int t = 0; t < NV; ++t) acc[t] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * t), acc[t]);
  }
  const __m256 iv = _mm256_set1_ps(inv);
  for (int t = 0; t < NV; ++t) _mm256_storeu_ps(out + 8 * t, _mm256_mul_ps(acc[t], iv));
}
// attend_item for float32 pools with d a multiple of 8 (AVX2 + FMA): the same exact two-pass
// softmax, each key row loaded once for the group's query heads, vector exp, V summed in
// registers 64 dims at a time
inline void attend_item_avx2(const DecodeArgs& a, int64_t b, int64_t kh, const float* q,
                             const float* k_buf, const float* v_buf, float* out,
                             std::vector<float>& scores) {
  const int64_t d = a.d, row = a.kv_heads * d, group = a.heads / a.kv_heads;
  const int64_t len = a.seq_lens[b];
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - lo, np = (n + 7) / 8 * 8;
  const int64_t* slots = a.table + a.req_slots[b] * a.table_stride + lo;
  const float* qb = q + b * a.q_stride + kh * group * d;
  scores.resize(group * np);
  float mx[64];
  for (int64_t g = 0; g < group; ++g) mx[g] = -INFINITY;
  const __m256 scale8 = _mm256_set1_ps(a.scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {  // 8 keys at a time: 8 dot products summed into one vector
    const float* kr[8];
    for (int t = 0; t < 8; ++t) kr[t] = k_buf + slots[j + t] * row + kh * d;
    for (int64_t t = j + 8; t < j + 16 && t < n; ++t) {  // the next block's key rows
      const char* nk = reinterpret_cast<const char*>(k_buf + slots[t] * row + kh * d);
      for (int64_t o = 0; o < d * 4; o += 64) __builtin_prefetch(nk + o);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qb + g * d;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + i);
        for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t] + i), acc[t]);
      }
      const __m256 s8 = _mm256_mul_ps(sum8(acc), scale8);
      _mm256_storeu_ps(scores.data() + g * np + j, s8);
      mx[g] = std::max(mx[g], hmax_ps(s8));
    }
  }
  for (; j < n; ++j) {  // the last keys one at a time
    const float* kr = k_buf + slots[j] * row + kh * d;
    if (j + 4 < n) {
      const char* nk = reinterpret_cast<const char*>(k_buf + slots[j + 4] * row + kh * d);
      for (int64_t o = 0; o < d * 4; o += 64) __builtin_prefetch(nk + o);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qb + g * d;
      __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kr + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i + 8), _mm256_loadu_ps(kr + i + 8), s1);
      }
      if (i < d) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kr + i), s0);
      const float s = hsum_ps(_mm256_add_ps(s0, s1)) * a.scale;
      scores[g * np + j] = s;
      mx[g] = std::max(mx[g], s);
    }
  }
  float inv[64];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * np;
    for (int64_t j = n; j < np; ++j) sg[j] = -INFINITY;
    const __m256 m = _mm256_set1_ps(mx[g]);
    __m256 tot = _mm256_setzero_ps();
    for (int64_t j = 0; j < np; j += 8) {
      const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), m));
      _mm256_storeu_ps(sg + j, e);
      tot = _mm256_add_ps(tot, e);
    }
    inv[g] = 1.f / hsum_ps(tot);
  }
  float* ob = out + (b * a.heads + kh * group) * d;
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores.data() + g * np;
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
      const int64_t off = kh * d + i0;
      float* o = ob + g * d + i0;
      switch (std::min<int64_t>(64, d - i0) / 8) {
        case 8: weighted_sum<8>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 7: weighted_sum<7>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 6: weighted_sum<6>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 5: weighted_sum<5>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 4: weighted_sum<4>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 3: weighted_sum<3>(v_buf, slots, row, off, p, n, inv[g], o); break;
        case 2: weighted_sum<2>(v_buf, slots, row, off, p, n, inv[g], o); break;
        default: weighted_sum<1>(v_buf, slots, row, off, p, n, inv[g], o); break;
      }
    }
  }
}

// float32 items with d a multiple of 8 take attend_item_avx2 (the same sums in another order)
inline void attend(const DecodeArgs& a, int64_t b, int64_t kh, const float* q, const float* k_buf,
                   const float* v_buf, float* out, std::vector<float>& qf,
                   std::vector<float>& acc, std::vector<float>& scores) {
  if (a.d % 8 == 0 && a.heads / a.kv_heads <= 64) {
    attend_item_avx2(a, b, kh, q, k_buf, v_buf, out, scores);
  } else {
    attend_item(a, b, kh, q, k_buf, v_buf, out, qf, acc, scores);
  }
}
#endif

// writes the new K/V rows (one thread), then every (request, KV head) item over the team
template <typename T>
void decode_rows(const DecodeArgs& a, const T* q, const T* k_new, const T* v_new, T* k_buf,
                 T* v_buf, T* out) {
  const int64_t row = a.kv_heads * a.d;  // one slot of a pool buffer
  if (k_new != nullptr) {
    #pragma omp single
    for (int64_t b = 0; b < a.batch; ++b) {
      std::memcpy(k_buf + a.out_slots[b] * row, k_new + b * a.k_stride, row * sizeof(T));
      std::memcpy(v_buf + a.out_slots[b] * row, v_new + b * a.v_stride, row * sizeof(T));
    }
  }
  std::vector<float> qf, acc, scores;
  #pragma omp for schedule(dynamic, 1)
  for (int64_t it = 0; it < a.batch * a.kv_heads; ++it) {
    attend(a, it / a.kv_heads, it % a.kv_heads, q, k_buf, v_buf, out, qf, acc, scores);
  }
}

// item `it` (request, KV head) of decode_rows for q, k, v in one row of qkv that rope has not
// rotated yet: it rotates its own query heads and key head, writes its K/V head into the pool
// and attends (no other item reads them, so items need no barrier between the three)
template <typename T>
void rope_decode_item(const DecodeArgs& a, int64_t it, T* qkv, const T* cos, const T* sin,
                      int64_t cs_stride, T* k_buf, T* v_buf, T* out) {
  static thread_local std::vector<float> qf, acc, scores;
  const int64_t d = a.d, group = a.heads / a.kv_heads, row = a.kv_heads * d;
  const int64_t b = it / a.kv_heads, kh = it % a.kv_heads;
  T* q = qkv + b * a.q_stride;
  T* k = q + a.heads * d + kh * d;
  T* v = k + row;
  const T* c = cos + b * cs_stride;
  const T* s = sin + b * cs_stride;
  for (int64_t g = 0; g < group; ++g) rope_head(q + (kh * group + g) * d, c, s, d);
  rope_head(k, c, s, d);
  std::memcpy(k_buf + a.out_slots[b] * row + kh * d, k, d * sizeof(T));
  std::memcpy(v_buf + a.out_slots[b] * row + kh * d, v, d * sizeof(T));
  attend(a, b, kh, qkv, k_buf, v_buf, out, qf, acc, scores);
}

template <typename T>
void decode(const int64_t* table, int64_t table_stride, const int64_t* req_slots,
            const int64_t* seq_lens, const int64_t* out_slots, int64_t batch, const T* q,
            int64_t q_stride, const T* k_new, const T* v_new, int64_t k_stride, int64_t v_stride,
            T* k_buf,
            T* v_buf, T* out, int64_t heads, int64_t kv_heads, int64_t d, float scale,
            int64_t window, int threads) {
  const DecodeArgs a{table,    table_stride, req_slots, seq_lens, out_slots, batch, q_stride,
                     k_stride, v_stride,     heads,     kv_heads, d,         scale, window};
  int64_t keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    keys += window > 0 ? std::min(seq_lens[b], window) : seq_lens[b];
  }
  // below ~64k multiply-adds per thread the wake-up costs more than it saves
  const bool par = threads > 1 && batch * kv_heads > 1 && keys * heads * d >= 65536 * 2;
  #pragma omp parallel num_threads(threads) if (par)
  decode_rows(a, q, k_new, v_new, k_buf, v_buf, out);
}

// sum of x[i]^2 in the order torch's CPU sum takes for a contiguous float32 row
// (aten/src/ATen/native/cpu/SumKernel.cpp: vectors of 8 floats, four interleaved partial sums
// over them in a cascade of levels of 16, then the scalar tail and the vector's lanes; the AVX2
// kernel, which AVX-512 machines run too): rms_norm's mean of squares, bit for bit
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = uint64_t(x - 1); v != 0; v >>= 1) ++bits;
  return bits;
}

template <int W>
void add_squares(float (&acc)[W], const float* x) {
  for (int l = 0; l < W; ++l) acc[l] += x[l] * x[l];
}

float torch_sum_squares(const float* x, int64_t n) {
  constexpr int W = 8, ILP = 4, LEVELS = 4;
  if (n < W) {  // torch's scalar path: the same cascade over single floats
    float acc[LEVELS][ILP] = {};
    for (int64_t i = 0; i + ILP <= n; i += ILP) {
      for (int k = 0; k < ILP; ++k) acc[0][k] += x[i + k] * x[i + k];
    }
    for (int64_t i = n / ILP * ILP; i < n; ++i) acc[0][0] += x[i] * x[i];
    for (int k = 1; k < ILP; ++k) acc[0][0] += acc[0][k];
    return 0.f + acc[0][0];
  }
  const int64_t vecs = n / W, rows = vecs / ILP;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / LEVELS);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[LEVELS][ILP][W] = {};
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int k = 0; k < ILP; ++k) add_squares<W>(acc[0][k], x + (i * ILP + k) * W);
    }
    for (int j = 1; j < LEVELS; ++j) {
      for (int k = 0; k < ILP; ++k) {
        for (int l = 0; l < W; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.f;
        }
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int k = 0; k < ILP; ++k) add_squares<W>(acc[0][k], x + (i * ILP + k) * W);
  }
  for (int j = 1; j < LEVELS; ++j) {
    for (int k = 0; k < ILP; ++k) {
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[j][k][l];
    }
  }
  for (int64_t v = rows * ILP; v < vecs; ++v) add_squares<W>(acc[0][0], x + v * W);
  for (int k = 1; k < ILP; ++k) {
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  }
  float total = 0.f;
  for (int64_t k = vecs * W; k < n; ++k) total += x[k] * x[k];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return total;
}

// rows of x (+ residual, written to sum; sum may be residual itself) normalised:
// out = x * (1 / sqrt(mean(x^2) + eps)) * w, rounded as torch's rms_norm rounds it
void add_rmsnorm_row(const float* x, const float* res, float* sum, float* out, const float* w,
                     int64_t d, float eps) {
  if (res != nullptr) {
    #pragma omp simd
    for (int64_t i = 0; i < d; ++i) sum[i] = x[i] + res[i];
    x = sum;
  }
  const float inv = 1.f / std::sqrt(torch_sum_squares(x, d) / float(d) + eps);
  #pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

void add_rmsnorm_rows(const float* x, const float* res, float* sum, float* out, const float* w,
                      int64_t rows, int64_t d, float eps) {
  #pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    add_rmsnorm_row(x + r * d, res == nullptr ? nullptr : res + r * d,
                    sum == nullptr ? nullptr : sum + r * d, out + r * d, w, d, eps);
  }
}

void add_rmsnorm(const float* x, const float* res, float* sum, float* out, const float* w,
                 int64_t rows, int64_t d, float eps, int threads) {
  #pragma omp parallel num_threads(threads) if (threads > 1 && rows * d >= 65536)
  add_rmsnorm_rows(x, res, sum, out, w, rows, d, eps);
}

// exp(d) as SLEEF's expf_u10 computes it (torch's vectorised float32 exp): a rounded
// multiple q of ln 2 split off in two fused steps, a degree-6 polynomial, times 2^q in two halves
inline float pow2i(int32_t q) {
  const uint32_t b = uint32_t(q + 0x7f) << 23;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline float sleef_expf(float d) {
  const float r_ln2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
  const float l2u = 0.693145751953125f, l2l = 1.428606765330187045e-06f;
  const int32_t q = int32_t(std::nearbyint(d * r_ln2));
  float s = std::fma(float(q), -l2u, d);
  s = std::fma(float(q), -l2l, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.f + std::fma(s * s, u, s);
  u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
  if (d < -104.f) u = 0.f;
  if (d > 100.f) u = INFINITY;
  return u;
}

// out[r, i] = silu(x[r, i]) * x[r, n + i], silu rounded as torch's float32 kernel rounds it:
// x / (1 + exp(-x)) with SLEEF's exp over whole steps of `vec` elements of a row and the C
// library's expf for the row's last n % vec (vec 0: the C library's everywhere); in chunks of
// 512 columns over the team
void silu_mul_span(const float* g, float* o, int64_t n, int64_t lo, int64_t hi, int64_t tail) {
  const float* u = g + n;
  const int64_t mid = std::max(lo, std::min(hi, tail));
  #pragma omp simd
  for (int64_t i = lo; i < mid; ++i) o[i] = g[i] / (1.f + sleef_expf(-g[i])) * u[i];
  for (int64_t i = mid; i < hi; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

void silu_mul_rows(const float* x, float* out, int64_t rows, int64_t n, int64_t vec) {
  const int64_t chunks = (n + 511) / 512;
  const int64_t tail = vec > 0 ? n - n % vec : 0;
  #pragma omp for schedule(static)
  for (int64_t it = 0; it < rows * chunks; ++it) {
    const int64_t r = it / chunks, lo = it % chunks * 512;
    silu_mul_span(x + r * 2 * n, out + r * n, n, lo, std::min(n, lo + 512), tail);
  }
}

void silu_mul(const float* x, float* out, int64_t rows, int64_t n, int64_t vec, int threads) {
  #pragma omp parallel num_threads(threads) if (threads > 1 && rows * n >= 65536)
  silu_mul_rows(x, out, rows, n, vec);
}

}  // namespace

extern "C" {

int radixlm_abi_version() { return 1; }

void silu_mul_f32(const float* x, float* out, int64_t rows, int64_t n, int64_t vec,
                  int threads) {
  silu_mul(x, out, rows, n, vec, threads);
}

void rmsnorm_f32(const float* x, const float* res, float* sum, float* out, const float* w,
                 int64_t rows, int64_t d, float eps, int threads) {
  add_rmsnorm(x, res, sum, out, w, rows, d, eps, threads);
}

void rope_f32(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d,
              const float* cos, const float* sin, int64_t cs_stride, int threads) {
  rope(x, rows, row_stride, heads, d, cos, sin, cs_stride, threads);
}
void rope_bf16(uint16_t* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d,
               const uint16_t* cos, const uint16_t* sin, int64_t cs_stride, int threads) {
  rope(x, rows, row_stride, heads, d, cos, sin, cs_stride, threads);
}

void decode_f32(const int64_t* table, int64_t table_stride, const int64_t* req_slots,
                const int64_t* seq_lens, const int64_t* out_slots, int64_t batch,
                const float* q, int64_t q_stride, const float* k_new, const float* v_new,
                int64_t k_stride, int64_t v_stride, float* k_buf, float* v_buf, float* out, int64_t heads,
                int64_t kv_heads, int64_t d, float scale, int64_t window, int threads) {
  decode(table, table_stride, req_slots, seq_lens, out_slots, batch, q, q_stride, k_new, v_new,
         k_stride, v_stride, k_buf, v_buf, out, heads, kv_heads, d, scale, window, threads);
}
void decode_bf16(const int64_t* table, int64_t table_stride, const int64_t* req_slots,
                 const int64_t* seq_lens, const int64_t* out_slots, int64_t batch,
                 const uint16_t* q, int64_t q_stride, const uint16_t* k_new,
                 const uint16_t* v_new, int64_t k_stride, int64_t v_stride, uint16_t* k_buf,
                 uint16_t* v_buf,
                 uint16_t* out, int64_t heads, int64_t kv_heads, int64_t d, float scale,
                 int64_t window, int threads) {
  decode(table, table_stride, req_slots, seq_lens, out_slots, batch, q, q_stride, k_new, v_new,
         k_stride, v_stride, k_buf, v_buf, out, heads, kv_heads, d, scale, window, threads);
}

// float32 pieces of cpu_step.py's whole-model step (it takes their addresses), each run by
// the calling thread alone: one item of the fused rope + K/V write + attention, a norm row, a
// silu row
void rope_decode_item_f32(const DecodeArgs* a, int64_t item, float* qkv, const float* cos,
                          const float* sin, int64_t cs_stride, float* k_buf, float* v_buf,
                          float* out) {
  rope_decode_item(*a, item, qkv, cos, sin, cs_stride, k_buf, v_buf, out);
}
void rmsnorm_row_f32(const float* x, const float* res, float* sum, float* out, const float* w,
                     int64_t d, float eps) {
  add_rmsnorm_row(x, res, sum, out, w, d, eps);
}
void silu_mul_row_f32(const float* x, float* out, int64_t n, int64_t vec) {
  silu_mul_span(x, out, n, 0, n, vec > 0 ? n - n % vec : 0);
}

}  // extern "C"
"""
)
