// fdcore's bfloat16-weight linear layer: Y[M, N] = X[M, K] . W[N, K]^T, W in bfloat16 (Hugging Face's
// [out, in] layout), X and Y in float32, float32 accumulation.
//
// Why: decoding one token reads every weight once, so its speed is the memory's; bfloat16 weights
// are half the bytes of float32. Paddle's CPU build has no bfloat16 matmul kernel.
//
// Two paths, chosen by the caller from the CPU's flags (/proc/cpuinfo), never assumed:
//   path 1 (avx512_bf16): X rounded to bfloat16 once per call, then `vdpbf16ps` (two bf16 products
//          per float32 lane and instruction) over register tiles of 4 x 4 (1 x 8 for one row);
//   path 0 (any x86-64): each weight row widened to float32 once and dotted with every X row.
// Both read W exactly once per call. Built with per-function target attributes, so the library
// compiles on any CPU and the AVX-512 code only runs where the caller found the instructions.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace {

inline float WidenBf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline uint16_t RoundToBf16(float value) {  // round to nearest even, as every bf16 conversion does
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void LinearPortable(const float* X, int64_t M, int64_t K, const uint16_t* W, int64_t N, float* Y) {
  std::vector<float> row(K);
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* w = W + n * K;
    for (int64_t k = 0; k < K; ++k) row[k] = WidenBf16(w[k]);
    const float* __restrict__ r = row.data();
    for (int64_t m = 0; m < M; ++m) {
      const float* __restrict__ x = X + m * K;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += x[k] * r[k];
      Y[m * N + n] = sum;
    }
  }
}

#define FDCORE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// One MB x NB tile of Y: MB rows of X against NB rows of W, K in steps of 32 bf16 values.
template <int MB, int NB>
FDCORE_BF16_TARGET void Tile(const uint16_t* Xb, int64_t K, const uint16_t* W, int64_t N, int64_t m0,
                             int64_t n0, float* Y) {
  __m512 acc[MB][NB];
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) acc[j][i] = _mm512_setzero_ps();
  const int64_t full = K / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    __m512bh w[NB];
    for (int i = 0; i < NB; ++i) w[i] = (__m512bh)_mm512_loadu_si512(W + (n0 + i) * K + k);
    for (int j = 0; j < MB; ++j) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(Xb + (m0 + j) * K + k);
      for (int i = 0; i < NB; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], w[i], x);
    }
  }
  if (full < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - full)) - 1);
    __m512bh w[NB];
    for (int i = 0; i < NB; ++i) w[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, W + (n0 + i) * K + full);
    for (int j = 0; j < MB; ++j) {
      const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(mask, Xb + (m0 + j) * K + full);
      for (int i = 0; i < NB; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], w[i], x);
    }
  }
  for (int j = 0; j < MB; ++j)
    for (int i = 0; i < NB; ++i) Y[(m0 + j) * N + n0 + i] = _mm512_reduce_add_ps(acc[j][i]);
}

// Columns of Y [n0, n0 + NB) for every row: the NB weight rows stay in L1 while every X row passes
// (W is read from memory once, whatever M is), rows left over one at a time.
template <int MB, int NB>
FDCORE_BF16_TARGET void ColumnBlock(const uint16_t* Xb, int64_t M, int64_t K, const uint16_t* W, int64_t N,
                                    int64_t n0, float* Y) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) Tile<MB, NB>(Xb, K, W, N, m0, n0, Y);
  for (; m0 < M; ++m0) Tile<1, NB>(Xb, K, W, N, m0, n0, Y);
}

FDCORE_BF16_TARGET void LinearAvx512Bf16(const float* X, int64_t M, int64_t K, const uint16_t* W, int64_t N,
                                         float* Y) {
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(M * K);
  for (int64_t i = 0; i < M * K; ++i) rounded[i] = RoundToBf16(X[i]);
  const uint16_t* Xb = rounded.data();
  // Output columns are split across the OpenMP threads (OMP_NUM_THREADS): each thread streams its
  // own share of W, which is what makes one sequence's decoding use more than one core's bandwidth.
  const int tile = M == 1 ? 8 : 4;  // decoding one sequence: more independent accumulators per X row
  const int64_t tiles = N / tile;
  const bool parallel = tiles > 1 && M * N * K >= (1 << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t t = 0; t < tiles; ++t) {
    if (M == 1) {
      Tile<1, 8>(Xb, K, W, N, 0, t * 8, Y);
    } else {
      ColumnBlock<4, 4>(Xb, M, K, W, N, t * 4, Y);
    }
  }
  for (int64_t n0 = tiles * tile; n0 < N; ++n0) ColumnBlock<4, 1>(Xb, M, K, W, N, n0, Y);
}

}  // namespace

std::vector<paddle::Tensor> LinearBf16(const paddle::Tensor& x, const paddle::Tensor& w, int64_t path) {
  const int64_t M = x.shape()[0], K = x.shape()[1], N = w.shape()[0];
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "linear_bf16: x must be float32");
  PD_CHECK(w.dtype() == paddle::DataType::BFLOAT16, "linear_bf16: w must be bfloat16");
  PD_CHECK(w.shape()[1] == K, "linear_bf16: x and w disagree on the inner dimension");
  auto y = paddle::empty({M, N}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const auto* W = static_cast<const uint16_t*>(w.data());
  if (path == 1) {
    LinearAvx512Bf16(x.data<float>(), M, K, W, N, y.data<float>());
  } else {
    LinearPortable(x.data<float>(), M, K, W, N, y.data<float>());
  }
  return {y};
}

PD_BUILD_OP(fdcore_linear_bf16)
    .Inputs({"X", "W"})
    .Outputs({"Y"})
    .Attrs({"path: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearBf16));
