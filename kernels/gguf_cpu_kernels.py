"""The C++ source of ``kernels/gguf_cpu.py``'s GEMVs (Q4_1 and Q8_0 blocks against int8
activations, tiled; AVX-512 VNNI, AVX-VNNI, AVX2 and scalar paths chosen at compile time), kept
apart from the Python that builds, binds and calls it. See ``gguf_cpu``'s docstring."""

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if !defined(RADIXLM_SCALAR) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define RADIXLM_AVX2 1
#if !defined(RADIXLM_NO_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define RADIXLM_VNNI 1
#elif !defined(RADIXLM_NO_VNNI) && defined(__AVXVNNI__)
#define RADIXLM_AVXVNNI 1
#endif
#endif

namespace {

constexpr int QK = 32;
// Tiles of up to PREFETCH_MT activation rows (bound by the weights' reads) read each weight
// row's codes with a prefetch of the same bytes PREFETCH_ROWS rows on (the next tiles'): the
// hardware's prefetchers keep up with neither a tile's several rows nor their short lengths
// (Q4_1 and the head 1.15-1.5x faster at 1-4 rows on the 2-core AVX2 EPYC, any distance of
// 4-32 rows alike; 10% slower at 16 rows, where the tiles are bound by their arithmetic)
constexpr int64_t PREFETCH_ROWS = 8;
constexpr int PREFETCH_MT = 4;

inline float bf16_to_f32(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// a float16's value (the Q4_1 weights' scales and mins)
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, em = h & 0x7fffu;
  if (em < 0x400u) {  // zero or subnormal: em * 2^-24
    const float f = float(em) * 5.9604644775390625e-08f;
    return sign ? -f : f;
  }
  const uint32_t b = sign | (em >= 0x7c00u ? 0x7f800000u | ((em & 0x3ffu) << 13)
                                           : (em << 13) + (112u << 23));
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// x rounded to float16's precision (nearest even; below float16's normal range to multiples of
// 2^-24), the value llama.cpp stores for a block's scale and sum
inline float round_f16(float x) {
  const float ax = std::fabs(x);
  if (!(ax >= 6.103515625e-05f)) return std::nearbyint(x * 16777216.f) / 16777216.f;
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b += 0xfffu + ((b >> 13) & 1u);
  b &= ~0x1fffu;
  float r;
  std::memcpy(&r, &b, 4);
  return r;
}

// block `x` (QK values, float32 or bf16) into `buf` as float32; its largest magnitude
template <typename T>
float load_block(const T* x, float* buf) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) {
    if constexpr (sizeof(T) == 2) buf[i] = bf16_to_f32(x[i]);
    else buf[i] = x[i];
    amax = std::max(amax, std::fabs(buf[i]));
  }
  return amax;
}

// one row of K activations -> int8 codes, per-block scales and scaled sums (q8_1)
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* s) {
  float buf[QK];
  for (int64_t b = 0; b < k / QK; ++b) {
    const float amax = load_block(x + b * QK, buf);
    const float db = amax / 127.f;
    const float id = db > 0.f ? 1.f / db : 0.f;
    int sum = 0;
    for (int i = 0; i < QK; ++i) {
      const int v = int(std::nearbyint(buf[i] * id));
      q[b * QK + i] = int8_t(v);
      sum += v;
    }
    d[b] = round_f16(db);
    s[b] = round_f16(db * float(sum));
  }
}

// one row of K activations -> int16 codes and per-block scales (the LM head's activations: the
// logits' argmax sits on near ties that int8 activations flip)
template <typename T>
void quantize_row16(const T* x, int64_t k, int16_t* q, float* d) {
  float buf[QK];
  for (int64_t b = 0; b < k / QK; ++b) {
    const float amax = load_block(x + b * QK, buf);
    const float db = amax / 32767.f;
    const float id = db > 0.f ? 1.f / db : 0.f;
    for (int i = 0; i < QK; ++i) q[b * QK + i] = int16_t(std::nearbyint(buf[i] * id));
    d[b] = db;
  }
}

