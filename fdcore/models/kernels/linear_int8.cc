// fdcore's weight-only int8 linear layer (wint8): Y[M, N] = X[M, K] . W[N, K]^T, W quantized per output
// row and block of 32 inputs with a scale and a minimum (W ~= scale[n, b] * u[n, k] + minimum[n, b], u in
// [0, 255], both in float16: Q4_1's form with 8-bit levels; a Q8_0 file's q is u = q + 128 with minimum
// = -128 scale, exactly), X as 16-bit fixed point per row and block of 32 in two int8 parts (QuantizeBlock),
// int32 dot products per block and part with AVX512-VNNI's `vpdpbusd` (or AVX2's `vpmaddubsw`, where the
// library is built for a CPU without AVX512-VNNI: see GroupRows), scaled and summed in float32.
//
// Why: a quarter of float32's bytes for decoding one sequence (memory bound), and 4 products per 32-bit
// lane and instruction in batches. The activations keep 16 bits (x ~= top / 32258 (254 hi + lo) per block,
// off by at most top / 64516) where 8 (llama.cpp's Q8 for activations) moved SmolLM2's logits enough to
// change float32's greedy token on 4 of 9 golden prompts within 16 tokens: "weight-only" quantization
// should cost the weights' rounding alone. Two `vpdpbusd` per quad instead of one: batch 1 streams memory
// either way, batches pay it in arithmetic.
//
// NOTE: `vpdpbusd` multiplies unsigned by signed bytes: the levels u are the unsigned operand and each
// part of x the signed one. Per block, D = sum_k (u[n, k] - 128) x16[k] (x16 = 254 hi + lo, an exact int32)
// and the result adds scale * D + centre * sum_k x16 with centre = minimum + 128 scale (the level 128's
// weight: exact in float32, and 0 for a Q8_0 file's blocks), both times the activations' scale. Centred, the
// two terms do not cancel: with the minimum instead they are ~128 times the result for a symmetric block.
// Packing in groups of kGroup output rows: packed[g][kq][b][lane][j] = u[kGroup g + 16 b + lane][4 kq + j],
// so one 64-byte load holds 16 rows x 4 inputs against a broadcast quad of x. kGroup is the path's (64 for
// AVX512-VNNI, 32 for AVX2: fdcore.models.kernels.int8_group_rows packs to match), and a group's bytes
// are contiguous: the threads share out whole groups, each streaming its own range of memory.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"

namespace {

constexpr int kQuant = 32;  // inputs per activation scale
constexpr float kX16Span = 127.f * 254.f;  // x16 = 254 hi + lo spans [-32258, 32258]: x ~= top / kX16Span * x16

}  // namespace

// Whether a one-row pass prefetches the weights it streams (this file's, linear_int4.cc's and linear_f32.cc's). It
// helps or hurts by the host and even the hour: SmolLM2 wint8's forward on 2 threads of a Zen 4 EPYC VM
// (steps alternating in one process) was 9 % faster with it in one session, and in a later one 15 % slower
// (wint4: 7 %), then no different half an hour on. So the model measures both at load
// (LlamaModel.tune_weight_prefetch), the worker re-tries the other now and then (tuning.SwitchTrial), and
// they set it here. The arithmetic is the same either way: so are the bits.
int fdcore_prefetch_weights = 1;

extern "C" void fdcore_set_weight_prefetch(int on) { fdcore_prefetch_weights = on; }
extern "C" int fdcore_weight_prefetch() { return fdcore_prefetch_weights; }

// Whether a loop over `rows` independent rows of `width` values each is shared out over the threads (each row
// whole on one thread: the same bits either way): from 8 rows and 2^12 values. Under 2^16, the bound these loops
// had, a 32-row decode step quantized its activations and ran SwiGLU, the norms and the rotary loop on one
// thread while the other spun (SmolLM2 wint8 decode steps on 2 threads, in-process A/B: batch 32 0.92-0.96x the
// time, 8 0.98x; float32 0.99x). Used by this file, linear_int4.cc, attention.cc, rms_norm.cc and silu_mul.cc (hidden: a direct call).
__attribute__((visibility("hidden"))) bool RowsWorthSharing(int64_t rows, int64_t width) {
  return rows >= 8 && rows * width >= (1 << 12);
}

