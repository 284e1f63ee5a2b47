// fdcore's weight-only 4-bit linear layer (wint4): Y[M, N] = X[M, K] . W[N, K]^T, W quantized per output
// row and block of 32 inputs asymmetrically (llama.cpp's Q4_1: W ~= scale[n, b] * q[n, k] + minimum[n, b],
// q in [0, 15], scale and minimum in float16), X quantized on the fly per row and block of 32 to 16-bit
// fixed point in two int8 parts (as wint8 does: linear_int8.cc says why), int32 dot products per block and
// part with AVX512-VNNI's `vpdpbusd`, scaled and summed in float32 (AVX2's `vpmaddubsw` where the library is
// built for a CPU without AVX512-VNNI).
//
// Why: decoding one sequence reads every weight once (memory bound), and Q4_1 is 20 bytes per 32 weights:
// 0.56x wint8's 36, 0.16x float32's 128. The minimum keeps quality close to float32 (a block's range is
// used whole, not mirrored around 0).
//
// NOTE: the nibbles are unsigned, so they are `vpdpbusd`'s unsigned operand as they are (no offset);
// the minimum's share is minimum[n, b] * sum_k x'[k] (one number per row of X and block, shared by every
// output) with x' the quantized x, as llama.cpp's Q8_1 does: then the result is exactly x' . W', the
// activations' rounding error meets the weights themselves (centred on 0). With the exact float sum of x
// instead, it meets W - minimum (all of one sign) and measured twice the logit error on SmolLM2.
// Packing (fdcore.models.matrices.Int4Matrix), in groups of 32 output rows, each block of 32 inputs one
// contiguous 640-byte record: 512 bytes of nibbles, [v][b][lane][j] = q[32 g + 16 b + lane][8 v + j] |
// q[32 g + 16 b + lane][8 v + 4 + j] << 4 (v < 4, b < 2, lane < 16, j < 4), then the 32 rows' scales
// and their 32 minimums (float16). One 64-byte load is 16 rows x 8 inputs: its low nibbles (a mask) and
// high nibbles (a shift and the mask) are two vectors of 16 rows x 4 inputs, each multiplied against a
// broadcast quad of x. A group's weights are one stream read front to back; groups are what the threads
// share out (32 rows: the 576-wide projections of SmolLM2 are 18 groups, even on 2 or 3 threads), and
// each pass over a group serves up to 4 rows of X (2 on AVX2), so a block is unpacked once per 4 rows.
// A row of the quantized X is, per block, 64 bytes: its hi part, then its lo part (QuantizeBlock).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"

