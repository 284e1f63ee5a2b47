// Attention over a float32 cache on AVX-512 (one row, or two consecutive rows of one sequence).
// Part of attention.cc's translation unit (static functions it dispatches to), included by it alone.
#pragma once

#include <algorithm>
#include <utility>

#include "attention_keys.h"
#include "simd.h"

#if defined(__AVX512F__)
// Each head's scores of keys first .. first + count - 1 (count <= 16; the rest of dots are zeroed) from its 16
// vectors of partial sums (dots[h][l % 16]), into scores [HB][L].
template <int HB>
static inline void StoreScores(__m512 (&dots)[HB][16], int64_t first, int64_t count, int64_t L, float* scores) {
  for (int h = 0; h < HB; ++h) {
    for (int64_t i = count; i < 16; ++i) dots[h][i] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(scores + h * L + first, Tail(count), Sum16(dots[h]));
  }
}

// Lane i: the largest of a row's scores i, i + 16, ... (of its L): whole chunks unmasked, in two chains (a maximum
// is exact in any order), then the masked tail.
static inline __m512 LaneMax(const float* row, int64_t L) {
  __m512 top = _mm512_set1_ps(-INFINITY), other = top;
  int64_t l = 0;
  for (; l + 32 <= L; l += 32) {
    top = _mm512_max_ps(top, _mm512_loadu_ps(row + l));
    other = _mm512_max_ps(other, _mm512_loadu_ps(row + l + 16));
  }
  for (; l < L; l += 16) top = _mm512_mask_max_ps(top, Tail(L - l), top, _mm512_maskz_loadu_ps(Tail(L - l), row + l));
  return _mm512_max_ps(top, other);
}

// The largest of a row's L scores, in every lane.
static inline __m512 RowMax(const float* row, int64_t L) {
  return _mm512_set1_ps(_mm512_reduce_max_ps(LaneMax(row, L)));
}

// Each of HB rows of L scores (scores [HB][L]) -> e^(score - the row's maximum), in place, and 1 / their sum.
template <int HB>
static inline void Softmax(float* scores, int64_t L, __m512 (&inverse)[HB]) {
  for (int h = 0; h < HB; ++h) {
    float* row = scores + h * L;
    const __m512 most = RowMax(row, L);
    __m512 total = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l += 16) {
      const __mmask16 m = Tail(L - l);
      const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + l), most));
      _mm512_mask_storeu_ps(row + l, m, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(m, e));
    }
    inverse[h] = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  }
}

// The scores q . k of R rows' HB heads against NV runs of keys (ForEachKeyRun, at most 16 keys each), a key a lane:
// for each d in order, lane i += q[d] * k_i[d] (one FMA chain per key and head: a score's bits are a function of
// its q and key alone, on every path: the AVX2 and scalar ones run the same chain). A key's values are one
// (masked) load a d from the transposed block, shared by the R HB chains; the NV runs are independent chains for
// the FMA units' latency. Row r keeps keys l < Ls[r] (a pair's second row sees one key more), in scores[r][h][l].
// Before: keys as rows of the block, 16 of them reduced together (Sum16: ~3 shuffles and adds a key and head)
// and stored on the stack a key at a time; the 512-token SmolLM2 prefill's attention took 1.4x this.
template <int R, int HB, int NV>
static inline void ScoreRuns(const float* const (&qg)[R], int64_t D, int64_t BS, const KeyRun* runs,
                             const int64_t (&Ls)[R], float* const (&scores)[R]) {
  __mmask16 m[NV];
  for (int v = 0; v < NV; ++v) m[v] = Tail(runs[v].n);
  __m512 acc[NV][R][HB];
  for (int v = 0; v < NV; ++v)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HB; ++h) acc[v][r][h] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm512_maskz_loadu_ps(m[v], runs[v].kt + d * BS);
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HB; ++h) {
        const __m512 q = _mm512_set1_ps(qg[r][h * D + d]);
        for (int v = 0; v < NV; ++v) acc[v][r][h] = _mm512_fmadd_ps(q, k[v], acc[v][r][h]);
      }
  }
  // (every index a constant: an array indexed at run time stays in memory, and GCC then stored every
  // accumulator after each d, 1.2x the time of the pass)
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
      const int64_t l = runs[v].l;
      const __mmask16 keep = l < Ls[r] ? m[v] & Tail(Ls[r] - l) : 0;
#pragma GCC unroll 4
      for (int h = 0; h < HB; ++h) _mm512_mask_storeu_ps(scores[r] + h * Ls[r] + l, keep, acc[v][r][h]);
    }
}