namespace {

#if defined(__AVX2__)
// The 32 values of x from k0 (zeros past K), as 4 vectors of 8.
inline void LoadBlock(const float* x, int64_t left, __m256* v) {
  for (int i = 0; i < 4; ++i) {
    const int64_t n = left - 8 * i;
    if (n >= 8) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
    } else if (n <= 0) {
      v[i] = _mm256_setzero_ps();
    } else {
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      v[i] = _mm256_maskload_ps(x + 8 * i, lanes);
    }
  }
}

inline float MaxOf(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

#if defined(__AVX2__)
}  // namespace

// One block of 32 activations as 16-bit fixed point in two int8 parts, with the scalar loop's operations (so
// its bits): top = max |x|, t = x * (127 / top) (|t| <= 127), hi = t rounded to nearest even (vcvtps2dq, as
// nearbyint), lo = (t - hi) * 254 rounded (t - hi is exact and within 1/2, so lo is within [-127, 127]), so
// x ~= top / 32258 * (254 hi + lo), off by at most top / 64516. Writes q[0, 32) = hi and q[32, 64) = lo
// (zeros past `left`, the block's real values), the block's scale top / kX16Span and the sum of 254 hi + lo.
// 16 values at a time on AVX-512, 8 on AVX2. One quantizer for linear_int4.cc too, whose activations are
// quantized the same way (hidden: a direct call within the library, no PLT).
__attribute__((visibility("hidden"))) void QuantizeBlock(const float* x, int64_t left, int8_t* q, float* scale,
                                                         int32_t* sum) {
  float top;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __mmask16 m0 = left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
  const __mmask16 m1 = left >= 32 ? 0xffff : left > 16 ? static_cast<__mmask16>((1u << (left - 16)) - 1) : 0;
  const __m512 a = _mm512_maskz_loadu_ps(m0, x), b = _mm512_maskz_loadu_ps(m1, x + 16);
  top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f), step = _mm512_set1_ps(254.f);
  const __m512i by254 = _mm512_set1_epi32(254);
  __m512i total = _mm512_setzero_si512();
  const __m512 t[2] = {_mm512_mul_ps(a, inverse), _mm512_mul_ps(b, inverse)};
  for (int i = 0; i < 2; ++i) {
    const __m512i hi = _mm512_cvtps_epi32(t[i]);
    const __m512 rest = _mm512_sub_ps(t[i], _mm512_cvtepi32_ps(hi));
    const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(rest, step));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 + 16 * i), _mm512_cvtepi32_epi8(lo));
    total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_mullo_epi32(hi, by254), lo));
  }
  *sum = _mm512_reduce_add_epi32(total);
  *scale = top / kX16Span;
#else
  __m256 v[4];
  LoadBlock(x, left, v);
  const __m256 sign = _mm256_set1_ps(-0.f);
  top = MaxOf(_mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
  const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f), step = _mm256_set1_ps(254.f);
  const __m256i by254 = _mm256_set1_epi32(254);
  __m256i hi[4], lo[4], total = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 t = _mm256_mul_ps(v[i], inverse);
    hi[i] = _mm256_cvtps_epi32(t);
    const __m256 rest = _mm256_sub_ps(t, _mm256_cvtepi32_ps(hi[i]));
    lo[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, step));
    total = _mm256_add_epi32(total, _mm256_add_epi32(_mm256_mullo_epi32(hi[i], by254), lo[i]));
  }
  // to bytes in order: packs interleave the 128-bit lanes, the permutation puts them back
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3])), order));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32), _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3])), order));
  __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(half, _mm_shuffle_epi32(half, 0xb1)));
  *scale = top / kX16Span;
#endif
}

