// Attention over a float32 cache on AVX2 + FMA (CPUs without AVX-512).
// Part of attention.cc's translation unit, included by it alone.
#pragma once

#include <algorithm>

#include "attention_keys.h"
#include "simd.h"

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// Vectors of a head's values summed in one pass of the AVX2 path's weighted sums: the largest power of two with
// HB of them in 12 registers (CC, a head's vectors, is 8 or 16).
constexpr int ValuePart(int CC, int HB) {
  int part = CC;
  while (part > 1 && part * HB > 12) part /= 2;
  return part;
}

// ScoreRuns of the AVX2 path: HB heads of one row against NV runs of at most 8 keys, the same FMA chains (the
// same bits). Full runs (8 keys) are plain loads; a run cut by its block or the row's end, masked ones.
template <int HB, int NV>
static inline void ScoreRuns8(const float* qg, int64_t D, int64_t BS, const KeyRun* runs, int64_t L, float* scores) {
  bool full = true;
  __m256i m[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) m[v] = Lanes(runs[v].n), full = full && runs[v].n == 8;
  __m256 acc[NV][HB];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) acc[v][h] = _mm256_setzero_ps();
  auto chains = [&](auto load) {
    for (int64_t d = 0; d < D; ++d) {
      __m256 k[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) k[v] = load(v, runs[v].kt + d * BS);
#pragma GCC unroll 4
      for (int h = 0; h < HB; ++h) {
        const __m256 q = _mm256_set1_ps(qg[h * D + d]);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[v][h] = _mm256_fmadd_ps(q, k[v], acc[v][h]);
      }
    }
  };
  if (full) {
    chains([](int, const float* at) { return _mm256_loadu_ps(at); });
  } else {
    chains([&](int v, const float* at) { return _mm256_maskload_ps(at, m[v]); });
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) _mm256_maskstore_ps(scores + h * L + runs[v].l, m[v], acc[v][h]);
}

// ScoreRuns8 of the last `count` (< NV) runs.
template <int HB, int NV>
static inline void ScoreFewerRuns8(int count, const float* qg, int64_t D, int64_t BS, const KeyRun* runs, int64_t L,
                                   float* scores) {
  if constexpr (NV > 1) {
    if (count == NV - 1) return ScoreRuns8<HB, NV - 1>(qg, D, BS, runs, L, scores);
    ScoreFewerRuns8<HB, NV - 1>(count, qg, D, BS, runs, L, scores);
  }
}

