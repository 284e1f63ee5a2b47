// fdcore's Paddle operators. Attention over a paged KV cache reads each block in place (no gather):
//
// q        [B, H, D]          float32, already scaled by 1/sqrt(D)
// k_cache  [KVH, NB, D, BS]   float32, each block's keys transposed (see ScoreRuns), or bfloat16
//          [KVH, NB, BS, D]   (see AttendHeadsBf16) (the worker's cache of one layer, shared with numpy)
// v_cache  [KVH, NB, BS, D]   float32, or bfloat16
// tables   [B, W]             int64, block ids of each row's sequence (padded)
// lengths  [B]                int64, keys each row attends to (its position + 1)
// out      [B, H, D]          float32
//
// Grouped-query attention: head h reads KV head h / (H / KVH). Softmax in float32
// with the running maximum subtracted, as the reference does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "bf16_bits.h"
#include "line_buffer.h"
#include "paddle/extension.h"

// linear_int8.cc: whether a loop over independent rows is shared out over the threads
__attribute__((visibility("hidden"))) bool RowsWorthSharing(int64_t rows, int64_t width);

// n values to bfloat16 bits, to nearest even; the width of a bfloat16 product's rounded row of n values
// (linear_bf16.cc; AVX512-BF16 CPUs only).
__attribute__((visibility("hidden"))) void RoundToBf16(const float* x, int64_t n, uint16_t* r);
__attribute__((visibility("hidden"))) int64_t Bf16RowWidth(int64_t n);

constexpr int kMostHeads = 4;     // query heads per pass over a row's keys (AVX-512: 1 past D = 128)
constexpr int64_t kFewestTasks = 8;  // (row, KV head) pairs below which attention is shared out by query head

// Visits a row's keys (or values) in runs of consecutive rows of one block, in order: visit(l, rows, run) for
// keys l .. l + run - 1 (l from 0) at rows, rows + D, ... (a division per block, not per key: BS is not a
// compile-time constant). (Prefetching the next block's rows measured no gain on SmolLM2's batch-1 decode,
// where a layer's cache comes from memory.)
template <typename T, typename Visit>
static inline void ForEachRun(const T* base, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                              int64_t first, int64_t L, Visit&& visit) {
  for (int64_t key = first, l = 0; key < first + L;) {
    const int64_t offset = key % BS, run = std::min(BS - offset, first + L - key);
    visit(l, base + (kv_base + table[key / BS] * BS + offset) * D, run);
    key += run, l += run;
  }
}

// The first key a row ending at `end` sees: window > 0 keeps its last `window` keys.
static inline int64_t FirstKey(int64_t end, int64_t window) { return (window > 0 && end > window) ? end - window : 0; }

// A run of consecutive keys of one transposed block (ForEachKeyRun): keys l .. l + n - 1, value d of key l + i
// at kt[d * BS + i].
struct KeyRun {
  int64_t l;
  const float* kt;
  int64_t n;
};

// Visits a row's keys in a float32 cache's transposed blocks ([D, BS] a block: a key's values BS apart) in runs of
// at most `width` consecutive keys of one block, in order: visit(l, kt, n) for keys l .. l + n - 1, key l + i's
// value d at kt[d * BS + i].
template <typename Visit>
static inline void ForEachKeyRun(const float* K, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                                 int64_t first, int64_t L, int64_t width, Visit&& visit) {
  for (int64_t key = first, l = 0; key < first + L;) {
    const int64_t offset = key % BS, n = std::min({BS - offset, first + L - key, width});
    visit(l, K + (kv_base + table[key / BS] * BS) * D + offset, n);
    key += n, l += n;
  }
}

// Visits a row's keys (or values) one by one, in order: visit(l, row) for key l (from 0).
template <typename T, typename Visit>
static inline void ForEachKey(const T* base, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                              int64_t first, int64_t L, Visit&& visit) {
  ForEachRun(base, kv_base, BS, D, table, first, L, [&](int64_t l, const T* rows, int64_t run) {
    for (int64_t j = 0; j < run; ++j) visit(l + j, rows + j * D);
  });
}

// NOTE: the weighted sums of values (o += p v) accumulate each run of keys in an array local to the run's visit,
// copied from and back to the row's: GCC (12) kept an accumulator array captured by reference in memory and
// stored all of it after every key (12 zmm stores a key at SmolLM2's 3 heads x 64 dims), and SmolLM2's 512-token
// prefill attention took 1.6-1.75x the time it takes now (one thread of a Zen 4 EPYC). The same sums in the
// same order: the same bits.

#if defined(__AVX512F__)
#include <immintrin.h>

// e^x for 16 floats (Cephes' expf: x = n ln2 + r with ln2 split in two, a degree-6 polynomial for e^r,
// then 2^n by vscalefps; within 2 ulp of libm's expf, 0 below -87 (see the end), +inf above 88.7). A lane's result
// depends on that lane only, so a row gets the same bits wherever it sits in a batch; libm's expf was
// scalar here (~12 cycles an element) and the softmax and SwiGLU spent most of their time in it.
static inline __m512 Exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(89.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  // below e^-87 (2^-126, the smallest normal float) the result is 0: a denormal weight would make
  // every product it enters (p v in attention) a microcode assist, ~100 cycles each
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), p, n);
}