namespace {
#endif

// Thread i's share of M rows (i = threads: M): contiguous, cut at multiples of 4 (the kernels' row passes). The
// quantizing and SplitByRows cut alike, so a thread multiplies the rows it quantized.
inline int64_t RowShare(int64_t M, int64_t i, int64_t threads) { return i == threads ? M : M * i / threads / 4 * 4; }

// The activations of one row as the kernels read them: per block of 32, 64 bytes (QuantizeBlock's hi then lo);
// per row and block, the scale (top / kX16Span), 128 times the integer sum (VNNI's offset for its unsigned levels)
// and the scale times that sum (the centre's factor).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> scales, sums;
  std::vector<int32_t> offsets;
};

// x rows -> QuantizedRows (blocks padded with zeros to Kp). With AVX2 or AVX-512, QuantizeBlock: the same
// operations as the scalar loop, so the same bits (the scalar loop took ~7 us of a SmolLM2 batch-1
// projection's ~85, on one thread while the others waited).
void QuantizeRows(const float* X, int64_t M, int64_t K, int64_t Kp, QuantizedRows& rows) {
  const int64_t blocks = Kp / kQuant;
#if defined(__AVX2__)
  rows.q.resize(M * 2 * Kp);  // every block is written whole (its zeros past K too): no clearing pass
#else
  rows.q.assign(M * 2 * Kp, 0);
#endif
  rows.scales.resize(M * blocks);
  rows.sums.resize(M * blocks);
  rows.offsets.resize(M * blocks);
  int8_t* Q = rows.q.data();  // (the calling thread's vectors, taken before the parallel loop)
  float *XS = rows.scales.data(), *XSUM = rows.sums.data();
  int32_t* XO = rows.offsets.data();
  // A row's blocks are its own, so rows shared out across threads give the same bits: a 512-token prefill
  // quantized ~0.4 ms a projection on one thread while the others waited.
#pragma omp parallel if (RowsWorthSharing(M, K))
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    for (int64_t m = RowShare(M, t, threads); m < RowShare(M, t + 1, threads); ++m) {
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t k0 = blk * kQuant, k1 = std::min(K, k0 + kQuant);
        int8_t* q = Q + m * 2 * Kp + 2 * k0;
        float scale;
        int32_t sum;
#if defined(__AVX2__)
        QuantizeBlock(X + m * K + k0, k1 - k0, q, &scale, &sum);
#else
        float top = 0.f;
        for (int64_t k = k0; k < k1; ++k) top = std::max(top, std::fabs(X[m * K + k]));
        const float inverse = top > 0.f ? 127.f / top : 0.f;
        sum = 0;
        for (int64_t k = k0; k < k1; ++k) {
          const float t = X[m * K + k] * inverse;
          const int hi = static_cast<int>(std::nearbyint(t));
          const int lo = static_cast<int>(std::nearbyint((t - static_cast<float>(hi)) * 254.f));
          q[k - k0] = static_cast<int8_t>(hi);
          q[kQuant + k - k0] = static_cast<int8_t>(lo);
          sum += 254 * hi + lo;
        }
        scale = top / kX16Span;
#endif
        XS[m * blocks + blk] = scale;
        XSUM[m * blocks + blk] = scale * static_cast<float>(sum);
        XO[m * blocks + blk] = 128 * sum;
      }
    }
  }
}

// What the multiplying passes read of the quantized activations (QuantizedRows' pointers): row m's block blk
// is q[m * 2 Kp + 64 blk, + 64) (hi, then lo), its scale, sum and offset at [m * blocks + blk].
struct XRows {
  const int8_t* q;
  const float* scales;
  const float* sums;
  const int32_t* offsets;
  int64_t Kp, blocks;