// ScoreRuns of the last `count` (< NV) runs.
template <int R, int HB, int NV>
static inline void ScoreFewerRuns(int count, const float* const (&qg)[R], int64_t D, int64_t BS, const KeyRun* runs,
                                  const int64_t (&Ls)[R], float* const (&scores)[R]) {
  if constexpr (NV > 1) {
    if (count == NV - 1) return ScoreRuns<R, HB, NV - 1>(qg, D, BS, runs, Ls, scores);
    ScoreFewerRuns<R, HB, NV - 1>(count, qg, D, BS, runs, Ls, scores);
  }
}

// Runs scored together: 12 chains (as many as fit beside the keys' vectors), at most 8 runs.
template <int R, int HB>
constexpr int RunsPerPass() { return std::max(1, std::min(8, 12 / (R * HB))); }

// HB query heads (of the G sharing one KV head) of R rows against their keys: row r sees keys first ..
// first + L + r - 1 (R = 2: two consecutive rows of one sequence, the second seeing one key more). Scores
// (ScoreRuns), softmax with the row's maximum subtracted (exp 16 keys at a time), then o = sum p v. Each key's
// and value's row is loaded once for the R rows' HB heads (the keys of a 512-token prompt do not stay in L1,
// and reading them once per head made prefill attention L2-bound; a second row in the same pass: 0.91-0.93x a
// 512-token SmolLM2 layer's attention on 2 threads of a Xeon). C = ceil(D / 16), HB and R are compile-time
// constants so that o lives in registers. Each head's arithmetic is its own, in key order (a second row's last
// key after the others), whatever HB and R are and whatever the row's neighbours: the result is a function of
// the row's q, keys and values alone (crash recompute and chunking give the same bits, paired or not).
template <int C, int HB, int R>
static void AttendHeadsRows(const float* const (&qg)[R], int64_t D, const float* K, const float* V, int64_t kv_base,
                            int64_t BS, const int64_t* table, int64_t first, int64_t L, float* const (&scores)[R],
                            float* const (&out)[R]) {
  // (long: the scores, softmax and weighted sums of a pass keep their vectors in registers across it)
  static_assert(R == 1 || (R == 2 && HB * C <= 12), "AttendHeadsRows: o would not stay in registers");
  __mmask16 masks[C];
  for (int c = 0; c < C; ++c) masks[c] = Tail(D - 16 * c);
  int64_t Ls[R];
  for (int r = 0; r < R; ++r) Ls[r] = L + r;
  constexpr int NV = RunsPerPass<R, HB>();
  KeyRun runs[NV];
  int pending = 0;
  ForEachKeyRun(K, kv_base, BS, D, table, first, L + R - 1, 16, [&](int64_t l, const float* kt, int64_t n) {
    runs[pending++] = {l, kt, n};
    if (pending == NV) ScoreRuns<R, HB, NV>(qg, D, BS, runs, Ls, scores), pending = 0;
  });
  ScoreFewerRuns<R, HB, NV>(pending, qg, D, BS, runs, Ls, scores);
  __m512 inverse[R][HB];
  for (int r = 0; r < R; ++r) Softmax<HB>(scores[r], L + r, inverse[r]);
  __m512 o[R][HB][C];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c) o[r][h][c] = _mm512_setzero_ps();
  ForEachRun(V, kv_base, BS, D, table, first, L, [&](int64_t l, const float* vr, int64_t run) {
    __m512 acc[R][HB][C];  // (registers: see the NOTE at ForEachRun)
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < C; ++c) acc[r][h][c] = o[r][h][c];
    for (int64_t j = 0; j < run; ++j, vr += D) {
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_maskz_loadu_ps(masks[c], vr + 16 * c);
      for (int h = 0; h < HB; ++h)
        for (int r = 0; r < R; ++r) {
          const __m512 p = _mm512_set1_ps(scores[r][h * (L + r) + l + j]);
          for (int c = 0; c < C; ++c) acc[r][h][c] = _mm512_fmadd_ps(p, v[c], acc[r][h][c]);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < C; ++c) o[r][h][c] = acc[r][h][c];
  });
  if constexpr (R == 2) {  // row 1's last key
    ForEachKey(V, kv_base, BS, D, table, first + L, 1, [&](int64_t, const float* vr) {
      for (int c = 0; c < C; ++c) {
        const __m512 v = _mm512_maskz_loadu_ps(masks[c], vr + 16 * c);
        for (int h = 0; h < HB; ++h) o[1][h][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[1][h * (L + 1) + L]), v, o[1][h][c]);
      }
    });
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < C; ++c)
        _mm512_mask_storeu_ps(out[r] + h * D + 16 * c, masks[c], _mm512_mul_ps(o[r][h][c], inverse[r][h]));
}

// One row (AttendHeadsRows with R = 1).
template <int C, int HB>
static void AttendHeads(const float* qg, int64_t D, const float* K, const float* V, int64_t kv_base, int64_t BS,
                        const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
  AttendHeadsRows<C, HB, 1>({qg}, D, K, V, kv_base, BS, table, first, L, {scores}, {out});
}