static inline __mmask16 Tail(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// The reductions of 16 vectors by `op` (_mm512_add_ps, _mm512_max_ps), as one vector (lane i: v[i]'s): a tree of
// shuffles and ops, ~3 instructions a vector where a reduction of each alone takes ~10 and leaves its result in one
// lane. Each vector's lanes meet in the same tree whatever the other 15 hold.
template <typename Op>
static inline __m512 Reduce16(const __m512* v, Op op) {
  __m512 t[8], r[4];
  for (int i = 0; i < 8; ++i)  // blocks [a0 + a2, a1 + a3, b0 + b2, b1 + b3] (a block: 4 lanes)
    t[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // block k: vector 4 j + k's 4 partial sums
    r[j] = op(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0x88), _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], 0xDD));
  const __m512 h0 = op(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 h1 = op(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  const __m512d a = _mm512_castps_pd(h0), b = _mm512_castps_pd(h1);
  // lane 4 k + m holds vector 4 m + k's sum
  const __m512 z = op(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

static inline __m512 Sum16(const __m512* v) {
  return Reduce16(v, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); });
}

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

#if defined(__AVX512BF16__)
#include "exp2_bf16.h"
#define FDCORE_ATTENTION_BF16 1
// A bfloat16 cache (the default of a bfloat16 model: fdcore.models.llama.PagedKVCache): half the bytes a key
// or value, and the products in `vdpbf16ps`, two to a float32 lane. HB heads against a row's keys as
// AttendHeads does, C2 = D / 32: q rounded to bfloat16 (nearest even) and multiplied by each key's 32-value
// vectors, summed 16 keys at once (Sum16); softmax in float32; then the weights rounded to bfloat16 and
// o += p[l] v[l] + p[l + 1] v[l + 1], two keys per instruction (their values interleaved by
// vpunpck[lh]wd, which leaves the dimensions in an order undone at the store). Each head's arithmetic is
// its own, in key order, whatever HB and the row's neighbours: a row's bits are its q's, keys' and values'
// alone, as on the float32 path. A 512-token prefill's attention in 0.82x the float32 path's time (SmolLM2's
// shapes, one thread of a Zen 4 EPYC; 0.58x before both kept their sums of values in registers).

// e^(s - most) for 16 floats s <= most, given most_log2e = most log2 e: (s - most) log2 e in one FMA, then
// Exp2ForBf16 (to the precision of the bfloat16 weights these become).
static inline __m512 ExpDiffForBf16(__m512 s, __m512 most_log2e) {
  return Exp2ForBf16(_mm512_fmsub_ps(s, _mm512_set1_ps(kLog2E), most_log2e));
}

// A row's softmax weights as bfloat16: e^(score - the row's maximum) for its L scores (most_log2e: that maximum
// times log2 e), 0 after them, into p's first `width` values (width >= L; whole 16-lane chunks past L are written only
// up to width); returns the sums of e by lane (in float32, 16 lanes a chunk, in key order).
static inline __m512 Bf16RowWeights(const float* row, int64_t L, int64_t width, uint16_t* p, __m512 most_log2e) {
  __m512 total = _mm512_setzero_ps();
  int64_t l = 0;
  for (; l + 32 <= L; l += 32) {  // two chunks: one conversion of both (vcvtne2ps2bf16: 2 uops a 32, as 1 chunk's)
    const __m512 e0 = ExpDiffForBf16(_mm512_loadu_ps(row + l), most_log2e);
    const __m512 e1 = ExpDiffForBf16(_mm512_loadu_ps(row + l + 16), most_log2e);
    _mm512_storeu_si512(p + l, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    total = _mm512_add_ps(_mm512_add_ps(total, e0), e1);
  }
  for (; l + 16 <= L; l += 16) {  // whole chunks: no masks (the tail's below, the same arithmetic)
    const __m512 e = ExpDiffForBf16(_mm512_loadu_ps(row + l), most_log2e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + l), (__m256i)_mm512_cvtneps_pbh(e));
    total = _mm512_add_ps(total, e);
  }
  if (l < L) {
    const __mmask16 m = Tail(L - l);
    const __m512 e = _mm512_maskz_mov_ps(m, ExpDiffForBf16(_mm512_maskz_loadu_ps(m, row + l), most_log2e));
    _mm256_mask_storeu_epi16(p + l, Tail(width - l), (__m256i)_mm512_cvtneps_pbh(e));
    total = _mm512_add_ps(total, e);
  }
  return total;
}

// Up to 16 rows' softmax weights as bfloat16 (row n: L[n] scores at scores + n stride, weights at p + n p_stride,
// Bf16RowWeights) and 1 / each row's sum of e, in every lane of inverse[n]. The rows' maxima and sums are reduced all
// at once (Reduce16: a row's lanes in the same tree however many rows come along) and the reciprocals are one
// division: one row alone reduced its maximum and its sum by itself, ~40-60 cycles of latency each. Shared by the
// per-row and the tile paths, so a row's weights have the same bits in a decode step as in a prompt's tiles.
static inline void Bf16Weights(int rows, const float* scores, int64_t stride, const int64_t* L, int64_t width,
                               uint16_t* p, int64_t p_stride, __m512* inverse) {
  __m512 v[16];
  for (int n = 0; n < 16; ++n) v[n] = n < rows ? LaneMax(scores + n * stride, L[n]) : _mm512_setzero_ps();
  alignas(64) float most_log2e[16];
  _mm512_store_ps(most_log2e, _mm512_mul_ps(Reduce16(v, [](__m512 a, __m512 b) { return _mm512_max_ps(a, b); }),
                                            _mm512_set1_ps(kLog2E)));
  for (int n = 0; n < rows; ++n)
    v[n] = Bf16RowWeights(scores + n * stride, L[n], width, p + n * p_stride, _mm512_set1_ps(most_log2e[n]));
  for (int n = rows; n < 16; ++n) v[n] = _mm512_set1_ps(1.f);  // (no row: a sum that divides cleanly)
  alignas(64) float reciprocal[16];
  _mm512_store_ps(reciprocal, _mm512_div_ps(_mm512_set1_ps(1.f), Sum16(v)));
  for (int n = 0; n < rows; ++n) inverse[n] = _mm512_set1_ps(reciprocal[n]);
}

template <int C2, int HB>
static void AttendHeadsBf16(const float* qg, int64_t D, const uint16_t* K, const uint16_t* V, int64_t kv_base,
                            int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores,
                            uint16_t* weights, float* out) {
  auto each_key = [&](const uint16_t* base, auto&& visit) { ForEachKey(base, kv_base, BS, D, table, first, L, visit); };
  __m512bh q[HB][C2];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C2; ++c)
      q[h][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + h * D + 32 * c + 16), _mm512_loadu_ps(qg + h * D + 32 * c));
  __m512 dots[HB][16];
  each_key(K, [&](int64_t l, const uint16_t* kr) {
    __m512bh k[C2];
    for (int c = 0; c < C2; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kr + 32 * c);
    for (int h = 0; h < HB; ++h) {
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[h][0], k[0]);
      for (int c = 1; c < C2; ++c) acc = _mm512_dpbf16_ps(acc, q[h][c], k[c]);
      dots[h][l % 16] = acc;
    }
    if (l % 16 == 15) StoreScores<HB>(dots, l - 15, 16, L, scores);
  });
  if (L % 16) StoreScores<HB>(dots, L - L % 16, L % 16, L, scores);
  const int64_t L2 = L + (L & 1);  // the weights in pairs (a zero after an odd count)
  __m512 inverse[HB];
  int64_t lengths[HB];
  std::fill(lengths, lengths + HB, L);
  Bf16Weights(HB, scores, L, lengths, L2, weights, L2, inverse);
  __m512 o[HB][2 * C2];
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < 2 * C2; ++c) o[h][c] = _mm512_setzero_ps();
  // keys l and l + 1 into acc (o, or a run's copy in registers: see the NOTE at ForEachRun)
  auto pair = [&](__m512 (&acc)[HB][2 * C2], int64_t l, const uint16_t* va, const uint16_t* vb) {
    __m512bh v[2 * C2];  // 32 values: v[2 c] dims {0-3, 8-11, 16-19, 24-27} + 32 c, v[2 c + 1] the other 16
    for (int c = 0; c < C2; ++c) {
      const __m512i a = _mm512_loadu_si512(va + 32 * c), b = _mm512_loadu_si512(vb + 32 * c);
      v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    for (int h = 0; h < HB; ++h) {
      int32_t two;
      std::memcpy(&two, weights + h * L2 + l, sizeof(two));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(two);
      for (int c = 0; c < 2 * C2; ++c) acc[h][c] = _mm512_dpbf16_ps(acc[h][c], v[c], w);
    }
  };
  const uint16_t* even = nullptr;  // an even key whose partner is the next run's first
  ForEachRun(V, kv_base, BS, D, table, first, L, [&](int64_t l, const uint16_t* vr, int64_t run) {
    __m512 acc[HB][2 * C2];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < 2 * C2; ++c) acc[h][c] = o[h][c];
    int64_t j = 0;
    if (l % 2) pair(acc, l - 1, even, vr), j = 1;
    for (; j + 1 < run; j += 2) pair(acc, l + j, vr + j * D, vr + (j + 1) * D);
    if (j < run) even = vr + j * D;
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < 2 * C2; ++c) o[h][c] = acc[h][c];
  });
  if (L & 1) pair(o, L - 1, even, even);  // (its partner's weight is 0)
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < HB; ++h)
    for (int c = 0; c < C2; ++c) {
      const __m512 a = _mm512_mul_ps(o[h][2 * c], inverse[h]), b = _mm512_mul_ps(o[h][2 * c + 1], inverse[h]);
      _mm512_storeu_ps(out + h * D + 32 * c, _mm512_permutex2var_ps(a, low, b));
      _mm512_storeu_ps(out + h * D + 32 * c + 16, _mm512_permutex2var_ps(a, high, b));
    }
}

using AttendBf16Fn = void (*)(const float*, int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, const int64_t*,
                              int64_t, int64_t, float*, uint16_t*, float*);

// Heads per pass on the bfloat16 path: q and o in registers (4 at D = 64, 2 at 128, 1 past).
static inline int Bf16HeadsPerPass(int64_t D) { return D <= 64 ? 4 : D <= 128 ? 2 : 1; }

template <int... C>
static AttendBf16Fn AttendBf16For(int64_t D, int heads, std::integer_sequence<int, C...>) {
  static constexpr AttendBf16Fn table[][kMostHeads] = {
      {AttendHeadsBf16<C + 1, 1>, AttendHeadsBf16<C + 1, (C < 4 ? 2 : 1)>, AttendHeadsBf16<C + 1, (C < 2 ? 3 : 1)>,
       AttendHeadsBf16<C + 1, (C < 2 ? 4 : 1)>}...};
  return table[D / 32 - 1][heads - 1];
}

