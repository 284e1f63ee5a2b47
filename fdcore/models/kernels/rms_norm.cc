#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_bits.h"
#include "kernels.h"
#include "paddle/extension.h"
#include "simd.h"

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