  const int8_t* Block(int64_t m, int64_t blk) const { return q + m * 2 * Kp + blk * 2 * kQuant; }
  // Inputs 4 quad .. 4 quad + 3 of row m's block blk: the hi part's 4 bytes and the lo part's, each as an int32.
  void Quad(int64_t m, int64_t blk, int quad, int32_t* hi, int32_t* lo) const {
    __builtin_memcpy(hi, Block(m, blk) + quad * 4, 4);
    __builtin_memcpy(lo, Block(m, blk) + kQuant + quad * 4, 4);
  }
  int64_t At(int64_t m, int64_t blk) const { return m * blocks + blk; }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kGroup = 64;
constexpr int kBlocks = kGroup / 16;
constexpr int kRowsPerPass = 2;

// How far ahead of the weights one row's pass prefetches (bytes; when fdcore_prefetch_weights is on), as the AVX2
// path below does and for the same reason (~13 instructions per 256 bytes: the out-of-order window reaches
// far less of the stream than float32's does). SmolLM2 wint8 at batch 1 on a Zen 4 EPYC (2 threads, the
// model's forward alone, steps alternating in one process): 6.46 -> 5.90 ms a step (-9 %); 2, 8, 16 and
// 32 KiB and the L2 hint gave the same. In a later session the same model ran 15 % faster without (see above).
constexpr int kPrefetchAhead = 4096;

// MB rows of x against NB of the 4 16-row blocks of one group of 64 output rows, from block B0 (ws: the
// group's scales and minimums, [blocks][2][64] float16 bits). Each output's arithmetic is the same whatever
// MB, NB and B0 are (integer sums over a block's quads, then two FMAs a block in block order), so a row's
// bits do not depend on the pass it falls in. Batches go 4 rows by 2 blocks (16 + 16 integer accumulators,
// the weights of a group read once per 4 rows from L1) where 2 rows by 4 blocks re-read them twice as often.
// stream: the batch's first pass over the group, which brings its weights in from memory: it prefetches every
// line of each quad from block B0 to the group's last (a later pass, or the other half of the group, then reads
// them from cache). Why: a half-group pass reads 2 of each quad's 4 lines, a pattern the hardware's streamer
// keeps up with poorly; unprefetched, 4 rows' products took 1.8-2.2x one row's over the same bytes. SmolLM2 wint8's
// products alone (30 layers), with and without, alternating in one process on the AVX-512 Xeon: 1 thread
// 4 rows 0.77x the time, 8 0.83x, 16 0.89x, 32 0.93x, 64 0.95x, 256 0.96x; 2 threads 0.75x .. 0.98x (512).
// Unlike a one-row pass's prefetch it is not left to the load's measurement (fdcore_prefetch_weights).
template <int MB, int NB = kBlocks, int B0 = 0>
void GroupRows(const XRows& x, const uint8_t* Wg, const uint16_t* ws, int64_t N, int64_t g, int64_t m0, float* Y,
               bool stream = false) {
  // (long: the row block's accumulators live in registers across the whole group)
  __m512 acc[MB][NB];
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) acc[j][b] = _mm512_setzero_ps();
  const uint8_t* w = Wg;
  // (batches re-read a group's quads from L1, 4 rows at a time: only a row alone, or a batch's first pass, prefetches)
  const bool prefetch = MB == 1 && fdcore_prefetch_weights;
  const __m512 level128 = _mm512_set1_ps(128.f);
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m512i hi_dot[MB][NB], lo_dot[MB][NB];
    for (int j = 0; j < MB; ++j)
      for (int b = 0; b < NB; ++b) hi_dot[j][b] = lo_dot[j][b] = _mm512_setzero_si512();
    // (unrolled whole: GCC's own heuristic left the 4-row pass rolled after a harmless change, and the
    // 512-token SmolLM2 prefill's products took 1.16x the time)
#pragma GCC unroll 8
    for (int quad = 0; quad < kQuant / 4; ++quad, w += kGroup * 4) {
      if (prefetch) {
        for (int b = 0; b < NB; ++b) _mm_prefetch(reinterpret_cast<const char*>(w + (B0 + b) * 64 + kPrefetchAhead), _MM_HINT_T0);
      } else if (MB > 1 && stream) {
        for (int b = B0; b < kBlocks; ++b) _mm_prefetch(reinterpret_cast<const char*>(w + b * 64 + kPrefetchAhead), _MM_HINT_T0);
      }
      __m512i wb[NB];
      for (int b = 0; b < NB; ++b) wb[b] = _mm512_loadu_si512(w + (B0 + b) * 64);
      for (int j = 0; j < MB; ++j) {
        int32_t hi, lo;
        x.Quad(m0 + j, blk, quad, &hi, &lo);
        const __m512i x_hi = _mm512_set1_epi32(hi), x_lo = _mm512_set1_epi32(lo);
        for (int b = 0; b < NB; ++b) {
          hi_dot[j][b] = _mm512_dpbusd_epi32(hi_dot[j][b], wb[b], x_hi);
          lo_dot[j][b] = _mm512_dpbusd_epi32(lo_dot[j][b], wb[b], x_lo);
        }
      }
    }
    const __m512i by254 = _mm512_set1_epi32(254);
    __m512 w_scale[NB], centre[NB];
    for (int b = 0; b < NB; ++b) {
      const uint16_t* at = ws + blk * 2 * kGroup + (B0 + b) * 16;
      w_scale[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + kGroup)));
      centre[b] = _mm512_fmadd_ps(w_scale[b], level128, minimum);
    }
    for (int j = 0; j < MB; ++j) {
      const int64_t at = x.At(m0 + j, blk);
      const __m512i offset = _mm512_set1_epi32(x.offsets[at]);
      const __m512 x_scale = _mm512_set1_ps(x.scales[at]), x_sum = _mm512_set1_ps(x.sums[at]);
      for (int b = 0; b < NB; ++b) {
        // sum (u - 128) x16: exact in int32 (|u x16| sums to at most 32 x 255 x 32385 < 2^31)
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(hi_dot[j][b], by254), lo_dot[j][b]), offset);
        acc[j][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(x_scale, w_scale[b]), acc[j][b]);
        acc[j][b] = _mm512_fmadd_ps(centre[b], x_sum, acc[j][b]);
      }
    }
  }
  for (int b = 0; b < NB; ++b) {
    const int64_t first = g * kGroup + (B0 + b) * 16;
    if (first >= N) break;
    const __mmask16 mask = first + 16 <= N ? 0xffff : static_cast<__mmask16>((1u << (N - first)) - 1);
    for (int j = 0; j < MB; ++j) _mm512_mask_storeu_ps(Y + (m0 + j) * N + first, mask, acc[j][b]);
  }
}