static void AttendOneBf16(const float* qg, int64_t G, int64_t D, const uint16_t* K, const uint16_t* V, int64_t kv_base,
                          int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, uint16_t* weights,
                          float* out) {
  const int most = Bf16HeadsPerPass(D);
  for (int64_t g = 0; g < G;) {
    const int heads = static_cast<int>(std::min<int64_t>(most, G - g));
    AttendBf16For(D, heads, std::make_integer_sequence<int, 8>())(qg + g * D, D, K, V, kv_base, BS, table, first, L,
                                                                  scores, weights, out + g * D);
    g += heads;
  }
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FDCORE_ATTENTION_TILES 1
// AMX tiles for a bfloat16 cache (where the bfloat16 products run on tiles: linear_bf16.cc's Bf16Tiles): up to 16
// query rows at once, the G heads of consecutive positions of one sequence that share a KV head (a decode row's G
// heads alone). Scores: 16 keys x 32 dims straight from the cache block (an A tile) against the query rows' dims in
// pairs (B), 16 keys x 16 query rows a `tdpbf16ps`, turned to a row per query; softmax per row as AttendHeadsBf16's;
// then o += p v with the weights' rows as A tiles (32 keys) and pairs of keys' values interleaved a dim at a time as
// B tiles (16 dims). A query row's arithmetic is its own, over the same 16- and 32-key chunks from key 0 whatever
// rows share its tiles: where its neighbours see more keys, its weights for them are exactly 0 (and values past the
// last key any row sees are 0), so its bits are the same in a decode step as in any prefill chunk. Taken for D of 32
// or 64, G <= 16, a block size a multiple of 16 and no sliding window (TilesTake); otherwise AttendHeadsBf16.
constexpr int kQueryTile = 16;  // query rows per tile

__attribute__((visibility("hidden"))) bool Bf16Tiles();  // linear_bf16.cc: tiles wanted here and granted by the OS

static bool TilesTake(int64_t G, int64_t D, int64_t BS, int64_t window) {
  return (D == 32 || D == 64) && G <= kQueryTile && BS % 16 == 0 && window == 0 && Bf16Tiles();
}

// linear_bf16.cc: this thread's tiles 0 .. count - 1 configured as rows[t] rows of 64 bytes
__attribute__((visibility("hidden"))) void ConfigureTileRows(const uint8_t* rows, int count);

// Eight tiles of 16 rows x 64 bytes, their roles by phase. Scores: 0, 1 the scores of a 32-key step's two 16-key
// chunks (16 query rows x 16 keys where the keys are laid out; else 0 alone, 16 keys x 16 query rows), 2, 3 the
// query rows' dims 0-31 and 32-63 (loaded once a unit), 4-7 the keys (each chunk's two 32-dim halves). Weighted
// values: 0-3 o (16 query rows x 16 dims each), 4 the weights of 32 keys (16 query rows x 32 keys), 6, 7 values
// (16 pairs of keys x 16 dims).
static void ConfigureAttentionTiles() {
  const uint8_t shape[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  ConfigureTileRows(shape, 8);
}

// o's tiles 0 .. DC - 1 += the weights' tile (4: 32 keys from `weights`, rows `stride` bytes apart) times the
// values' tiles (6, 7 in turn), one 16-dim chunk each.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void WeightedValues(const uint16_t* weights, int64_t stride,
                                                                              const uint16_t* values) {
  _tile_loadd(4, weights, stride);
  _tile_loadd(6, values, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, values + 512, 64);
  _tile_dpbf16ps(1, 4, 7);
  if (DC == 4) {
    _tile_loadd(6, values + 1024, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, values + 1536, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
}

// The values of keys l .. l + 31 as o's B tiles: per 16-dim chunk c, 16 pairs of keys x 16 dims x 2, at
// out + c * 512 (vpermt2w interleaves two keys' 16 values: word 2 i from the first, 2 i + 1 from the second);
// keys from `last` on give zeros.
template <int DC>
static inline void InterleaveValues(const uint16_t* V, int64_t kv_base, int64_t BS, const int64_t* table, int64_t l,
                                    int64_t last, uint16_t* out) {
  constexpr int64_t D = DC * 16;
  const __m512i interleave = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                               0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                               0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  for (int p = 0; p < 16; ++p) {
    const uint16_t* two[2];  // keys l + 2 p and l + 2 p + 1 (none past the last key: zeros)
    for (int e = 0; e < 2; ++e) {
      const int64_t key = l + 2 * p + e;
      two[e] = key < last ? V + (kv_base + table[key / BS] * BS + key % BS) * D : nullptr;
    }
    for (int c = 0; c < DC; ++c) {
      const __m512i a = two[0] ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(two[0] + 16 * c)))
                               : _mm512_setzero_si512();
      const __m512i b = two[1] ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(two[1] + 16 * c)))
                               : _mm512_setzero_si512();
      _mm512_store_si512(out + c * 512 + p * 32, _mm512_permutex2var_epi16(a, interleave, b));
    }
  }
}

// The keys l .. l + 15 (l a multiple of 16) as the scores' B tiles: per 32-dim chunk c, 16 pairs of dims x 16 keys
// x 2, at out + c * 512 (a 16 x 16 transpose of 32-bit pairs); keys from `last` on give zeros.
template <int DC>
static inline void TransposeKeys(const uint16_t* K, int64_t kv_base, int64_t BS, const int64_t* table, int64_t l,
                                 int64_t last, uint16_t* out) {
  constexpr int64_t D = DC * 16;
  if (l >= last) {
    std::memset(out, 0, D / 32 * 1024);
    return;
  }
  const uint16_t* keys = K + (kv_base + table[l / BS] * BS + l % BS) * D;  // 16 keys in one block (BS % 16 == 0)
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(D / 2));  // each key's first pair, in pairs
  const __mmask16 seen = Tail(last - l);
  for (int64_t c = 0; c < D / 32; ++c)
    for (int p = 0; p < 16; ++p)
      _mm512_store_si512(out + c * 512 + p * 32,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), seen, rows, keys + 32 * c + 2 * p, 4));
}

// A run's keys and values laid out once as its units' B tiles (TransposeKeys, InterleaveValues: the chunk from key
// l at kt + l D and vi + l D): a prompt's units otherwise turned the keys' scores into rows with a gather per query
// row and interleaved every value again, unit after unit.
struct RunLayout {
  const uint16_t* kt;
  const uint16_t* vi;
};

// The scores of two tiles of query rows (tiles 2, 3: the first's dims 0-31, 32-63; 4, 5: the second's) against keys
// laid out (RunLayout) 16 at a time (tiles 6, 7: their two 32-dim halves; 0, 1: the two tiles' scores), as rows of
// `score` (the second tile's from row 16), each key's chunk loaded once for both: the two tiles together load half
// the keys from L2 that they did one after the other. The same tile products as one tile's (AttendRowsTiles).
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void PairScores(uint16_t (*query_rows)[2 * 16][32],
                                                                          const uint16_t* kt, int64_t last,
                                                                          int64_t padded, float* score) {
  constexpr int64_t D = DC * 16;
  _tile_loadd(2, query_rows[0][0], 64);
  _tile_loadd(4, query_rows[0][16], 64);
  if (D == 64) {
    _tile_loadd(3, query_rows[1][0], 64);
    _tile_loadd(5, query_rows[1][16], 64);
  }
  for (int64_t l = 0; l < last; l += 16) {
    const uint16_t* keys = kt + l * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, keys, 64);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 4, 6);
    if (D == 64) {
      _tile_loadd(7, keys + 512, 64);
      _tile_dpbf16ps(0, 3, 7);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, score + l, padded * 4);
    _tile_stored(1, score + 16 * padded + l, padded * 4);
  }
}

// o [2][DC][16 rows x 16 dims] of two tiles of query rows: their weights (rows of `weight`, the second tile's from row
// 16; tiles 4, 5) times the values laid out (tiles 6, 7), two 16-dim chunks a pass over the keys (tiles 0, 1: the
// first tile's, 2, 3: the second's). Each o tile sums the same products in the same key order as one tile's
// (WeightedValues), so the same bits; each chunk of values is loaded once for both tiles.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void PairWeightedValues(const uint16_t* weight,
                                                                                  int64_t padded, const uint16_t* vi,
                                                                                  int64_t last, float (*o)[DC][256]) {
  constexpr int64_t D = DC * 16;
  for (int c = 0; c < DC; c += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t l = 0; l < last; l += 32) {
      const uint16_t* values = vi + l * D + c * 512;
      _tile_loadd(4, weight + l, padded * 2);
      _tile_loadd(5, weight + 16 * padded + l, padded * 2);
      _tile_loadd(6, values, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, values + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o[0][c], 64);
    _tile_stored(1, o[0][c + 1], 64);
    _tile_stored(2, o[1][c], 64);
    _tile_stored(3, o[1][c + 1], 64);
  }
}