// AttendHeads of the AVX-512 path, 8 lanes wide, for D a multiple of 8: CC = D / 8 as a compile-time
// constant for the usual head sizes (64, 128: o in registers), 0 for the rest (read from L1). Each head's
// arithmetic is its own, in key order: a row's bits depend on its q, keys and values alone.
template <int CC, int HB>
static void AttendHeads8(const float* qg, int64_t D, const float* K, const float* V, int64_t kv_base, int64_t BS,
                         const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
  // (long: the scores, softmax and weighted sums of a pass keep their vectors in registers across it)
  const int64_t C = CC > 0 ? CC : D / 8;
  auto each_key = [&](const float* base, auto&& visit) { ForEachKey(base, kv_base, BS, D, table, first, L, visit); };
  constexpr int NV = std::max(1, std::min(4, 10 / HB));  // runs a pass: NV HB chains and NV keys in 16 registers
  KeyRun runs[NV];
  int pending = 0;
  ForEachKeyRun(K, kv_base, BS, D, table, first, L, 8, [&](int64_t l, const float* kt, int64_t n) {
    runs[pending++] = {l, kt, n};
    if (pending == NV) ScoreRuns8<HB, NV>(qg, D, BS, runs, L, scores), pending = 0;
  });
  ScoreFewerRuns8<HB, NV>(pending, qg, D, BS, runs, L, scores);
  float inverse[HB];
  for (int h = 0; h < HB; ++h) {
    float* row = scores + h * L;
    float most = -INFINITY;
    int64_t l = 0;
    if (L >= 8) {
      __m256 top = _mm256_loadu_ps(row);
      for (l = 8; l + 8 <= L; l += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + l));
      most = Max8(top);
    }
    for (; l < L; ++l) most = std::max(most, row[l]);
    const __m256 shift = _mm256_set1_ps(most);
    __m256 total = _mm256_setzero_ps();
    for (l = 0; l + 8 <= L; l += 8) {
      const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(row + l), shift));
      _mm256_storeu_ps(row + l, e);
      total = _mm256_add_ps(total, e);
    }
    if (l < L) {
      const __m256i lanes = Lanes(L - l);
      const __m256 e = _mm256_and_ps(Exp8(_mm256_sub_ps(_mm256_maskload_ps(row + l, lanes), shift)),
                                     _mm256_castsi256_ps(lanes));
      _mm256_maskstore_ps(row + l, lanes, e);
      total = _mm256_add_ps(total, e);
    }
    inverse[h] = 1.f / Add8(total);
  }
  if constexpr (CC > 0) {
    // A part of the heads' vectors at a time, for all HB heads: at most 12 sums in AVX2's 16 registers (all
    // of them at once, 24 at D = 64, spilled to the stack; a 512-token SmolLM2 layer's attention took 1.1x
    // this). Each sum over the keys in order, as before: the same bits.
    constexpr int CP = ValuePart(CC, HB);
    for (int part = 0; part < CC; part += CP) {
      __m256 o[HB][CP];
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < CP; ++c) o[h][c] = _mm256_setzero_ps();
      ForEachRun(V + 8 * part, kv_base, BS, D, table, first, L, [&](int64_t l, const float* vr, int64_t run) {
        __m256 acc[HB][CP];  // (registers: see the NOTE at ForEachRun)
        for (int h = 0; h < HB; ++h)
          for (int c = 0; c < CP; ++c) acc[h][c] = o[h][c];
        for (int64_t j = 0; j < run; ++j, vr += D) {
          __m256 v[CP];
          for (int c = 0; c < CP; ++c) v[c] = _mm256_loadu_ps(vr + 8 * c);
          for (int h = 0; h < HB; ++h) {
            const __m256 p = _mm256_set1_ps(scores[h * L + l + j]);
            for (int c = 0; c < CP; ++c) acc[h][c] = _mm256_fmadd_ps(p, v[c], acc[h][c]);
          }
        }
        for (int h = 0; h < HB; ++h)
          for (int c = 0; c < CP; ++c) o[h][c] = acc[h][c];
      });
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < CP; ++c)
          _mm256_storeu_ps(out + h * D + 8 * (part + c), _mm256_mul_ps(o[h][c], _mm256_set1_ps(inverse[h])));
    }
  } else {
    for (int h = 0; h < HB; ++h)
      for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(out + h * D + 8 * c, _mm256_setzero_ps());
    each_key(V, [&](int64_t l, const float* vr) {
      for (int h = 0; h < HB; ++h) {
        const __m256 p = _mm256_set1_ps(scores[h * L + l]);
        float* o = out + h * D;
        for (int64_t c = 0; c < C; ++c)
          _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), _mm256_loadu_ps(o + 8 * c)));
      }
    });
    for (int h = 0; h < HB; ++h) {
      const __m256 scale = _mm256_set1_ps(inverse[h]);
      for (int64_t c = 0; c < C; ++c)
        _mm256_storeu_ps(out + h * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(out + h * D + 8 * c), scale));
    }
  }
}

using Attend8Fn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, const int64_t*,
                           int64_t, int64_t, float*, float*);

// AttendHeads8 for D (a multiple of 8) and heads per pass (1 to kMostHeads).
static Attend8Fn Attend8For(int64_t D, int heads) {
  static constexpr Attend8Fn by_size[3][kMostHeads] = {
      {AttendHeads8<8, 1>, AttendHeads8<8, 2>, AttendHeads8<8, 3>, AttendHeads8<8, 4>},
      {AttendHeads8<16, 1>, AttendHeads8<16, 2>, AttendHeads8<16, 3>, AttendHeads8<16, 4>},
      {AttendHeads8<0, 1>, AttendHeads8<0, 2>, AttendHeads8<0, 3>, AttendHeads8<0, 4>}};
  return by_size[D == 64 ? 0 : D == 128 ? 1 : 2][heads - 1];
}
#endif
