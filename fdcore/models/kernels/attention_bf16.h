// Attention over a bfloat16 cache on AVX512-BF16, a row at a time.
// Part of attention.cc's translation unit, included by it alone.
#pragma once

#include <algorithm>
#include <utility>

#include "attention_keys.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "exp2_bf16.h"
#define FDCORE_ATTENTION_BF16 1
// A bfloat16 cache (the default of a bfloat16 model: fdcore.models.kv_cache.PagedKVCache): half the bytes a key
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
  // (long: the scores, softmax and weighted sums of a pass keep their vectors in registers across it)
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
#endif
