// Vector helpers shared by the attention, sampling and activation kernels: e^x, reductions and tail masks,
// for AVX-512 (16 lanes) and AVX2 (8 lanes). Each is a function of its lanes alone, so a row's result does not
// depend on what the other lanes hold.
#pragma once

#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
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
#elif defined(__AVX2__) && defined(__FMA__)
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
#endif