// 4 rows at a time, in two halves of the group's blocks (stream: see GroupRows; the first half fetches both).
void GroupFourRows(const XRows& x, const uint8_t* Wg, const uint16_t* ws, int64_t N, int64_t g, int64_t m0, float* Y,
                   bool stream = false) {
  GroupRows<4, 2, 0>(x, Wg, ws, N, g, m0, Y, stream);
  if (g * kGroup + 32 < N) GroupRows<4, 2, 2>(x, Wg, ws, N, g, m0, Y);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kGroup = 32;
constexpr int kBlocks = kGroup / 16;
constexpr int kRowsPerPass = 2;

// How far ahead of the weights it reads the AVX2 paths prefetch (bytes): a quad of a 32-row group is 26
// instructions for 128 bytes (float32's 6), so the out-of-order window holds a quarter of the stream float32's
// does and one thread streamed 8 GB/s from memory where float32 streams 11; 4 KiB ahead measured 10.5 on one
// thread and 18.2 (from 15.0) on two, on the AVX2 EPYC (2026-12-02: 2 to 8 KiB all helped, 4 best).
constexpr int kPrefetchAhead = 4096;

// AVX2 has no vpdpbusd. Per 32 bytes (8 rows x 4 inputs): the signed levels q = u ^ 0x80 = u - 128, then
// llama.cpp's pairing: |q| (unsigned, <= 128) times a part of x carrying q's sign (vpsignb; the parts are
// within [-127, 127], so the sign never overflows), pairs summed to int16 (vpmaddubsw: at most 2 x 128 x 127,
// never saturated) and pairs of those to int32 (vpmaddwd: by 254 for hi, by 1 for lo). That is
// sum (u - 128) x16 itself (no offset to subtract): the same integers as the VNNI path, then the same float32
// arithmetic, so the same bits. A group is 32 rows: 4 integer accumulators a row of x.
template <int MB>
void GroupRows(const XRows& x, const uint8_t* Wg, const uint16_t* ws, int64_t N, int64_t g, int64_t m0, float* Y) {
  // (long: the row block's accumulators live in registers across the whole group)
  constexpr int R = kGroup / 8;  // 8-row vectors
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1),
                by254 = _mm256_set1_epi16(254);
  const __m256 level128 = _mm256_set1_ps(128.f);
  __m256 acc[MB][R];
  for (int j = 0; j < MB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const uint8_t* w = Wg;
  const bool prefetch = fdcore_prefetch_weights;
  for (int64_t blk = 0; blk < x.blocks; ++blk) {
    __m256i dot[MB][R];
    for (int j = 0; j < MB; ++j)
      for (int r = 0; r < R; ++r) dot[j][r] = _mm256_setzero_si256();
    for (int quad = 0; quad < kQuant / 4; ++quad, w += kGroup * 4) {
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchAhead + 64), _MM_HINT_T0);
      }
      for (int j = 0; j < MB; ++j) {  // a row of x at a time against the 4 vectors (its 2 broadcasts live once)
        int32_t hi, lo;
        x.Quad(m0 + j, blk, quad, &hi, &lo);
        const __m256i x_hi = _mm256_set1_epi32(hi), x_lo = _mm256_set1_epi32(lo);
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * 32)), flip);
          const __m256i magnitude = _mm256_abs_epi8(q);
          const __m256i hi_pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x_hi, q));
          const __m256i lo_pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x_lo, q));
          dot[j][r] = _mm256_add_epi32(dot[j][r], _mm256_add_epi32(_mm256_madd_epi16(hi_pairs, by254),
                                                                   _mm256_madd_epi16(lo_pairs, ones)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const uint16_t* at = ws + blk * 2 * kGroup + r * 8;
      const __m256 w_scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + kGroup)));
      const __m256 centre = _mm256_fmadd_ps(w_scale, level128, minimum);
      for (int j = 0; j < MB; ++j) {
        const int64_t i = x.At(m0 + j, blk);
        const __m256 x_scale = _mm256_set1_ps(x.scales[i]), x_sum = _mm256_set1_ps(x.sums[i]);
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][r]), _mm256_mul_ps(x_scale, w_scale), acc[j][r]);
        acc[j][r] = _mm256_fmadd_ps(centre, x_sum, acc[j][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t first = g * kGroup + r * 8;
    if (first >= N) break;
    for (int j = 0; j < MB; ++j) {
      float* y = Y + (m0 + j) * N + first;
      if (first + 8 <= N) {
        _mm256_storeu_ps(y, acc[j][r]);
      } else {
        alignas(32) float row[8];
        _mm256_store_ps(row, acc[j][r]);
        std::copy(row, row + (N - first), y);
      }
    }
  }
}
#else
constexpr int kGroup = 64;
constexpr int kBlocks = kGroup / 16;
constexpr int kRowsPerPass = 1;
template <int MB>
void GroupRows(const XRows&, const uint8_t*, const uint16_t*, int64_t, int64_t, int64_t, float*) {
  PD_CHECK(false, "linear_int8: built for a CPU without AVX2 (the caller must check its flags)");
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
// 4 rows as passes of kRowsPerPass (the AVX-512 VNNI path splits the group's blocks instead).
void GroupFourRows(const XRows& x, const uint8_t* Wg, const uint16_t* ws, int64_t N, int64_t g, int64_t m0, float* Y) {
  for (int j = 0; j < 4; j += kRowsPerPass) GroupRows<kRowsPerPass>(x, Wg, ws, N, g, m0 + j, Y);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// Rows m0 .. m0 + MB - 1 of x against the 16-row blocks lo .. hi - 1 of group g, two blocks a pass (the
// arithmetic of each output is GroupRows', whatever the blocks: the same bits).
template <int MB>
void BlockRange(const XRows& x, const uint8_t* Wg, const uint16_t* ws, int64_t N, int64_t g, int64_t m0, float* Y,
                int64_t lo, int64_t hi, bool stream = false) {
  for (int64_t b = lo; b < hi; stream = false) {  // (a streaming pass's first call prefetches through the group's end)
    if (hi - b >= 2) {
      switch (b) {
        case 0: GroupRows<MB, 2, 0>(x, Wg, ws, N, g, m0, Y, stream); break;
        case 1: GroupRows<MB, 2, 1>(x, Wg, ws, N, g, m0, Y, stream); break;
        default: GroupRows<MB, 2, 2>(x, Wg, ws, N, g, m0, Y, stream); break;
      }
      b += 2;
    } else {
      switch (b) {
        case 0: GroupRows<MB, 1, 0>(x, Wg, ws, N, g, m0, Y, stream); break;
        case 1: GroupRows<MB, 1, 1>(x, Wg, ws, N, g, m0, Y, stream); break;
        case 2: GroupRows<MB, 1, 2>(x, Wg, ws, N, g, m0, Y, stream); break;
        default: GroupRows<MB, 1, 3>(x, Wg, ws, N, g, m0, Y, stream); break;
      }
      b += 1;
    }
  }
}

// Rows m_lo .. m_hi - 1 of x against the 16-row blocks u_begin .. u_end - 1 of W (whole groups by
// GroupFourRows, a group's part by BlockRange: the same arithmetic for each output).
void RowsByBlocks(const XRows& x, const uint8_t* Wp, const uint16_t* ws, int64_t N, int64_t m_lo, int64_t m_hi,
                  int64_t u_begin, int64_t u_end, float* Y) {
  for (int64_t u = u_begin; u < u_end;) {
    const int64_t g = u / kBlocks, lo = u % kBlocks, hi = std::min<int64_t>(kBlocks, u_end - g * kBlocks);
    const uint8_t* Wg = Wp + g * x.Kp * kGroup;
    const uint16_t* wsg = ws + g * x.blocks * 2 * kGroup;
    int64_t m0 = m_lo;
    if (lo == 0 && hi == kBlocks) {
      for (; m0 + 4 <= m_hi; m0 += 4) GroupFourRows(x, Wg, wsg, N, g, m0, Y, m0 == m_lo);
    } else {
      for (; m0 + 4 <= m_hi; m0 += 4) BlockRange<4>(x, Wg, wsg, N, g, m0, Y, lo, hi, m0 == m_lo);
    }
    for (; m0 < m_hi; ++m0) BlockRange<1>(x, Wg, wsg, N, g, m0, Y, lo, hi);
    u = g * kBlocks + hi;
  }
}

// Rows from which a batch's threads split its rows, each thread all of W (below: its outputs).
constexpr int64_t kRowSplit = 256;

// A batch of M >= 4 rows, over the threads:
// - below kRowSplit rows, each thread an equal, contiguous run of the 16-row blocks, which may start or end
//   inside a group. Why: SmolLM2's 576-row products are 9 groups of 64, which whole groups split 5 / 4 over 2
//   threads, and a batch is compute-bound, so the thread with 4 waits (a 512-token SmolLM2 wint8 prefill,
//   alternating in one process: 0.96x the time; batches of 8 and 32 rows no different).
// - from kRowSplit rows, each thread a contiguous share of the rows (RowShare), against all of W. Its
//   rows of x are the ones it quantized, and its rows of y the ones the next operator gives it (the norms and
//   SwiGLU share out rows statically: the same shares but for RowShare's rounding to 4), so rows hardly cross
//   between the cores' caches; W is read by both. A
//   SmolLM2 wint8 prefill on 2 threads of a Zen 4 EPYC, the two splits alternating in one process: 128 tokens
//   1.037x the time (one 32-row decode step: 1.20x, where W's streaming is the work), 256 tokens 0.99x, 512
//   0.95x, 1024 0.92x.
// A one-row pass streams memory: there the thread that finishes first leaves the other the whole bandwidth,
// and a group split in two measured no faster (0.99-1.06x), so one row keeps whole groups (Linear).
void BatchByBlocks(const XRows& x, int64_t M, const uint8_t* Wp,
                   const uint16_t* ws, int64_t N, bool parallel, float* Y) {
  const int64_t units = (N + 15) / 16;
#pragma omp parallel if (parallel)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    if (M >= kRowSplit) {
      RowsByBlocks(x, Wp, ws, N, RowShare(M, t, threads), RowShare(M, t + 1, threads), 0, units, Y);
    } else {
      RowsByBlocks(x, Wp, ws, N, 0, M, units * t / threads, units * (t + 1) / threads, Y);
    }
  }
}
#endif