#ifdef RADIXLM_AVX2
// sum of u[i] * s[i] over 32 unsigned x signed bytes, as 8 int32 lanes
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(RADIXLM_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(RADIXLM_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
// two such dot products summed: u0 . s0 + u1 . s1 (u* at most 15, so the int16 sums fit)
inline __m256i dot2_u8s8(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
#if defined(RADIXLM_VNNI)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1);
#elif defined(RADIXLM_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u0, s0), u1,
                                 s1);
#else
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

struct Acts {  // quantised activation rows
  const int8_t* q;
  const float* d;  // [rows, nb] the blocks' scales
  const float* s;  // [rows, sp] the blocks' scaled sums, zero past nb (sp: nb rounded up to 8)
  int64_t k;
  const int8_t* qp;  // q with each pair of blocks as [lo halves | hi halves] (Q4_1's AVX2 path)
  // [rows, (nb + 1) / 2, 8] each block pair's scales as the pair's int32 dot lanes hold the
  // blocks (d[b] x 4, d[b + 1] x 4; an odd last block's d x 8)
  const float* dx;
  static int64_t s_stride(int64_t k) { return (k / QK + 7) / 8 * 8; }
  static int64_t dx_stride(int64_t k) { return (k / QK + 1) / 2 * 8; }
  Acts rows_from(int64_t r0) const {
    const int64_t nb = k / QK;
    return Acts{q + r0 * k, d + r0 * nb, s + r0 * s_stride(k), k, qp + r0 * k,
                dx + r0 * dx_stride(k)};
  }
};

struct Q41 {  // a Q4_1 weight [n, k]: codes, float16 scales and mins [n, k / QK]
  const uint8_t* codes;
  const uint16_t* d;
  const uint16_t* m;
  int64_t k;
};

#ifdef RADIXLM_AVX2
// 8 float16 values from p as float32; only the first `live` of them are read (the rest are 0)
inline __m256 load8_f16(const uint16_t* p, int64_t live) {
  if (live >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint16_t t[8] = {};
  std::memcpy(t, p, live * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// lane i of the result is the sum of v[i]'s 8 lanes, added in the same order for every i
// whatever the other vectors hold (so a row's result does not depend on the tile around it)
inline __m256 hsum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// weight rows j..j+NT-1 against activation rows 0..MT-1 (NT * MT <= 8): out[r * out_stride +
// n]. Each weight block pair is unpacked once for the MT rows and each activation pair loaded
// once for the NT weight rows. Every (weight row, activation row) pair has one accumulator
// whose additions come in the same order whatever NT and MT are: a row's result is the same
// alone or in any batch.
template <int NT, int MT>
void q4_1_tile(const Q41& w, int64_t j, const Acts& a, float* out, int64_t out_stride) {
  static_assert(NT * MT <= 8, "eight accumulators");
  const int64_t k = a.k, nb = k / QK, sp = Acts::s_stride(k), xp = Acts::dx_stride(k);
  const uint8_t* codes = w.codes + j * (k / 2);
  const uint16_t* wd = w.d + j * nb;
  const uint16_t* wm = w.m + j * nb;
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  // the min terms m * s, 8 blocks a step (the activations' sums are zero past nb, the mins
  // of a last partial step are read through a zeroed copy)
  for (int64_t b = 0; b < nb; b += 8) {
    for (int n = 0; n < NT; ++n) {
      const __m256 m = load8_f16(wm + n * nb + b, nb - b);
      for (int r = 0; r < MT; ++r) {
        acc[n * MT + r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.s + r * sp + b), acc[n * MT + r]);
      }
    }
  }
  const __m256i low = _mm256_set1_epi8(0x0f);
  const __m256i pick = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  // two blocks per step: their 32 code bytes' low nibbles are both blocks' first halves, the
  // high nibbles their second halves, against the pair-arranged activations; the int32 lanes
  // 0-3 sum block b, 4-7 block b + 1
  int64_t p = 0;
  for (; 2 * p + 1 < nb; ++p) {
    for (int n = 0; n < NT; ++n) {  // a weight row's unpacked pair against the MT rows
      const uint8_t* c = codes + n * (k / 2) + p * QK;
      if (MT <= PREFETCH_MT) prefetch(c + PREFETCH_ROWS * k / 2);
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      int32_t pair;  // the two blocks' float16 scales
      std::memcpy(&pair, wd + n * nb + 2 * p, 4);
      const __m256 wdv = _mm256_permutevar8x32_ps(
          _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))), pick);
      for (int r = 0; r < MT; ++r) {
        const __m256i* q = reinterpret_cast<const __m256i*>(a.qp + r * k + p * 2 * QK);
        const __m256i dot = dot2_u8s8(lo, _mm256_loadu_si256(q), hi, _mm256_loadu_si256(q + 1));
        const __m256 sc = _mm256_mul_ps(wdv, _mm256_loadu_ps(a.dx + r * xp + p * 8));
        acc[n * MT + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[n * MT + r]);
      }
    }
  }
  if (2 * p < nb) {  // an odd last block: its low nibbles then its high ones
    const int64_t b = 2 * p;
    for (int n = 0; n < NT; ++n) {
      const __m128i raw = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(codes + n * (k / 2) + b * 16));
      const __m256i wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
      const __m256 wdv = _mm256_set1_ps(f16_to_f32(wd[n * nb + b]));
      for (int r = 0; r < MT; ++r) {
        const __m256i q = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(a.qp + r * k + b * QK));
        const __m256 sc = _mm256_mul_ps(wdv, _mm256_loadu_ps(a.dx + r * xp + p * 8));
        acc[n * MT + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(wq, q)), sc,
                                          acc[n * MT + r]);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, hsum8(acc));
  for (int n = 0; n < NT; ++n) {
    for (int r = 0; r < MT; ++r) out[r * out_stride + n] = sums[n * MT + r];
  }
}
#else
template <int NT, int MT>
void q4_1_tile(const Q41& w, int64_t j, const Acts& a, float* out, int64_t out_stride) {
  const int64_t k = a.k, nb = k / QK, sp = Acts::s_stride(k);
  for (int n = 0; n < NT; ++n) {
    const uint8_t* codes = w.codes + (j + n) * (k / 2);
    const uint16_t* wd = w.d + (j + n) * nb;
    const uint16_t* wm = w.m + (j + n) * nb;
    for (int r = 0; r < MT; ++r) {
      float acc = 0.f, mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* c = codes + b * 16;
        const int8_t* q = a.q + r * k + b * QK;
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += (c[i] & 15) * q[i] + (c[i] >> 4) * q[i + 16];
        acc += float(sum) * (f16_to_f32(wd[b]) * a.d[r * nb + b]);
        mins += f16_to_f32(wm[b]) * a.s[r * sp + b];
      }
      out[r * out_stride + n] = acc + mins;
    }
  }
}
#endif