// Rows b .. b + R - 1 (consecutive positions of one sequence, each seeing one key more) of KV head kvh: its G query
// heads each (Qr: their queries rounded to bfloat16, QueriesRounded; their outputs to O, or rounded to Or), position
// r's head g in tile r / P at row (r % P) G + g, P = per_tile positions a tile (16 / G at most); one tile, or two where
// the keys and values are laid out (PairScores, PairWeightedValues). D / 16 = DC o tiles. `run`: the keys and values
// already laid out (RunLayout), or nulls: laid out here as they are needed (scores: the keys straight from the cache as
// A tiles, the query rows' dims in pairs as B tiles, and a gather a query row turns them to rows). A row's bits are the
// same in either tile, alone or paired. Two tiles at a time: a 512-token SmolLM2 attention op (1 thread, one tile a
// task or two alternating call by call in one process) 0.89-0.94x the time, the rest of a pair's work (scores, softmax)
// as before.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static void AttendRowsTiles(
    const uint16_t* Qr, int64_t G, int64_t R, int64_t per_tile, const uint16_t* K, const uint16_t* V, int64_t kv_base,
    int64_t BS, const int64_t* table, int64_t L0, float* O, uint16_t* Or, int64_t row_stride, RunLayout run) {
  constexpr int64_t D = DC * 16;
  const int tiles = R > per_tile ? 2 : 1;
  const int64_t last = L0 + R - 1, padded = (last + 31) / 32 * 32;
  thread_local LineBuffer<float> scores;  // (on lines: the tiles store and load rows of 64 bytes)
  thread_local LineBuffer<uint16_t> weights;
  // rows of a tile past its query rows (query rows, weights) are left as they are: a tile row's results are its
  // own, and those rows' are never read
  float* const score = scores.Get(tiles * kQueryTile * padded);  // (thread_local: looked up once, not at every use)
  uint16_t* const weight = weights.Get(tiles * kQueryTile * padded);
  int64_t rows_of[2] = {std::min(R, per_tile) * G, (R - std::min(R, per_tile)) * G};  // query rows in each tile
  const auto source = [&](int t, int64_t i) {  // tile t's row i: its query's (and output's) place in Q (O)
    return (t * per_tile + i / G) * row_stride + (i % G) * D;
  };
  // the query rows rounded to bfloat16 as AttendHeadsBf16's q: as A tiles ([D / 32][tile rows][32 dims]) where
  // the keys are laid out, else as B tiles ([D / 32][16 pairs of dims][16 query rows][2])
  alignas(64) uint16_t queries[D / 32][16][kQueryTile][2];
  alignas(64) uint16_t query_rows[D / 32][2 * kQueryTile][32] = {};
  for (int t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < rows_of[t]; ++i) {
      const uint16_t* q = Qr + source(t, i);
      for (int64_t c = 0; c < D / 32; ++c) {
        _mm512_store_si512(query_rows[c][t * kQueryTile + i], _mm512_loadu_si512(q + 32 * c));
      }
    }
  if (!run.kt)
    for (int64_t c = 0; c < D / 32; ++c)
      for (int p = 0; p < 16; ++p)
        for (int64_t n = 0; n < rows_of[0]; ++n) {
          queries[c][p][n][0] = query_rows[c][n][2 * p];
          queries[c][p][n][1] = query_rows[c][n][2 * p + 1];
        }
  if (tiles == 2) {
    PairScores<DC>(query_rows, run.kt, last, padded, score);
  } else if (run.kt) {
    _tile_loadd(2, query_rows[0], 64);
    if (D == 64) _tile_loadd(3, query_rows[1], 64);
    for (int64_t l = 0; l < last; l += 32) {  // scores of 16 query rows x 16 keys, twice, stored as rows
      const uint16_t* keys = run.kt + l * D;  // (laid out up to `padded`: zeros past the run's last key)
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, keys, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(6, keys + 16 * D, 64);
      _tile_dpbf16ps(1, 2, 6);
      if (D == 64) {
        _tile_loadd(5, keys + 512, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_loadd(7, keys + 16 * D + 512, 64);
        _tile_dpbf16ps(1, 3, 7);
      }
      _tile_stored(0, score + l, padded * 4);
      _tile_stored(1, score + l + 16, padded * 4);
    }
  } else {
    alignas(64) float block[16 * kQueryTile];
    const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kQueryTile));
    _tile_loadd(2, queries[0], 64);
    if (D == 64) _tile_loadd(3, queries[1], 64);
    for (int64_t l = 0; l < last; l += 16) {  // 16 keys x 16 query rows, then a column per query row
      const uint16_t* keys = K + (kv_base + table[l / BS] * BS + l % BS) * D;
      _tile_zero(0);
      _tile_loadd(4, keys, D * 2);
      _tile_dpbf16ps(0, 4, 2);
      if (D == 64) {
        _tile_loadd(5, keys + 32, D * 2);
        _tile_dpbf16ps(0, 5, 3);
      }
      _tile_stored(0, block, 64);
      for (int64_t n = 0; n < rows_of[0]; ++n)
        _mm512_storeu_ps(score + n * padded + l, _mm512_i32gather_ps(across, block + n, 4));
    }
  }
  __m512 inverse[2][kQueryTile];
  for (int t = 0; t < tiles; ++t) {
    int64_t lengths[kQueryTile];
    for (int64_t i = 0; i < rows_of[t]; ++i) lengths[i] = L0 + t * per_tile + i / G;
    float* const tile_score = score + t * kQueryTile * padded;
    uint16_t* const tile_weight = weight + t * kQueryTile * padded;
    Bf16Weights(static_cast<int>(rows_of[t]), tile_score, padded, lengths, padded, tile_weight, padded, inverse[t]);
    for (int64_t i = 0; i < rows_of[t]; ++i)  // weights of exactly 0 for the keys it does not see
      std::fill(tile_weight + i * padded + (lengths[i] + 15) / 16 * 16, tile_weight + (i + 1) * padded, uint16_t{0});
  }
  alignas(64) float o[2][DC][kQueryTile * 16];
  if (tiles == 2) {
    PairWeightedValues<DC>(weight, padded, run.vi, last, o);
  } else {
    _tile_zero(0);  // (tile numbers are immediates: no loop)
    _tile_zero(1);
    if (DC == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
    alignas(64) uint16_t values[DC * 512];
    for (int64_t l = 0; l < last; l += 32) {
      const uint16_t* chunk = run.vi ? run.vi + l * D : values;
      if (!run.vi) InterleaveValues<DC>(V, kv_base, BS, table, l, last, values);
      WeightedValues<DC>(weight + l, padded * 2, chunk);
    }
    _tile_stored(0, o[0][0], 64);
    _tile_stored(1, o[0][1], 64);
    if (DC == 4) {
      _tile_stored(2, o[0][2], 64);
      _tile_stored(3, o[0][3], 64);
    }
  }
  for (int t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < rows_of[t]; ++i) {
      const int64_t at = source(t, i);
      for (int c = 0; c < DC; ++c) {
        const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(o[t][c] + i * 16), inverse[t][i]);
        if (Or) {
          _mm512_mask_cvtepi32_storeu_epi16(Or + at + 16 * c, 0xffff, Bf16Bits(value));
        } else {
          _mm512_storeu_ps(O + at + 16 * c, value);
        }
      }
    }
}
#endif
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// Exp16 for 8 floats: the same reduction and polynomial, 2^n put in the exponent bits (AVX2 has no
// vscalefps), 0 below -87.
static inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.f));
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
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 scaled = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_and_ps(scaled, _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ));
}

static inline float Max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float Add8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// The sums of 8 vectors as one vector (lane i: the sum of v[i]), by horizontal adds.
static inline __m256 Sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The first `left` (< 8) lanes set: AVX2's masked loads and stores take a vector of lanes.
static inline __m256i Lanes(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

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

// One (row, KV head)'s attention, one value at a time: for head sizes the vector paths do not take.
static void AttendScalar(const float* qg, int64_t G, int64_t D, const float* K, const float* V, int64_t kv_base,
                         int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
  ForEachKeyRun(K, kv_base, BS, D, table, first, L, BS, [&](int64_t l, const float* kt, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;  // ScoreRuns' chain
        for (int64_t d = 0; d < D; ++d) s = std::fma(qg[g * D + d], kt[d * BS + i], s);
        scores[g * L + l + i] = s;
      }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    float top = row[0];
    for (int64_t l = 1; l < L; ++l) top = row[l] > top ? row[l] : top;
    float total = 0.f;
    for (int64_t l = 0; l < L; ++l) {
      row[l] = expf(row[l] - top);
      total += row[l];
    }
    const float inv = 1.f / total;
    for (int64_t l = 0; l < L; ++l) row[l] *= inv;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = 0.f;
  }
  for (int64_t l = 0; l < L; ++l) {
    const int64_t key = first + l;
    const float* __restrict__ vr = V + (kv_base + table[key / BS] * BS + key % BS) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + l];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p * vr[d];
    }
  }
}