namespace {

constexpr int kGroup = 32;                               // output rows per packed group
constexpr int kLanes = kGroup / 16;                      // 16-row vectors per group
constexpr int kQuant = 32;                               // inputs per block (weights and activations)
constexpr int kNibbleBytes = kGroup * kQuant / 2;        // a group's nibbles for one block
constexpr int kRecord = kNibbleBytes + 2 * kGroup * 2;   // ... then its float16 scales and minimums
constexpr int64_t kChunk = 64;                           // rows of X per chunk (their int8 copy stays in L2)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// How many records (640 bytes each) ahead one row's pass prefetches: SmolLM2 wint4 at batch 1 on a Zen 4
// EPYC (2 threads, the forward alone, steps alternating in one process) 4.29 -> 4.22 ms a step (-1.7 %;
// three runs -1.5 to -2.8 %). Less than wint8's gain: a record's nibbles cost twice the instructions per byte.
constexpr int kPrefetchRecords = 8;  // (when fdcore_prefetch_weights is on: linear_int8.cc says why it may not be)

constexpr int kRowsPerPass = 4;  // rows of X per pass over a group's weights

// MB rows of x (from Xq, xs, xsum at the first of them; a row's quantized values 2 Kp bytes apart) against one
// group of 32 output rows (Wg: its records, one per block); Y at the first row's first output of the group.
// Per output and block two integer sums, of the hi and the lo parts, are combined exactly (254 hi + lo).
// stream: the chunk's first pass over the group, which brings its records in from memory, prefetches them as a
// row alone does (later passes read them from cache). SmolLM2 wint4's products alone, with and without,
// alternating in one process on the AVX-512 Xeon (1 thread): 4 rows 0.74x the time, 8 0.85x, 16-64 0.92-0.96x,
// 256 no different. Not left to the load's measurement as a row alone's is (fdcore_prefetch_weights).
template <int MB>
void GroupRows(const int8_t* Xq, const float* xs, const float* xsum, int64_t Kp, const uint8_t* Wg, int64_t outputs,
               int64_t N, float* Y, bool stream = false) {
  // (long: the row block's accumulators live in registers across the whole group)
  const int64_t blocks = Kp / kQuant;
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[MB][kLanes];
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < kLanes; ++b) acc[j][b] = _mm512_setzero_ps();
  const uint8_t* w = Wg;
  const bool prefetch = fdcore_prefetch_weights;
  for (int64_t blk = 0; blk < blocks; ++blk, w += kRecord) {
    __m512i hi_dot[MB][kLanes], lo_dot[MB][kLanes];
    for (int j = 0; j < MB; ++j)
      for (int b = 0; b < kLanes; ++b) hi_dot[j][b] = lo_dot[j][b] = _mm512_setzero_si512();
    const int8_t* xb = Xq + blk * 2 * kQuant;
    if (MB == 1 ? prefetch : stream) {  // a record's 10 lines, 8 records ahead (see kPrefetchRecords)
      for (int line = 0; line < kRecord / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(w + line * 64 + kPrefetchRecords * kRecord), _MM_HINT_T0);
    }
    for (int v = 0; v < kQuant / 8; ++v) {
      __m512i lo[kLanes], hi[kLanes];  // both 16-row vectors' nibbles, then every row against them
      for (int b = 0; b < kLanes; ++b) {
        const __m512i packed = _mm512_loadu_si512(w + (v * kLanes + b) * 64);
        lo[b] = _mm512_and_si512(packed, low);
        hi[b] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
      }
      for (int j = 0; j < MB; ++j) {
        const int8_t* x = xb + j * 2 * Kp + v * 8;
        int32_t quads[4];  // the hi part's inputs 8 v .. 8 v + 3 and 8 v + 4 .. 8 v + 7, then the lo part's
        __builtin_memcpy(&quads[0], x, 4);
        __builtin_memcpy(&quads[1], x + 4, 4);
        __builtin_memcpy(&quads[2], x + kQuant, 4);
        __builtin_memcpy(&quads[3], x + kQuant + 4, 4);
        const __m512i q0 = _mm512_set1_epi32(quads[0]), q1 = _mm512_set1_epi32(quads[1]),
                      q2 = _mm512_set1_epi32(quads[2]), q3 = _mm512_set1_epi32(quads[3]);
        for (int b = 0; b < kLanes; ++b) {
          hi_dot[j][b] = _mm512_dpbusd_epi32(hi_dot[j][b], lo[b], q0);
          hi_dot[j][b] = _mm512_dpbusd_epi32(hi_dot[j][b], hi[b], q1);
          lo_dot[j][b] = _mm512_dpbusd_epi32(lo_dot[j][b], lo[b], q2);
          lo_dot[j][b] = _mm512_dpbusd_epi32(lo_dot[j][b], hi[b], q3);
        }
      }
    }
    const __m512i by254 = _mm512_set1_epi32(254);
    __m512 scale[kLanes], minimum[kLanes];
    for (int b = 0; b < kLanes; ++b) {
      scale[b] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kNibbleBytes + b * 32)));
      minimum[b] = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kNibbleBytes + kGroup * 2 + b * 32)));
    }
    for (int j = 0; j < MB; ++j) {
      const __m512 x_scale = _mm512_set1_ps(xs[j * blocks + blk]), x_sum = _mm512_set1_ps(xsum[j * blocks + blk]);
      for (int b = 0; b < kLanes; ++b) {
        const __m512i total = _mm512_add_epi32(_mm512_mullo_epi32(hi_dot[j][b], by254), lo_dot[j][b]);
        acc[j][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(scale[b], x_scale), acc[j][b]);
        acc[j][b] = _mm512_fmadd_ps(minimum[b], x_sum, acc[j][b]);
      }
    }
  }
  for (int b = 0; b < kLanes && b * 16 < outputs; ++b) {
    const int64_t here = outputs - b * 16;
    const __mmask16 mask = here >= 16 ? 0xffff : static_cast<__mmask16>((1u << here) - 1);
    for (int j = 0; j < MB; ++j) _mm512_mask_storeu_ps(Y + j * N + b * 16, mask, acc[j][b]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kRowsPerPass = 2;  // rows of X per pass: each row's 4 integer accumulators and 4 broadcasts in registers

// Prefetch distance (bytes) of this path, as linear_int8.cc's (the same reason: ~20 instructions per 128 bytes).
constexpr int kPrefetchAhead = 4096;

// AVX2 has no vpdpbusd: a 32-byte half of a 64-byte load is 8 rows x 8 inputs; its low and high
// nibbles (unsigned, <= 15) times a broadcast quad of a part of x are summed in pairs to int16 by
// vpmaddubsw (at most 2 x 15 x 127 each, two of them added: never saturated), and widened to int32 at
// once (vpmaddwd: the hi part's by 254, the lo part's by 1), one int32 accumulator per row of x and 8
// outputs: the same integers as the VNNI path, then the same float32 arithmetic, so the same bits. The
// group's 32 rows are 4 vectors of 8; a row of x at a time against them (its 4 broadcasts live once).
template <int MB>
void GroupRows(const int8_t* Xq, const float* xs, const float* xsum, int64_t Kp, const uint8_t* Wg, int64_t outputs,
               int64_t N, float* Y, bool = false) {  // (every pass prefetches here, when prefetching is on)
  constexpr int R = kGroup / 8;
  const int64_t blocks = Kp / kQuant;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), by254 = _mm256_set1_epi16(254);
  __m256 acc[MB][R];
  for (int j = 0; j < MB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const uint8_t* w = Wg;
  const bool prefetch = fdcore_prefetch_weights;
  for (int64_t blk = 0; blk < blocks; ++blk, w += kRecord) {
    __m256i dot[MB][R];
    for (int j = 0; j < MB; ++j)
      for (int r = 0; r < R; ++r) dot[j][r] = _mm256_setzero_si256();
    const int8_t* xb = Xq + blk * 2 * kQuant;
    for (int v = 0; v < kQuant / 8; ++v) {
      if (prefetch) {
        _mm_prefetch(reinterpret_cast<const char*>(w + v * 128 + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + v * 128 + kPrefetchAhead + 64), _MM_HINT_T0);
      }
      for (int j = 0; j < MB; ++j) {
        __m256i quads[4];  // the hi part's two quads, then the lo part's
        for (int i = 0; i < 4; ++i) {
          int32_t four;
          __builtin_memcpy(&four, xb + j * 2 * Kp + (i / 2) * kQuant + v * 8 + (i % 2) * 4, 4);
          quads[i] = _mm256_set1_epi32(four);
        }
        for (int r = 0; r < R; ++r) {  // rows 8 r .. 8 r + 7: 16-row vector r / 2, its half r % 2
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 128 + r * 32));
          const __m256i lo = _mm256_and_si256(packed, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
          const __m256i hi_part = _mm256_add_epi16(_mm256_maddubs_epi16(lo, quads[0]), _mm256_maddubs_epi16(hi, quads[1]));
          const __m256i lo_part = _mm256_add_epi16(_mm256_maddubs_epi16(lo, quads[2]), _mm256_maddubs_epi16(hi, quads[3]));
          dot[j][r] = _mm256_add_epi32(dot[j][r], _mm256_add_epi32(_mm256_madd_epi16(hi_part, by254),
                                                                   _mm256_madd_epi16(lo_part, ones)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kNibbleBytes + r * 16)));
      const __m256 minimum =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kNibbleBytes + kGroup * 2 + r * 16)));
      for (int j = 0; j < MB; ++j) {
        const __m256 x_scale = _mm256_set1_ps(xs[j * blocks + blk]), x_sum = _mm256_set1_ps(xsum[j * blocks + blk]);
        acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[j][r]), _mm256_mul_ps(scale, x_scale), acc[j][r]);
        acc[j][r] = _mm256_fmadd_ps(minimum, x_sum, acc[j][r]);
      }
    }
  }
  for (int r = 0; r < R && r * 8 < outputs; ++r) {
    for (int j = 0; j < MB; ++j) {
      if (outputs - r * 8 >= 8) {
        _mm256_storeu_ps(Y + j * N + r * 8, acc[j][r]);
      } else {
        alignas(32) float row[8];
        _mm256_store_ps(row, acc[j][r]);
        std::copy(row, row + (outputs - r * 8), Y + j * N + r * 8);
      }
    }
  }
}
#else
constexpr int kRowsPerPass = 1;
template <int MB>
void GroupRows(const int8_t*, const float*, const float*, int64_t, const uint8_t*, int64_t, int64_t, float*, bool = false) {}
#endif