struct Q41Tiles {
  static constexpr bool kWide = true;  // 1-4 rows: 2-4 weight rows a tile (3-13% faster)
  Q41 w;
  template <int NT, int MT>
  void tile(int64_t j, const Acts& a, float* out, int64_t out_stride) const {
    q4_1_tile<NT, MT>(w, j, a, out, out_stride);
  }
};

// activation rows [0, MT) against weight rows [j0, j1), NT rows a tile, single rows at the end
template <int NT, int MT, typename W, typename A>
void tile_rows(const W& w, int64_t j0, int64_t j1, const A& a, float* out, int64_t n) {
  int64_t j = j0;
  for (; j + NT <= j1; j += NT) w.template tile<NT, MT>(j, a, out + j, n);
  for (; j < j1; ++j) w.template tile<1, MT>(j, a, out + j, n);
}

// out[r, j] for every activation row r < m and weight row j in [j0, j1) through W's tiles:
// groups of up to 8 rows; with W::kWide fewer rows take several weight rows a tile (four
// accumulation chains at least)
template <typename W, typename A>
void tiled_span(const W& w, const A& a, int64_t m, int64_t n, int64_t j0, int64_t j1,
                float* out) {
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const A t = a.rows_from(r0);
    float* o = out + r0 * n;
    switch (std::min<int64_t>(8, m - r0)) {
      case 8: tile_rows<1, 8>(w, j0, j1, t, o, n); break;
      case 7: tile_rows<1, 7>(w, j0, j1, t, o, n); break;
      case 6: tile_rows<1, 6>(w, j0, j1, t, o, n); break;
      case 5: tile_rows<1, 5>(w, j0, j1, t, o, n); break;
      case 4: tile_rows<W::kWide ? 2 : 1, 4>(w, j0, j1, t, o, n); break;
      case 3: tile_rows<W::kWide ? 2 : 1, 3>(w, j0, j1, t, o, n); break;
      case 2: tile_rows<W::kWide ? 4 : 1, 2>(w, j0, j1, t, o, n); break;
      default: tile_rows<W::kWide ? 4 : 1, 1>(w, j0, j1, t, o, n); break;
    }
  }
}