// One row's attention for the G query heads sharing one KV head (kv_base: its first cache row), on the
// widest path this build has; in passes of up to kMostHeads heads (the same passes for every row of a
// model, so a row's bits do not depend on its batch).
static void AttendTask(const float* qg, int64_t G, int64_t D, const float* K, const float* V, int64_t kv_base,
                       int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
#if defined(__AVX512F__)
  AttendOne(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t g = 0; g < G;) {
      const int heads = static_cast<int>(std::min<int64_t>(kMostHeads, G - g));
      Attend8For(D, heads)(qg + g * D, D, K, V, kv_base, BS, table, first, L, scores, out + g * D);
      g += heads;
    }
    return;
  }
  AttendScalar(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#else
  AttendScalar(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#endif
}

#if defined(FDCORE_ATTENTION_TILES)
// AttendRows where the tiles take it (TilesTake). A unit: up to 16 / G consecutive rows of one sequence (Pairable,
// chained), its tiles' query rows their heads; a run: a sequence's consecutive rows (a prompt's), whose keys and
// values are laid out once for all its units where it has more than one (RunLayout). The same bits either way.
static void AttendRowsInTiles(const uint16_t* Qr, int64_t B, int64_t H, int64_t D, const uint16_t* K, const uint16_t* V,
                              int64_t KVH, int64_t NB, int64_t BS, const int64_t* T, int64_t W, const int64_t* LEN,
                              int64_t window, bool parallel, float* O, uint16_t* Or) {
  const int64_t G = H / KVH;
  std::vector<int64_t> units, unit_run;  // each unit's first row (then B), and its run's place in laid_out (or -1)
  struct Run {
    // offset: of its layouts in `layout` (a KV head's: keys, then values, padded_keys(keys) D words each)
    int64_t last_row, keys, offset;
  };
  std::vector<Run> laid_out;
  const auto padded_keys = [](int64_t keys) { return (keys + 31) / 32 * 32; };  // whole 32-key chunks
  int64_t words = 0;
  for (int64_t b = 0; b < B;) {
    int64_t end = b + 1;
    while (end < B && Pairable(end - 1, BS, T, W, LEN, window)) ++end;
    const int64_t per_unit = kQueryTile / G, run_units = (end - b + per_unit - 1) / per_unit;
    // a laid-out run's units go two tiles at a time (AttendRowsTiles: the keys and values loaded once for both)
    const int64_t step = run_units > 1 ? 2 * per_unit : per_unit;
    for (int64_t first = b; first < end; first += step) {
      units.push_back(first);
      unit_run.push_back(run_units > 1 ? static_cast<int64_t>(laid_out.size()) : -1);
    }
    if (run_units > 1) {
      laid_out.push_back({end - 1, LEN[end - 1], words});
      words += KVH * 2 * padded_keys(LEN[end - 1]) * D;  // (the run's last row sees the most keys)
    }
    b = end;
  }
  units.push_back(B);
  // (the calling thread's, across layers; on lines, as the laying out stores)
  thread_local LineBuffer<uint16_t> memory;
  uint16_t* const layout = memory.Get(words);
  const auto keys_laid_out = [&](const Run& r, int64_t kvh) {  // (its values follow, padded_keys(r.keys) D words on)
    return layout + r.offset + kvh * 2 * padded_keys(r.keys) * D;
  };
  std::vector<int64_t> chunks{0};  // laying out: 32-key chunks of each run's KV heads, prefix sums
  for (const Run& r : laid_out) chunks.push_back(chunks.back() + KVH * padded_keys(r.keys) / 32);
  const int64_t unit_tasks = static_cast<int64_t>(units.size() - 1) * KVH;
  const auto attend = D == 64 ? AttendRowsTiles<4> : AttendRowsTiles<2>;
  const auto keys_of = D == 64 ? TransposeKeys<4> : TransposeKeys<2>;
  const auto values_of = D == 64 ? InterleaveValues<4> : InterleaveValues<2>;
#pragma omp parallel if (parallel)
  {
    ConfigureAttentionTiles();  // each thread's own
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < chunks.back(); ++chunk) {
      const int64_t r = std::upper_bound(chunks.begin(), chunks.end(), chunk) - chunks.begin() - 1;
      const Run& run = laid_out[r];
      const int64_t padded = padded_keys(run.keys), kvh = (chunk - chunks[r]) / (padded / 32);
      const int64_t l = (chunk - chunks[r]) % (padded / 32) * 32;
      uint16_t* kt = keys_laid_out(run, kvh);
      const int64_t* table = T + run.last_row * W;
      keys_of(K, kvh * NB * BS, BS, table, l, run.keys, kt + l * D);
      keys_of(K, kvh * NB * BS, BS, table, l + 16, run.keys, kt + (l + 16) * D);
      values_of(V, kvh * NB * BS, BS, table, l, run.keys, kt + padded * D + l * D);
    }
    // Taken as the threads come free, the last rows' (the costliest: they see the most keys) first: interleaved
    // static shares left one of 2 threads 20 % more tile cycles than the other at times, by turns (a shared host's
    // cores do not run at one speed), and it waited out the difference. In one process, the two schedules
    // alternating call by call (2 threads, the 512-token SmolLM2 attention op): 0.98-1.00x the time on a quiet host,
    // 0.90x on a busy one. A task is computed whole by one thread: the same bits.
#pragma omp for schedule(dynamic, 1)
    for (int64_t from_last = 0; from_last < unit_tasks; ++from_last) {
      const int64_t task = unit_tasks - 1 - from_last;
      const int64_t u = task / KVH, kvh = task % KVH, head = kvh * G, b = units[u], R = units[u + 1] - b;
      RunLayout run{nullptr, nullptr};
      if (unit_run[u] >= 0) {
        const Run& r = laid_out[unit_run[u]];
        run.kt = keys_laid_out(r, kvh);
        run.vi = run.kt + padded_keys(r.keys) * D;
      }
      // the last row's table: every row's blocks are its (Pairable)
      attend(Qr + (b * H + head) * D, G, R, kQueryTile / G, K, V, head / G * NB * BS, BS, T + (b + R - 1) * W, LEN[b],
             O + (b * H + head) * D, Or ? Or + (b * H + head) * D : nullptr, H * D, run);
    }
    _tile_release();
  }
}
#endif

// Whether the rows of an attention call go through the tiles (AttendRowsInTiles): a bfloat16 cache where TilesTake.
static bool AttentionTiles(bool bf16, int64_t G, int64_t D, int64_t BS, int64_t window) {
#if defined(FDCORE_ATTENTION_TILES)
  return bf16 && TilesTake(G, D, BS, window);
#else
  return false;
#endif
}

// A head's D (a multiple of 32) rotated queries q rounded to bfloat16 as the tiles take them (vcvtne2ps2bf16, 32 at a
// time), once a row where every (row, KV head) task rounded its rows' (and read twice the bytes).
static void QueriesRounded(const float* q, int64_t D, uint16_t* r) {
#if defined(FDCORE_ATTENTION_TILES)
  for (int64_t c = 0; c < D; c += 32)
    _mm512_storeu_si512(r + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(q + c)));
#else
  PD_CHECK(false, "attention: queries rounded for tiles in a build without them");
#endif
}

// Whether rows of G query heads a KV head, head_dim D, over a bfloat16 cache of BS-token blocks (window: sliding, 0
// none) go through the tiles in this process, which can hand the o product its rows rounded (AttendRows' Or): for
// what measures the step's products alone (benchmarks/bench_model.py's floor takes o's input as the step does).
extern "C" int fdcore_attention_rounds_rows(int64_t G, int64_t D, int64_t BS, int64_t window) {
  return AttentionTiles(true, G, D, BS, window) ? 1 : 0;
}

// The attention of B rows over their own prefixes in the paged cache (the shared core of the ops).
// window > 0: a row at position p sees only keys p - window + 1 .. p (sliding-window attention).
// Rows and KV heads are shared out over OpenMP's threads; each (row, KV head) is computed whole by
// one thread, so the result does not depend on the thread count.
// K and V: float32, or bfloat16 bits where `bf16` (AttendHeadsBf16).
// Where the tiles take the rows (AttentionTiles), their queries are Qr's, rounded to bfloat16 (QueriesRounded), and
// where Or is not null O's rows are written there instead, rounded to bfloat16 (Bf16Bits: the bits a bfloat16
// product's RoundRows would give them); returns whether they were.
static bool AttendRows(const float* Q, const uint16_t* Qr, int64_t B, int64_t H, int64_t D, const void* K,
                       const void* V, bool bf16, int64_t KVH, int64_t NB, int64_t BS, const int64_t* T, int64_t W,
                       const int64_t* LEN, int64_t window, float* O, uint16_t* Or) {
  const int64_t G = H / KVH;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = LEN[b];
    PD_CHECK(end >= 1 && end <= W * BS, "attention: length out of range of the block table");
    const int64_t first = FirstKey(end, window);
    for (int64_t i = first / BS; i < (end + BS - 1) / BS; ++i) {
      PD_CHECK(T[b * W + i] >= 0 && T[b * W + i] < NB, "attention: block id out of range");
    }
    work += end - first;
  }
  PD_CHECK(D <= 256, "attention: head_dim above 256");
  // A task is a row's heads of one KV head (their keys loaded once for all), or, when there are too few
  // of those to keep the threads busy (a decode step of one sequence: SmolLM2's 3 KV heads on 2 threads
  // left one idle a third of the time), a row's single query head. A head's arithmetic is the same
  // either way (AttendHeads), so the split changes no bits.
  const int64_t heads = B * KVH >= kFewestTasks ? G : 1, tasks = B * H / heads;
  const bool parallel = work * H * D >= (1 << 16);
#if defined(FDCORE_ATTENTION_PAIRS)
  // A prompt's consecutive rows go in pairs where they can (Pairable; the float32 cache, a task of a KV head's
  // heads): a unit is a row or a pair, a task a unit's heads of one KV head. The same bits either way.
  if (!bf16 && heads == G && D <= 64) {
    std::vector<int64_t> units;  // each unit's first row, then B: unit u is rows units[u] .. units[u + 1] - 1
    for (int64_t b = 0; b < B; b += 1 + (b + 1 < B && Pairable(b, BS, T, W, LEN, window))) units.push_back(b);
    units.push_back(B);
    if (units.size() <= static_cast<size_t>(B)) {  // (a pair among them)
      const int64_t unit_tasks = static_cast<int64_t>(units.size() - 1) * KVH;
#pragma omp parallel for schedule(static, 1) if (parallel)  // interleaved, as below
      for (int64_t task = 0; task < unit_tasks; ++task) {
        const int64_t u = task / KVH, head = task % KVH * G, b = units[u], L = LEN[b] - FirstKey(LEN[b], window);
        const float* K0 = static_cast<const float*>(K);
        const float* V0 = static_cast<const float*>(V);
        thread_local LineBuffer<float> scores;
        float* const score = scores.Get(2 * kMostHeads * (L + 1));
        if (units[u + 1] - b == 1) {
          AttendTask(Q + (b * H + head) * D, G, D, K0, V0, head / G * NB * BS, BS, T + b * W, LEN[b] - L, L,
                     score, O + (b * H + head) * D);
          continue;
        }
        AttendPair(Q + (b * H + head) * D, Q + ((b + 1) * H + head) * D, G, D, K0, V0, head / G * NB * BS, BS, T + b * W,
                   L, score, score + kMostHeads * L, O + (b * H + head) * D, O + ((b + 1) * H + head) * D);
      }
      return false;
    }
  }
#endif
#if defined(FDCORE_ATTENTION_TILES)
  if (AttentionTiles(bf16, G, D, BS, window)) {
    PD_CHECK(Qr, "attention: the tiles take the queries rounded");
    AttendRowsInTiles(Qr, B, H, D, static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V), KVH, NB, BS, T, W,
                      LEN, window, parallel, O, Or);
    return Or != nullptr;
  }
