#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"
#include "simd.h"

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