void Linear(const float* X, int64_t M, int64_t K, const uint8_t* Wp, const uint16_t* ws, int64_t G, int64_t Kp,
            int64_t N, float* Y) {
  thread_local QuantizedRows rows;
  QuantizeRows(X, M, K, Kp, rows);
  // NOTE: taken here, on the calling thread: inside the parallel loop `rows` would name each OpenMP
  // thread's own (empty) thread_local vectors (a null pointer: SIGSEGV whenever OMP_NUM_THREADS > 1).
  const XRows x{rows.q.data(), rows.scales.data(), rows.sums.data(), rows.offsets.data(), Kp, Kp / kQuant};
  const bool parallel = G > 1 && M * N * K >= (1 << 18);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (M >= 4) return BatchByBlocks(x, M, Wp, ws, N, parallel, Y);
#endif
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* Wg = Wp + g * Kp * kGroup;
    const uint16_t* wsg = ws + g * x.blocks * 2 * kGroup;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) GroupFourRows(x, Wg, wsg, N, g, m0, Y);
    for (; m0 + kRowsPerPass <= M; m0 += kRowsPerPass) GroupRows<kRowsPerPass>(x, Wg, wsg, N, g, m0, Y);
    for (; m0 < M; ++m0) GroupRows<1>(x, Wg, wsg, N, g, m0, Y);
  }
}

}  // namespace