#endif
#pragma omp parallel for schedule(static, 1) if (parallel)  // interleaved: a prompt's later rows see more keys (contiguous shares gave one thread 3/4 of the work)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task * heads / H, head = task * heads % H, end = LEN[b];
    const int64_t first = FirstKey(end, window);
    thread_local LineBuffer<float> scores;
    float* const score = scores.Get(std::max<int64_t>(heads, kMostHeads) * (end - first));
#if defined(FDCORE_ATTENTION_BF16)
    if (bf16) {
      thread_local LineBuffer<uint16_t> weights;
      AttendOneBf16(Q + (b * H + head) * D, heads, D, static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V),
                    head / G * NB * BS, BS, T + b * W, first, end - first, score,
                    weights.Get(std::max<int64_t>(heads, kMostHeads) * (end - first + 1)), O + (b * H + head) * D);
      continue;
    }
#endif
    AttendTask(Q + (b * H + head) * D, heads, D, static_cast<const float*>(K), static_cast<const float*>(V),
               head / G * NB * BS, BS, T + b * W, first, end - first, score, O + (b * H + head) * D);
  }
  return false;
}

// Everything between the QKV projection and the output projection, for every row at once:
// Qwen3's per-head RMSNorm of q and k (q_norm / k_norm [D], or empty tensors: none), rotary
// embedding (HF's rotate-half, with cos / sin [T, D/2] computed by the caller, any scaling folded
// in), q scaled, k and v written into the paged cache at each row's slot, then attention over each
// row's prefix (its last `window` keys when window > 0).
// qkv [T, (H + 2 KVH) D]; slots [T] int64 (block * BS + offset); out [T, H D]. Into the caller's memory
// (decoder_layers' workspace, or the op's outputs): Qo [T, H D] (the rotated, scaled queries; where the tiles take the
// rows, rounded to bfloat16 in its memory: QueriesRounded) and O, or, where Or is
// not null and the rows go through the tiles (AttendRows), O's rows rounded to bfloat16 in Or [T, H D] (a bfloat16 o
// product's rounded X: its float32 rows never go to memory); returns whether they did.
bool AttentionBlockInto(const float* X, int64_t Tn, int64_t width, const paddle::Tensor& cos, const paddle::Tensor& sin,
                        const paddle::Tensor& slots, const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                        const paddle::Tensor& tables, const paddle::Tensor& lengths, const paddle::Tensor& q_norm,
                        const paddle::Tensor& k_norm, int64_t num_heads, float scale, int64_t window, float norm_eps,
                        float* Qo, float* O, uint16_t* Or) {
  const auto vs = v_cache.shape();
  const int64_t KVH = vs[0], NB = vs[1], BS = vs[2], D = vs[3], H = num_heads, half = D / 2;
  PD_CHECK(width == (H + 2 * KVH) * D, "attention_block: qkv width does not match the heads");
  const float* C = cos.data<float>();
  const float* S = sin.data<float>();
  const int64_t* SLOT = slots.data<int64_t>();
  const bool bf16 = k_cache.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(v_cache.dtype() == k_cache.dtype() && (bf16 || k_cache.dtype() == paddle::DataType::FLOAT32),
           "attention_block: the caches must be both float32 or both bfloat16");
  const std::vector<int64_t> k_shape = bf16 ? vs : std::vector<int64_t>{KVH, NB, D, BS};  // float32: transposed blocks
  PD_CHECK(H % KVH == 0 && k_cache.shape() == k_shape, "attention_block: cache shapes do not match");
  PD_CHECK(D <= 256, "attention: head_dim above 256");
#if defined(FDCORE_ATTENTION_BF16)
  PD_CHECK(!bf16 || D % 32 == 0, "attention_block: a bfloat16 cache needs head_dim a multiple of 32");
#else
  PD_CHECK(!bf16, "attention_block: a bfloat16 cache needs a build for AVX512-BF16");
#endif
  // the cache is written in place: a row of D values at `slot` of KV head j (rounded to bfloat16 where it is), or
  // for a float32 cache's keys a column of their block (values BS apart: ForEachKeyRun's layout)
  void* Kc = const_cast<void*>(k_cache.data());
  void* Vc = const_cast<void*>(v_cache.data());
  auto store = [&](void* cache, int64_t j, int64_t slot, const float* values, bool transposed) {
    const int64_t at = (j * NB * BS + slot) * D;
    if (bf16) {
      RoundToBf16(values, D, static_cast<uint16_t*>(cache) + at);
    } else if (transposed) {
      float* column = static_cast<float*>(cache) + (j * NB * BS + slot - slot % BS) * D + slot % BS;
      for (int64_t d = 0; d < D; ++d) column[d * BS] = values[d];
    } else {
      std::memcpy(static_cast<float*>(cache) + at, values, D * sizeof(float));
    }
  };
  const bool normed = q_norm.numel() > 0;
  PD_CHECK(!normed || (q_norm.numel() == D && k_norm.numel() == D), "attention_block: q/k norm width != D");
  const float* QN = normed ? q_norm.data<float>() : nullptr;
  const float* KN = normed ? k_norm.data<float>() : nullptr;
  for (int64_t t = 0; t < Tn; ++t) PD_CHECK(SLOT[t] >= 0 && SLOT[t] < NB * BS, "attention_block: slot out of range");
  // Rows alone (each its own slots of the cache): shared out, the same bits. A 512-token SmolLM2 prefill spent
  // ~1 % of its time here on one thread while the others waited.
  // where the tiles take the rows, the queries go to them rounded (QueriesRounded), in Qo's memory
  uint16_t* const Qr = AttentionTiles(bf16, H / KVH, D, BS, window) ? reinterpret_cast<uint16_t*>(Qo) : nullptr;
#pragma omp parallel for schedule(static) if (RowsWorthSharing(Tn, width))
  for (int64_t t = 0; t < Tn; ++t) {
    float head[256], key[256], query[256];
    const float* row = X + t * (H + 2 * KVH) * D;
    const float* c = C + t * half;
    const float* s = S + t * half;
    for (int64_t h = 0; h < H + KVH; ++h) {  // query heads, then key heads, rotated
      const float* x = row + h * D;
      if (normed) {  // HF's RMSNorm over the head: x * rsqrt(mean(x^2) + eps) * weight
        float squares = 0.f;
        for (int64_t i = 0; i < D; ++i) squares += x[i] * x[i];
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + norm_eps);
        const float* w = h < H ? QN : KN;
        for (int64_t i = 0; i < D; ++i) head[i] = x[i] * inv * w[i];
        x = head;
      }
      float* dst = h >= H ? key : Qr ? query : Qo + (t * H + h) * D;
      const float mul = h < H ? scale : 1.f;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i] * c[i] - x[i + half] * s[i];
        const float b = x[i + half] * c[i] + x[i] * s[i];
        dst[i] = h < H ? a * mul : a;
        dst[i + half] = h < H ? b * mul : b;
      }
      if (h >= H) store(Kc, h - H, SLOT[t], key, true);
      if (h < H && Qr) QueriesRounded(query, D, Qr + (t * H + h) * D);
    }
    for (int64_t j = 0; j < KVH; ++j) store(Vc, j, SLOT[t], row + (H + KVH + j) * D, false);  // values, as they are
  }
  return AttendRows(Qo, Qr, Tn, H, D, Kc, Vc, bf16, KVH, NB, BS, tables.data<int64_t>(), tables.shape()[1],
             lengths.data<int64_t>(), window, O, Or);
}