// One row of x -> two int8 parts per block of 32 (64 bytes a block, zeros past K, up to Kp), the blocks' scales
// and the sums of the quantized x (scale * the block's sum of 254 hi + lo): QuantizeBlock's bits, as wint8's.
void QuantizeRow(const float* x, int64_t K, int64_t Kp, int8_t* q, float* scales, float* sums) {
#if defined(__AVX2__)
  for (int64_t blk = 0, k0 = 0; k0 < Kp; ++blk, k0 += kQuant) {
    int32_t sum;
    QuantizeBlock(x + k0, std::min<int64_t>(K - k0, kQuant), q + 2 * k0, &scales[blk], &sum);
    sums[blk] = scales[blk] * static_cast<float>(sum);
  }
#else
  PD_CHECK(false, "linear_int4: built for a CPU without AVX2 (the caller must check its flags)");
#endif
}

void Linear(const float* X, int64_t M, int64_t K, const uint8_t* Wp, int64_t G, int64_t Kp,
                               int64_t N, float* Y) {
  const int64_t blocks = Kp / kQuant;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> scales, sums;
  q.resize(M * 2 * Kp);
  scales.resize(M * blocks);
  sums.resize(M * blocks);
  int8_t* xq = q.data();  // taken on the calling thread: in the parallel loops `q` is each thread's own
  float *xs = scales.data(), *xsum = sums.data();
#pragma omp parallel for schedule(static) if (RowsWorthSharing(M, K))
  for (int64_t m = 0; m < M; ++m) QuantizeRow(X + m * K, K, Kp, xq + m * 2 * Kp, xs + m * blocks, xsum + m * blocks);

  const int64_t chunks = (M + kChunk - 1) / kChunk;
  const bool parallel = G > 1 && M * N * K >= (1 << 18);
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* Wg = Wp + g * blocks * kRecord;
      const int64_t outputs = std::min<int64_t>(kGroup, N - g * kGroup), end = std::min(M, (c + 1) * kChunk);
      auto rows = [&](auto pass, int64_t m) {
        constexpr int MB = decltype(pass)::value;
        GroupRows<MB>(xq + m * 2 * Kp, xs + m * blocks, xsum + m * blocks, Kp, Wg, outputs, N, Y + m * N + g * kGroup,
                      m == c * kChunk);
      };
      int64_t m = c * kChunk;
      for (; m + kRowsPerPass <= end; m += kRowsPerPass) rows(std::integral_constant<int, kRowsPerPass>(), m);
      switch (end - m) {
        case 3: rows(std::integral_constant<int, 3>(), m); break;
        case 2: rows(std::integral_constant<int, 2>(), m); break;
        case 1: rows(std::integral_constant<int, 1>(), m); break;
        default: break;
      }
    }
  }
}

}  // namespace