using AttendFn = void (*)(const float*, int64_t, const float*, const float*, int64_t, int64_t, const int64_t*,
                          int64_t, int64_t, float*, float*);

// AttendHeads for D, by heads per pass (1 to 4; 1 only past D = 128, where o fills the registers).
template <int... C>
static AttendFn AttendFor(int64_t D, int heads, std::integer_sequence<int, C...>) {
  static constexpr AttendFn table[][kMostHeads] = {
      {AttendHeads<C + 1, 1>, AttendHeads<C + 1, (C < 8 ? 2 : 1)>, AttendHeads<C + 1, (C < 8 ? 3 : 1)>,
       AttendHeads<C + 1, (C < 8 ? 4 : 1)>}...};
  return table[(D + 15) / 16 - 1][heads - 1];
}

// One row's attention for the G query heads sharing KV head kvh, in passes of up to 4 heads (at most 1
// past D = 128): the same passes for every row of a model, so a row's bits do not depend on its batch.
static void AttendOne(const float* qg, int64_t G, int64_t D, const float* K, const float* V, int64_t kv_base,
                      int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
  const int most = D > 128 ? 1 : kMostHeads;
  for (int64_t g = 0; g < G;) {
    const int heads = static_cast<int>(std::min<int64_t>(most, G - g));
    AttendFor(D, heads, std::make_integer_sequence<int, 16>())(qg + g * D, D, K, V, kv_base, BS, table, first, L,
                                                              scores, out + g * D);
    g += heads;
  }
}

// Two consecutive rows of one sequence (AttendHeadsRows with R = 2): row 1 sees row 0's L keys (from key 0) and
// key L. C <= 4 (D <= 64): both rows' o stay in registers (2 HB C vectors, at most 24).
template <int C, int HB>
static void AttendHeadsPair(const float* qg0, const float* qg1, int64_t D, const float* K, const float* V,
                            int64_t kv_base, int64_t BS, const int64_t* table, int64_t L, float* scores0,
                            float* scores1, float* out0, float* out1) {
  AttendHeadsRows<C, HB, 2>({qg0, qg1}, D, K, V, kv_base, BS, table, 0, L, {scores0, scores1}, {out0, out1});
}

// Heads per pass of a pair of rows: both rows' o in registers (C = 1: 4, 2: 4, 3: 4, 4: 3).
static constexpr int PairHeadsPerPass(int C) { return C <= 3 ? kMostHeads : 3; }

using AttendPairFn = void (*)(const float*, const float*, int64_t, const float*, const float*, int64_t, int64_t,
                              const int64_t*, int64_t, float*, float*, float*, float*);

template <int... C>
static AttendPairFn AttendPairFor(int64_t D, int heads, std::integer_sequence<int, C...>) {
  static constexpr AttendPairFn table[][kMostHeads] = {
      {AttendHeadsPair<C + 1, 1>, AttendHeadsPair<C + 1, std::min(2, PairHeadsPerPass(C + 1))>,
       AttendHeadsPair<C + 1, std::min(3, PairHeadsPerPass(C + 1))>,
       AttendHeadsPair<C + 1, std::min(4, PairHeadsPerPass(C + 1))>}...};
  return table[(D + 15) / 16 - 1][heads - 1];
}

// Whether rows b and b + 1 can be attended as a pair: consecutive positions of one sequence (the same blocks)
// and every key in view (no window cuts them). (Pairs need D <= 64 too: AttendRows checks it.)
static bool Pairable(int64_t b, int64_t BS, const int64_t* T, int64_t W, const int64_t* LEN, int64_t window) {
  if (LEN[b + 1] != LEN[b] + 1 || FirstKey(LEN[b + 1], window) != 0) return false;
  const int64_t blocks = (LEN[b + 1] + BS - 1) / BS;
  return std::equal(T + b * W, T + b * W + blocks, T + (b + 1) * W);
}

// The G query heads of rows b and b + 1 (Pairable) sharing one KV head, in passes of PairHeadsPerPass heads.
static void AttendPair(const float* qg0, const float* qg1, int64_t G, int64_t D, const float* K, const float* V,
                       int64_t kv_base, int64_t BS, const int64_t* table, int64_t L, float* scores0, float* scores1,
                       float* out0, float* out1) {
  const int most = PairHeadsPerPass(static_cast<int>((D + 15) / 16));
  for (int64_t g = 0; g < G;) {
    const int heads = static_cast<int>(std::min<int64_t>(most, G - g));
    AttendPairFor(D, heads, std::make_integer_sequence<int, 4>())(qg0 + g * D, qg1 + g * D, D, K, V, kv_base, BS,
                                                                 table, L, scores0, scores1, out0 + g * D,
                                                                 out1 + g * D);
    g += heads;
  }
}
#define FDCORE_ATTENTION_PAIRS 1
#endif