std::vector<paddle::Tensor> AttentionBlock(const paddle::Tensor& qkv, const paddle::Tensor& cos,
                                           const paddle::Tensor& sin, const paddle::Tensor& slots,
                                           const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                                           const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                           const paddle::Tensor& q_norm, const paddle::Tensor& k_norm,
                                           int64_t num_heads, float scale, int64_t window, float norm_eps) {
  const int64_t Tn = qkv.shape()[0], D = v_cache.shape()[3];
  auto q = paddle::empty({Tn, num_heads, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto out = paddle::empty({Tn, num_heads * D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  AttentionBlockInto(qkv.data<float>(), Tn, qkv.shape()[1], cos, sin, slots, k_cache, v_cache, tables, lengths, q_norm,
                     k_norm, num_heads, scale, window, norm_eps, q.data<float>(), out.data<float>(), nullptr);
  return {out};
}

PD_BUILD_OP(fdcore_attention_block)
    .Inputs({"QKV", "Cos", "Sin", "Slots", "KCache", "VCache", "Tables", "Lengths", "QNorm", "KNorm"})
    .Outputs({"Out"})
    .Attrs({"num_heads: int64_t", "scale: float", "window: int64_t", "norm_eps: float"})
    .SetKernelFn(PD_KERNEL(AttentionBlock));

// ---------------------------------------------------------------------------------------------
// Gumbel-max sampling: token = argmax_i(logits[r, i] / T_r + G(key_r, i)), where G is Gumbel noise
// from a counter-based hash of the row's key (a function of its seed and position) and the token
// id. The same distribution as drawing from softmax(logits / T), and robust: a different draw needs
// two perturbed scores within the logits' numerical noise of each other, so recomputing a request
// (different batch, different kernels, a few ulps apart) draws the same tokens.
//
// logits [R, V] float32; keys [R] int64 (64 random bits per draw); inv_temperature [R] float32
// out [R] int64
static inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352dU;
  h ^= h >> 15;
  h *= 0x846ca68bU;
  h ^= h >> 16;
  return h;
}

#if defined(__AVX512F__)
static inline __m512i Mix16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(0x7feb352d));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// ln x for 16 positive normal floats (Cephes' logf: x = m 2^e, m in [sqrt(1/2), sqrt(2)), a degree-9
// polynomial in m - 1; within 2 ulp of libm's). Per lane, as Exp16.
static inline __m512 Log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  __m512 e = _mm512_getexp_ps(x);
  const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GE_OQ);
  m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.f)), z = _mm512_mul_ps(f, f);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(3.3333331174e-1f));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fmadd_ps(z, _mm512_set1_ps(-0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

// One row's draw, 16 tokens at a time: the hash, u, the Gumbel score and a running argmax per lane
// (the first index of the row's maximum, as a scalar scan finds it).
static int64_t GumbelRow(const float* row, int64_t V, uint32_t k1, uint32_t k2, float inv_t,
                         const uint32_t* allowed) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_at = _mm512_setzero_si512();
  for (int64_t i = 0; i < V; i += 16) {
    __mmask16 m = Tail(V - i);
    if (allowed) m &= static_cast<__mmask16>(allowed[i >> 5] >> (i & 31));  // this half-word's 16 bits
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(i)), lane);
    const __m512i h = Mix16(_mm512_add_epi32(
        Mix16(_mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(k1)),
                               _mm512_mullo_epi32(index, _mm512_set1_epi32(static_cast<int>(0x9E3779B9U))))),
        _mm512_set1_epi32(static_cast<int>(k2))));
    const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 9)), _mm512_set1_ps(0.5f)),
                                   _mm512_set1_ps(1.0f / 8388608.0f));
    const __m512 noise = Log16(_mm512_sub_ps(_mm512_setzero_ps(), Log16(u)));
    const __m512 score = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, row + i), _mm512_set1_ps(inv_t), noise);
    const __mmask16 better = _mm512_mask_cmp_ps_mask(m, score, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, better, score);
    best_at = _mm512_mask_mov_epi32(best_at, better, index);
  }
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_at);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256i Mix8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(0x7feb352d));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// Log16 for 8 positive normal floats: the mantissa and exponent taken from the bits (AVX2 has no
// vgetmantps / vgetexpps; for normal numbers they are the same values), then the same polynomial.
static inline __m256 Log8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356237f), _CMP_GE_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), high);
  e = _mm256_blendv_ps(e, _mm256_add_ps(e, _mm256_set1_ps(1.f)), high);
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.f)), z = _mm256_mul_ps(f, f);
  __m256 p = _mm256_set1_ps(7.0376836292e-2f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.1514610310e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.1676998740e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.2420140846e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.4249322787e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-1.6668057665e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.0000714765e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(-2.4999993993e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(3.3333331174e-1f));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fmadd_ps(z, _mm256_set1_ps(-0.5f), y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}

// GumbelRow 8 tokens at a time: the same hash, u, score and first index of the maximum.
static int64_t GumbelRow(const float* row, int64_t V, uint32_t k1, uint32_t k2, float inv_t,
                         const uint32_t* allowed) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_at = _mm256_setzero_si256();
  for (int64_t i = 0; i < V; i += 8) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(i)), lane);
    const __m256i h = Mix8(_mm256_add_epi32(
        Mix8(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(k1)),
                              _mm256_mullo_epi32(index, _mm256_set1_epi32(static_cast<int>(0x9E3779B9U))))),
        _mm256_set1_epi32(static_cast<int>(k2))));
    const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 9)), _mm256_set1_ps(0.5f)),
                                   _mm256_set1_ps(1.0f / 8388608.0f));
    const __m256 noise = Log8(_mm256_sub_ps(_mm256_setzero_ps(), Log8(u)));
    __m256i real = Lanes(V - i >= 8 ? 8 : V - i);
    if (allowed) {  // this byte's 8 bits, one per lane
      const __m256i byte = _mm256_set1_epi32(static_cast<int>((allowed[i >> 5] >> (i & 31)) & 0xFFU));
      real = _mm256_and_si256(real, _mm256_cmpeq_epi32(_mm256_and_si256(byte, bit), bit));
    }
    const __m256 logits = _mm256_maskload_ps(row + i, real);
    const __m256 score = _mm256_fmsub_ps(logits, _mm256_set1_ps(inv_t), noise);
    const __m256 better = _mm256_and_ps(_mm256_cmp_ps(score, best, _CMP_GT_OQ), _mm256_castsi256_ps(real));
    best = _mm256_blendv_ps(best, score, better);
    best_at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_at), _mm256_castsi256_ps(index), better));
  }
  alignas(32) float tops[8];
  alignas(32) int32_t at[8];
  _mm256_store_ps(tops, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(at), best_at);
  int64_t chosen = -1;
  float top = -INFINITY;
  for (int i = 0; i < 8; ++i)  // the maximum's first index (an earlier lane may hold a later index)
    if (tops[i] > top || (tops[i] == top && chosen >= 0 && at[i] < chosen)) top = tops[i], chosen = at[i];
  return chosen < 0 ? 0 : chosen;
}
#endif

std::vector<paddle::Tensor> GumbelSample(const paddle::Tensor& logits, const paddle::Tensor& keys,
                                         const paddle::Tensor& inv_temperature, const paddle::Tensor& allowed) {
  const int64_t R = logits.shape()[0], V = logits.shape()[1], W = (V + 31) / 32;
  // allowed: [R, W] int32, bit t % 32 of word t / 32 set when token t may be drawn (a structured
  // output's grammar); empty: every token may
  PD_CHECK(allowed.numel() == 0 || allowed.numel() == R * W, "gumbel_sample: allowed is not [rows, (vocab + 31) / 32]");
  const uint32_t* A = allowed.numel() ? reinterpret_cast<const uint32_t*>(allowed.data<int32_t>()) : nullptr;
  auto out = paddle::empty({R}, paddle::DataType::INT64, paddle::CPUPlace());
  const float* X = logits.data<float>();
  const int64_t* KEY = keys.data<int64_t>();
  const float* INV_T = inv_temperature.data<float>();
  int64_t* O = out.data<int64_t>();
  // rows over threads: each row's draw is its own (AVX-512: ~35 us a 49,152-token row, where libm's two
  // scalar logf per token took ~0.7 ms; a batch of 32 spent a third of its step here)
#pragma omp parallel for schedule(static) if (R > 1 && R * V >= (1 << 16))
  for (int64_t r = 0; r < R; ++r) {
    const uint64_t key = static_cast<uint64_t>(KEY[r]);
    const uint32_t k1 = static_cast<uint32_t>(key), k2 = static_cast<uint32_t>(key >> 32);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    O[r] = GumbelRow(X + r * V, V, k1, k2, INV_T[r], A ? A + r * W : nullptr);
#else
    const float* row = X + r * V;
    const uint32_t* ok = A ? A + r * W : nullptr;
    const float inv_t = INV_T[r];
    int64_t best = 0;
    float top = -INFINITY;
    for (int64_t i = 0; i < V; ++i) {
      if (ok && !((ok[i >> 5] >> (i & 31)) & 1U)) continue;
      const uint32_t h = mix32(mix32(k1 ^ (static_cast<uint32_t>(i) * 0x9E3779B9U)) + k2);
      const float u = (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);  // (0, 1): see gumbel_noise
      const float score = row[i] * inv_t - logf(-logf(u));
      if (score > top) top = score, best = i;
    }
    O[r] = best;
#endif
  }
  return {out};
}

PD_BUILD_OP(fdcore_gumbel_sample)
    .Inputs({"Logits", "Keys", "InvTemperature", "Allowed"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GumbelSample));

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm in one pass (no hand-over to numpy and back between Paddle ops):
//   hidden_out = hidden + delta          (delta may be empty: then hidden_out = hidden)
//   normed     = hidden_out * rsqrt(mean(hidden_out^2) + eps) * weight
// hidden, delta [T, E] float32; weight [E] float32.
// One row's sum: h + d into s where there is a delta d, h copied into s where there is none but an s, else h itself
// (the residual stream where a product's epilogue adds to it: kernels/decoder.cc); returns the sum's row.
static inline const float* RowSum(const float* __restrict__ h, const float* __restrict__ d, float* __restrict__ s,
                                  int64_t E) {
  if (d) {
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) s[e] = h[e] + d[e];
    return s;
  }
  if (!s) return h;
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) s[e] = h[e];
  return s;
}