// Q8_0 row n against MT activation rows
template <int MT>
void q8_0_rows(const int8_t* codes, const float* wd, int64_t k, Acts a, float* out,
               int64_t out_stride) {
  const int64_t nb = k / QK;
#ifdef RADIXLM_AVX2
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * QK));
    const __m256i wabs = _mm256_sign_epi8(w, w);  // |w| as unsigned, w's sign moved onto q
    const float d = wd[b];
    for (int r = 0; r < MT; ++r) {
      const __m256i q = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(a.q + r * a.k + b * QK));
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(q, w)));
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(d * a.d[r * nb + b]), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r * out_stride] = hsum(acc[r]);
#else
  float acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* c = codes + b * QK;
    for (int r = 0; r < MT; ++r) {
      const int8_t* q = a.q + r * a.k + b * QK;
      int sum = 0;
      for (int i = 0; i < QK; ++i) sum += c[i] * q[i];
      acc[r] += float(sum) * (wd[b] * a.d[r * nb + b]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r * out_stride] = acc[r];
#endif
}

struct Acts16 {  // int16 activation rows (the LM head's)
  const int16_t* q;
  const float* d;
  int64_t k;
  Acts16 rows_from(int64_t r0) const { return Acts16{q + r0 * k, d + r0 * (k / QK), k}; }
};

// Q8_0 weight rows j..j+NT-1 against int16 activation rows 0..MT-1 (NT * MT <= 8), as
// q4_1_tile: one accumulator per (weight row, activation row), the same additions in the same
// order whatever the tile
template <int NT, int MT>
void q8_0_16_tile(const int8_t* codes, const float* wd, int64_t j, const Acts16& a, float* out,
                  int64_t out_stride) {
  const int64_t k = a.k, nb = k / QK;
#ifdef RADIXLM_AVX2
  static_assert(NT * MT <= 8, "eight accumulators");
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int n = 0; n < NT; ++n) {  // a weight row's block against the MT rows
      const __m128i* c = reinterpret_cast<const __m128i*>(codes + (j + n) * k + b * QK);
      if (MT <= PREFETCH_MT) prefetch(reinterpret_cast<const int8_t*>(c) + PREFETCH_ROWS * k);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(c));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(c + 1));
      const __m256 wdv = _mm256_broadcast_ss(wd + (j + n) * nb + b);
      for (int r = 0; r < MT; ++r) {
        const __m256i* q = reinterpret_cast<const __m256i*>(a.q + r * k + b * QK);
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(q)),
                                           _mm256_madd_epi16(w1, _mm256_loadu_si256(q + 1)));
        const __m256 sc = _mm256_mul_ps(wdv, _mm256_broadcast_ss(a.d + r * nb + b));
        acc[n * MT + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[n * MT + r]);
      }
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, hsum8(acc));
  for (int n = 0; n < NT; ++n) {
    for (int r = 0; r < MT; ++r) out[r * out_stride + n] = sums[n * MT + r];
  }
#else
  for (int n = 0; n < NT; ++n) {
    const int8_t* row = codes + (j + n) * k;
    for (int r = 0; r < MT; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int16_t* q = a.q + r * k + b * QK;
        int sum = 0;
        for (int i = 0; i < QK; ++i) sum += row[b * QK + i] * q[i];
        acc += float(sum) * (wd[(j + n) * nb + b] * a.d[r * nb + b]);
      }
      out[r * out_stride + n] = acc;
    }
  }
#endif
}

template <typename T>
Acts16 quantize16(const T* x, int64_t m, int64_t x_stride, int64_t k) {
  static thread_local std::vector<int16_t> q;
  static thread_local std::vector<float> d;
  q.resize(m * k);
  d.resize(m * (k / QK));
  for (int64_t r = 0; r < m; ++r) {
    quantize_row16(x + r * x_stride, k, q.data() + r * k, d.data() + r * (k / QK));
  }
  return Acts16{q.data(), d.data(), k};
}

