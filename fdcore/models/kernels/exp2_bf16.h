// 2^t for 16 floats to the precision of bfloat16 (within 7.5e-5 relative, where bfloat16 keeps 8 bits: 2^-9 = 2e-3),
// shared by the bfloat16 attention's softmax (attention_bf16.h) and the bfloat16 SwiGLU (linear_bf16.cc), whose
// results are rounded to bfloat16 next: 2^t = 2^floor(t) 2^f with f = t - floor(t) in [0, 1) in one vreduceps, 2^f a
// degree-3 polynomial (least-relative-error fit), 2^floor(t) by vscalefps, which floors t itself; 0 below 2^-125.5
// (a denormal would make every product it enters a microcode assist). A lane's result is a function of that lane
// alone. 5 instructions where a float32-exact e^x (simd.h's Exp16) takes 14.
#pragma once

#include <immintrin.h>

__attribute__((target("avx512f,avx512dq"))) static inline __m512 Exp2ForBf16(__m512 t) {
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t)
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(7.802403e-02f), f, _mm512_set1_ps(2.2606707e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583400e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992514e-01f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.5f), _CMP_GE_OQ), p, t);
}

constexpr float kLog2E = 1.44269504088896341f;
