// float32 -> bfloat16 bits for 16 lanes, shared by the kernels that round activations (linear_bf16.cc: a product's
// rounded rows, the norms' and the SwiGLU's; attention.cc: the KV cache, the attention's output rows): rounded
// to nearest even as every bfloat16 conversion does (a NaN stays a NaN, quieted), in integer steps: bits + 0x7fff +
// (bit 16), the upper half, in each 32-bit lane's low half. Unlike vcvtneps2bf16 it keeps denormals. Every float32 ->
// bfloat16 rounding of activations and of the KV cache is this one, so a value has the same bits whichever kernel
// rounds it.
#pragma once

#include <immintrin.h>

__attribute__((target("avx512f"))) static inline __m512i Bf16Bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_or_epi32(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16), nan, high,
                              _mm512_set1_epi32(0x40));
}