template <typename T>
Acts quantize(const T* x, int64_t m, int64_t x_stride, int64_t k) {
  static thread_local std::vector<int8_t> q, qp;
  static thread_local std::vector<float> d, s, dx;
  const int64_t nb = k / QK, sp = Acts::s_stride(k), xp = Acts::dx_stride(k);
  q.resize(m * k);
  qp.resize(m * k);
  d.resize(m * nb);
  s.assign(m * sp, 0.f);
  dx.resize(m * xp);
  for (int64_t r = 0; r < m; ++r) {
    int8_t* qr = q.data() + r * k;
    const float* dr = d.data() + r * nb;
    quantize_row(x + r * x_stride, k, qr, d.data() + r * nb, s.data() + r * sp);
    int8_t* pr = qp.data() + r * k;
    std::memcpy(pr, qr, k);  // an odd last block keeps its layout
    for (int64_t b = 0; b + 1 < nb; b += 2) {  // [b lo, b+1 lo, b hi, b+1 hi], 16 each
      const int8_t* src = qr + b * QK;
      std::memcpy(pr + b * QK, src, 16);
      std::memcpy(pr + b * QK + 16, src + 32, 16);
      std::memcpy(pr + b * QK + 32, src + 16, 16);
      std::memcpy(pr + b * QK + 48, src + 48, 16);
    }
    float* xr = dx.data() + r * xp;
    for (int64_t b = 0; b < nb; ++b) {  // d[b] x 4 in its half of the pair's 8 lanes
      float* lanes = xr + (b / 2) * 8 + (b % 2) * 4;
      for (int i = 0; i < 4; ++i) lanes[i] = dr[b];
      if (b % 2 == 0 && b + 1 == nb) {  // an odd last block: all 8 lanes
        for (int i = 4; i < 8; ++i) lanes[i] = dr[b];
      }
    }
  }
  return Acts{q.data(), d.data(), s.data(), k, qp.data(), dx.data()};
}

// out[m, n] = x[m, k] . W[n, k]; Row(n, acts, out, stride) handles MT rows per instantiation
template <typename A, typename RowFn>
void gemm_row(const A& a, int64_t m, int64_t n, float* out, const RowFn& row, int64_t j) {
  for (int64_t r0 = 0; r0 < m; r0 += 4) {
    const A t = a.rows_from(r0);
    float* o = out + r0 * n + j;
    switch (std::min<int64_t>(4, m - r0)) {
      case 4: row.template operator()<4>(j, t, o, n); break;
      case 3: row.template operator()<3>(j, t, o, n); break;
      case 2: row.template operator()<2>(j, t, o, n); break;
      default: row.template operator()<1>(j, t, o, n); break;
    }
  }
}

template <typename A, typename RowFn>
void gemm(A a, int64_t m, int64_t n, float* out, int threads, RowFn row) {
  const bool par = threads > 1 && n * a.k * m >= (int64_t(1) << 16);
  #pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t j = 0; j < n; ++j) gemm_row(a, m, n, out, row, j);
}

struct Q80 {
  const int8_t* codes;
  const float* d;
  int64_t k;
  template <int MT>
  void operator()(int64_t j, Acts a, float* o, int64_t stride) const {
    q8_0_rows<MT>(codes + j * k, d + j * (k / QK), k, a, o, stride);
  }
};

struct Q80x16Tiles {
  static constexpr bool kWide = false;  // one weight row a tile (1.5-2x faster at 1-4 rows)
  const int8_t* codes;
  const float* d;
  template <int NT, int MT>
  void tile(int64_t j, const Acts16& a, float* out, int64_t out_stride) const {
    q8_0_16_tile<NT, MT>(codes, d, j, a, out, out_stride);
  }
};

constexpr int64_t SPAN = 16;  // weight rows per parallel work item of the tiled kernels

// out[m, n] = x[m, k] . W[n, k] through W's tiles, OpenMP threads over spans of SPAN rows
template <typename W, typename A>
void tiled(const W& w, const A& a, int64_t m, int64_t n, float* out, int threads) {
  const bool par = threads > 1 && n * a.k * m >= (int64_t(1) << 16);
  #pragma omp parallel for num_threads(threads) schedule(static) if (par)
  for (int64_t j0 = 0; j0 < n; j0 += SPAN) tiled_span(w, a, m, n, j0, std::min(n, j0 + SPAN), out);
}