// 1 / sqrt(mean(x^2) + eps) of N rows of E values (x[r]; into scale[r]), each row's squares summed in one order on
// every path: 16 lanes, lane i the FMA chain of elements i, 16 + i, ... over the whole 16-value chunks, the last E % 16
// elements added to lane 0 in turn, then lanes 0 .. 15 added in turn (the order GCC's `omp simd` reduction of one
// row made on AVX-512, written out: the bits are those of before). A row is ~240 cycles of latency (36 FMAs, then 16
// adds, on SmolLM2's 576) and little else, so four rows' chains run side by side: one row at a time, the norms were
// ~2.5 % of a 512-token SmolLM2 bf16 prefill's samples (1 thread), nearly all of it waiting on that chain.
template <int N>
static void RmsScales(const float* const* x, int64_t E, float eps, float* scale) {
#if defined(__AVX512F__)
  __m512 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t whole = E / 16 * 16;
  for (int64_t e = 0; e < whole; e += 16)
    for (int r = 0; r < N; ++r) {
      const __m512 v = _mm512_loadu_ps(x[r] + e);
      acc[r] = _mm512_fmadd_ps(v, v, acc[r]);
    }
  alignas(64) float lanes[N][16];
  for (int r = 0; r < N; ++r) {
    _mm512_store_ps(lanes[r], acc[r]);
    for (int64_t e = whole; e < E; ++e) lanes[r][0] = __builtin_fmaf(x[r][e], x[r][e], lanes[r][0]);
  }
  float squares[N] = {};
  for (int i = 0; i < 16; ++i)
    for (int r = 0; r < N; ++r) squares[r] += lanes[r][i];
  for (int r = 0; r < N; ++r) scale[r] = 1.f / std::sqrt(squares[r] / static_cast<float>(E) + eps);
#else
  // 8 lanes (AVX2's vector; the scalar build keeps the same order): lane i the FMA chain of elements i, 8 + i, ...
  // over the whole 8-value chunks, the last E % 8 elements added to lane 0, then lanes 0 .. 7 in turn. Written out
  // because GCC's `omp simd` reduction reassociates differently for one row and for four (a row's bits then depended
  // on its neighbours: a chunked prefill's logits were not the whole prompt's).
  const int64_t whole = E / 8 * 8;
  alignas(32) float lanes[N][8];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t e = 0; e < whole; e += 8)
    for (int r = 0; r < N; ++r) {
      const __m256 v = _mm256_loadu_ps(x[r] + e);
      acc[r] = _mm256_fmadd_ps(v, v, acc[r]);
    }
  for (int r = 0; r < N; ++r) _mm256_store_ps(lanes[r], acc[r]);
#else
  for (int r = 0; r < N; ++r)
    for (int i = 0; i < 8; ++i) {
      float chain = 0.f;
      for (int64_t e = i; e < whole; e += 8) chain = __builtin_fmaf(x[r][e], x[r][e], chain);
      lanes[r][i] = chain;
    }
#endif
  for (int r = 0; r < N; ++r) {
    for (int64_t e = whole; e < E; ++e) lanes[r][0] = __builtin_fmaf(x[r][e], x[r][e], lanes[r][0]);
    float squares = 0.f;
    for (int i = 0; i < 8; ++i) squares += lanes[r][i];
    scale[r] = 1.f / std::sqrt(squares / static_cast<float>(E) + eps);
  }
#endif
}

constexpr int kNormRows = 4;  // rows a norm's scales are computed together (RmsScales)

// Rows t0 .. t0 + n - 1 (n <= kNormRows) of a norm: each row's sum (RowSum; h, d: null for no delta; s: null where h
// is the sum already), their scales together (RmsScales), then `out(row, sum, scale)` a row.
template <typename Out>
static void NormRows(const float* H, const float* DL, float* S, int64_t t0, int n, int64_t E, float eps,
                     const Out& out) {
  const float* sums[kNormRows];
  for (int r = 0; r < n; ++r) {
    const int64_t t = t0 + r;
    sums[r] = RowSum(H + t * E, DL ? DL + t * E : nullptr, S ? S + t * E : nullptr, E);
  }
  float scales[kNormRows];
  switch (n) {
    case 1: RmsScales<1>(sums, E, eps, scales); break;
    case 2: RmsScales<2>(sums, E, eps, scales); break;
    case 3: RmsScales<3>(sums, E, eps, scales); break;
    default: RmsScales<kNormRows>(sums, E, eps, scales); break;
  }
  for (int r = 0; r < n; ++r) out(t0 + r, sums[r], scales[r]);
}

// One row's output n: sum * scale * weight.
static void NormRow(const float* __restrict__ sum, const float* __restrict__ W, int64_t E, float scale,
                    float* __restrict__ n) {
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) n[e] = sum[e] * scale * W[e];
}

// The same row rounded to bfloat16 as it is made (Bf16Bits of the same (sum * scale) * weight), into a product's
// rounded row r (Bf16RowWidth(E) values: a zero past an odd E): the float32 row never goes to memory.
__attribute__((target("avx512f"))) static void NormRowBf16(const float* __restrict__ sum, const float* __restrict__ W,
                                                           int64_t E, float scale, uint16_t* __restrict__ r) {
  const __m512 times = _mm512_set1_ps(scale);
  for (int64_t e = 0; e < E; e += 16) {
    const __mmask16 lanes = e + 16 <= E ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (E - e)) - 1);
    const __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, sum + e), times),
                                       _mm512_maskz_loadu_ps(lanes, W + e));
    _mm512_mask_cvtepi32_storeu_epi16(r + e, lanes, Bf16Bits(value));
  }
  if (E % 2) r[E] = 0;
}

// Into the caller's memory (DL null: no delta): S and N, which overlap none of H, DL, W (S null: no delta, H the sum
// already). Rows in runs of kNormRows, each run whole on one thread: the same bits whatever the thread count.
void AddRmsNormInto(const float* __restrict__ H, const float* __restrict__ DL, const float* __restrict__ W, int64_t T,
                    int64_t E, float eps, float* __restrict__ S, float* __restrict__ N) {
  PD_CHECK(S || !DL, "add_rms_norm: a delta needs rows for the sum");
  const auto out = [&](int64_t t, const float* sum, float scale) { NormRow(sum, W, E, scale, N + t * E); };
#pragma omp parallel for schedule(static) if (RowsWorthSharing(T, E))
  for (int64_t t0 = 0; t0 < T; t0 += kNormRows)
    NormRows(H, DL, S, t0, static_cast<int>(std::min<int64_t>(kNormRows, T - t0)), E, eps, out);
}

// The same with the normed rows as a bfloat16 product's rounded X (linear_bf16.cc's layout: R [T, Bf16RowWidth(E)],
// NormRowBf16), where a bfloat16 model's next product wants them: they are not written as float32 rows to be read
// back and rounded (a 512-token SmolLM2 prompt: 1.2 MB written and read twice a layer). AVX512-BF16 CPUs only.
void AddRmsNormBf16Into(const float* __restrict__ H, const float* __restrict__ DL, const float* __restrict__ W,
                        int64_t T, int64_t E, float eps, float* __restrict__ S, uint16_t* __restrict__ R) {
  PD_CHECK(S || !DL, "add_rms_norm: a delta needs rows for the sum");
  const int64_t width = Bf16RowWidth(E);
  const auto out = [&](int64_t t, const float* sum, float scale) { NormRowBf16(sum, W, E, scale, R + t * width); };
#pragma omp parallel for schedule(static) if (RowsWorthSharing(T, E))
  for (int64_t t0 = 0; t0 < T; t0 += kNormRows)
    NormRows(H, DL, S, t0, static_cast<int>(std::min<int64_t>(kNormRows, T - t0)), E, eps, out);
}

std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& hidden, const paddle::Tensor& delta,
                                       const paddle::Tensor& weight, float eps) {
  const int64_t T = hidden.shape()[0], E = hidden.shape()[1];
  const bool add = delta.numel() > 0;
  PD_CHECK(!add || delta.numel() == T * E, "add_rms_norm: delta shape differs from hidden");
  PD_CHECK(weight.numel() == E, "add_rms_norm: weight width differs from hidden");
  auto sum = paddle::empty({T, E}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto normed = paddle::empty({T, E}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  AddRmsNormInto(hidden.data<float>(), add ? delta.data<float>() : nullptr, weight.data<float>(), T, E, eps,
                 sum.data<float>(), normed.data<float>());
  return {sum, normed};
}

PD_BUILD_OP(fdcore_add_rms_norm)
    .Inputs({"Hidden", "Delta", "Weight"})
    .Outputs({"Sum", "Normed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

// SwiGLU: out = silu(gate) * up for gate_up = [gate | up] along the last axis ([T, 2I] -> [T, I]).
// Into the caller's memory: G [T, 2I], O [T, I].
void SiluMulInto(const float* __restrict__ G, int64_t T, int64_t I, float* __restrict__ O) {
#pragma omp parallel for schedule(static) if (RowsWorthSharing(T, I))
  for (int64_t t = 0; t < T; ++t) {
    const float* g = G + t * 2 * I;
    const float* u = g + I;
    float* o = O + t * I;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = Tail(I - i);
      const __m512 x = _mm512_maskz_loadu_ps(m, g + i);
      const __m512 sig = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
      _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(sig, _mm512_maskz_loadu_ps(m, u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      const __m256 x = _mm256_loadu_ps(g + i);
      const __m256 sig = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), Exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
#else
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
#endif
  }
}

std::vector<paddle::Tensor> SiluMul(const paddle::Tensor& gate_up) {
  const int64_t T = gate_up.shape()[0], I = gate_up.shape()[1] / 2;
  auto out = paddle::empty({T, I}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  SiluMulInto(gate_up.data<float>(), T, I, out.data<float>());
  return {out};
}

PD_BUILD_OP(fdcore_silu_mul).Inputs({"GateUp"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(SiluMul));