// x [M, K] float32; w [G, Kp / 4, kBlocks, 16, 4] uint8 (the levels u, packed); scales [G, Kp / 32, 2, kGroup]
// float16 as int16 (per block the group's scales, then its minimums);
// rows = N.
// Y [M, rows] = X [M, K] . W^T into the caller's memory (decoder_layers' workspace, or the op's output).
void LinearInt8Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, const paddle::Tensor& scales,
                    int64_t rows, float* Y) {
  const auto& s = w.shape();
  PD_CHECK(w.dtype() == paddle::DataType::UINT8, "linear_int8: w must be uint8");
  PD_CHECK(s.size() == 5 && s[2] == kBlocks && s[3] == 16 && s[4] == 4, "linear_int8: w is not packed");
  const int64_t G = s[0], Kp = s[1] * 4;
  PD_CHECK(Kp % kQuant == 0 && Kp >= K && Kp - K < kQuant, "linear_int8: x and w disagree on the inner dimension");
  PD_CHECK(rows > G * kGroup - kGroup && rows <= G * kGroup, "linear_int8: rows does not fit the packed groups");
  PD_CHECK(scales.numel() == G * 2 * kGroup * (Kp / kQuant),
           "linear_int8: one scale and one minimum per packed row and block");
  PD_CHECK(scales.dtype() == paddle::DataType::INT16, "linear_int8: scales must be float16 bits (int16)");
  Linear(X, M, K, w.data<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data<int16_t>()), G, Kp, rows, Y);
}

std::vector<paddle::Tensor> LinearInt8(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& scales,
                                       int64_t rows) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "linear_int8: x must be float32");
  const int64_t M = x.shape()[0];
  auto y = paddle::empty({M, rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  LinearInt8Into(x.data<float>(), M, x.shape()[1], w, scales, rows, y.data<float>());
  return {y};
}

PD_BUILD_OP(fdcore_linear_int8)
    .Inputs({"X", "W", "Scales"})
    .Outputs({"Y"})
    .Attrs({"rows: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearInt8));