template <typename T>
void q4_1(const T* x, int64_t m, int64_t x_stride, int64_t k, const uint8_t* codes,
          const uint16_t* d, const uint16_t* mins, int64_t n, float* out, int threads) {
  tiled(Q41Tiles{Q41{codes, d, mins, k}}, quantize(x, m, x_stride, k), m, n, out, threads);
}

template <typename T>
void q8_0(const T* x, int64_t m, int64_t x_stride, int64_t k, const int8_t* codes,
          const float* d, int64_t n, float* out, int threads) {
  gemm(quantize(x, m, x_stride, k), m, n, out, threads, Q80{codes, d, k});
}

template <typename T>
void q8_0_16(const T* x, int64_t m, int64_t x_stride, int64_t k, const int8_t* codes,
             const float* d, int64_t n, float* out, int threads) {
  tiled(Q80x16Tiles{codes, d}, quantize16(x, m, x_stride, k), m, n, out, threads);
}

}  // namespace

extern "C" {

// output rows [j0, j1) of q4_1_f32, on the calling thread (cpu_step.py takes its address):
// `fresh` quantises x into the thread's buffers, else the thread's last quantised x is reused
void q4_1_span_f32(const float* x, int64_t m, int64_t x_stride, int64_t k, const uint8_t* codes,
                   const uint16_t* d, const uint16_t* mins, int64_t n, int64_t j0, int64_t j1,
                   float* out, int fresh) {
  static thread_local Acts a;
  if (fresh) a = quantize(x, m, x_stride, k);
  tiled_span(Q41Tiles{Q41{codes, d, mins, k}}, a, m, n, j0, j1, out);
}

// output rows [j0, j1) of q8_0_x16_f32 (the LM head), on the calling thread; `fresh` as above
void q8_0_x16_span_f32(const float* x, int64_t m, int64_t x_stride, int64_t k,
                       const int8_t* codes, const float* d, int64_t n, int64_t j0, int64_t j1,
                       float* out, int fresh) {
  static thread_local Acts16 a;
  if (fresh) a = quantize16(x, m, x_stride, k);
  tiled_span(Q80x16Tiles{codes, d}, a, m, n, j0, j1, out);
}

// the Q4_1 weights' layout these kernels take: 1, float16 scales and mins (absent: float32)
int radixlm_q4_1_layout() { return 1; }

// 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI: the dot product this build runs
int radixlm_gguf_isa() {
#if defined(RADIXLM_VNNI)
  return 3;
#elif defined(RADIXLM_AVXVNNI)
  return 2;
#elif defined(RADIXLM_AVX2)
  return 1;
#else
  return 0;
#endif
}

void q4_1_f32(const float* x, int64_t m, int64_t x_stride, int64_t k, const uint8_t* codes,
              const uint16_t* d, const uint16_t* mins, int64_t n, float* out, int threads) {
  q4_1(x, m, x_stride, k, codes, d, mins, n, out, threads);
}
void q4_1_bf16(const uint16_t* x, int64_t m, int64_t x_stride, int64_t k,
               const uint8_t* codes, const uint16_t* d, const uint16_t* mins, int64_t n, float* out,
               int threads) {
  q4_1(x, m, x_stride, k, codes, d, mins, n, out, threads);
}
void q8_0_f32(const float* x, int64_t m, int64_t x_stride, int64_t k, const int8_t* codes,
              const float* d, int64_t n, float* out, int threads) {
  q8_0(x, m, x_stride, k, codes, d, n, out, threads);
}
void q8_0_bf16(const uint16_t* x, int64_t m, int64_t x_stride, int64_t k, const int8_t* codes,
               const float* d, int64_t n, float* out, int threads) {
  q8_0(x, m, x_stride, k, codes, d, n, out, threads);
}

void q8_0_x16_f32(const float* x, int64_t m, int64_t x_stride, int64_t k, const int8_t* codes,
                  const float* d, int64_t n, float* out, int threads) {
  q8_0_16(x, m, x_stride, k, codes, d, n, out, threads);
}
void q8_0_x16_bf16(const uint16_t* x, int64_t m, int64_t x_stride, int64_t k,
                   const int8_t* codes, const float* d, int64_t n, float* out, int threads) {
  q8_0_16(x, m, x_stride, k, codes, d, n, out, threads);
}

}  // extern "C"
"""
