"""C++ GEMVs for GGUF's block formats on the CPU: Q4_1 and Q8_0 weights, int8 activations.

At batch 1 a CPU decode step reads every weight once per token, and torch's packed int4 kernel
(``int4_cpu.py``) multiplies in bfloat16 floats. These kernels keep the weights in GGUF's own
blocks of 32 along the input dim and multiply in integers, as llama.cpp does:

* weights: Q4_1 (``w = code * d + m``, codes 0..15, one ``d`` and ``m`` per block; the int4
  linear layers) or Q8_0 (``w = code * d``, codes -127..127; the LM head);
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
  activation rows four at a time against each weight block read.

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
import ctypes
import os
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from radixlm.kernels.cpu_decode import compile_library
from radixlm.kernels.switch import KernelSwitch

BLOCK = 32
MAX_ROWS = 16  # activation rows the kernels are used for (decode batches); more: dense paths

SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if !defined(RADIXLM_SCALAR) && defined(__AVX2__)
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

inline float bf16_to_f32(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
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

// one row of K activations -> int8 codes, per-block scales and scaled sums (q8_1)
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* q, float* d, float* s) {
  float buf[QK];
  for (int64_t b = 0; b < k / QK; ++b) {
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) {
      if constexpr (sizeof(T) == 2) buf[i] = bf16_to_f32(x[b * QK + i]);
      else buf[i] = x[b * QK + i];
      amax = std::max(amax, std::fabs(buf[i]));
    }
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
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) {
      if constexpr (sizeof(T) == 2) buf[i] = bf16_to_f32(x[b * QK + i]);
      else buf[i] = x[b * QK + i];
      amax = std::max(amax, std::fabs(buf[i]));
    }
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

struct Q41 {  // a Q4_1 weight [n, k]
  const uint8_t* codes;
  const float* d;
  const float* m;
  int64_t k;
};

#ifdef RADIXLM_AVX2
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
  const float* wd = w.d + j * nb;
  const float* wm = w.m + j * nb;
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  // the min terms m * s, 8 blocks a step (the activations' sums are zero past nb)
  for (int64_t b = 0; b < nb; b += 8) {
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(nb - b)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int n = 0; n < NT; ++n) {
      const __m256 m = _mm256_maskload_ps(wm + n * nb + b, live);
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
      const __m256i raw = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(codes + n * (k / 2) + p * QK));
      const __m256i lo = _mm256_and_si256(raw, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      const __m256 wdv = _mm256_permutevar8x32_ps(
          _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(wd + n * nb + 2 * p))),
          pick);
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
      const __m256 wdv = _mm256_broadcast_ss(wd + n * nb + b);
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
    const float* wd = w.d + (j + n) * nb;
    const float* wm = w.m + (j + n) * nb;
    for (int r = 0; r < MT; ++r) {
      float acc = 0.f, mins = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* c = codes + b * 16;
        const int8_t* q = a.q + r * k + b * QK;
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += (c[i] & 15) * q[i] + (c[i] >> 4) * q[i + 16];
        acc += float(sum) * (wd[b] * a.d[r * nb + b]);
        mins += wm[b] * a.s[r * sp + b];
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
          const float* d, const float* mins, int64_t n, float* out, int threads) {
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
                   const float* d, const float* mins, int64_t n, int64_t j0, int64_t j1,
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
              const float* d, const float* mins, int64_t n, float* out, int threads) {
  q4_1(x, m, x_stride, k, codes, d, mins, n, out, threads);
}
void q4_1_bf16(const uint16_t* x, int64_t m, int64_t x_stride, int64_t k,
               const uint8_t* codes, const float* d, const float* mins, int64_t n, float* out,
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

FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
VARIANTS = {"native": (), "avx2": ("-DRADIXLM_NO_VNNI",), "scalar": ("-DRADIXLM_SCALAR",)}
ISA_NAMES = ("scalar", "AVX2", "AVX-VNNI", "AVX-512 VNNI")

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
    engine). Not thread-safe against other callers of :func:`library`."""
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


def serves(x: torch.Tensor, rows: int) -> bool:
    """Whether the kernels take ``rows`` rows of activations like ``x`` (CPU, float32 or
    bfloat16, at most ``MAX_ROWS`` rows)."""
    return (
        rows <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and available()
    )


class Q4_1(NamedTuple):
    codes: torch.Tensor  # [N, K / 2] uint8: per block of 32, byte i = code i | code (i + 16) << 4
    d: torch.Tensor  # [N, K / 32] float32
    m: torch.Tensor  # [N, K / 32] float32


class Q8_0(NamedTuple):
    codes: torch.Tensor  # [N, K] int8, -127..127
    d: torch.Tensor  # [N, K / 32] float32


def pack_q4_1(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Q4_1:
    """GGUF's Q4_1 block layout from codes ``[N, K]`` (0..15) and per-32 scales and mins."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or mins.shape != scales.shape:
        raise ValueError(f"Q4_1 needs K divisible by {BLOCK} and one scale and min per block")
    blocks = codes.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    packed = blocks[..., :16] | (blocks[..., 16:] << 4)
    return Q4_1(
        packed.reshape(n, k // 2).contiguous(),
        scales.float().contiguous(),
        mins.float().contiguous(),
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