// x [M, K] float32; w [G, Kp / 32, 640] uint8 (records packed as above); rows = N.
// Y [M, rows] = X [M, K] . W^T into the caller's memory (decoder_layers' workspace, or the op's output).
void LinearInt4Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows, float* Y) {
  const auto& s = w.shape();
  PD_CHECK(w.dtype() == paddle::DataType::UINT8, "linear_int4: w must be uint8");
  PD_CHECK(s.size() == 3 && s[2] == kRecord, "linear_int4: w is not packed");
  const int64_t G = s[0], Kp = s[1] * kQuant;
  PD_CHECK(K >= 1 && Kp >= K && Kp - K < kQuant, "linear_int4: x and w disagree on the inner dimension");
  PD_CHECK(rows > G * kGroup - kGroup && rows <= G * kGroup, "linear_int4: rows does not fit the packed groups");
  if (M > 0) Linear(X, M, K, w.data<uint8_t>(), G, Kp, rows, Y);
}

std::vector<paddle::Tensor> LinearInt4(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "linear_int4: x must be float32");
  PD_CHECK(x.shape().size() == 2, "linear_int4: x must be [M, K]");
  const int64_t M = x.shape()[0];
  auto y = paddle::empty({M, rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  LinearInt4Into(x.data<float>(), M, x.shape()[1], w, rows, y.data<float>());
  return {y};
}

PD_BUILD_OP(fdcore_linear_int4)
    .Inputs({"X", "W"})
    .Outputs({"Y"})
    .Attrs({"rows: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearInt4));
