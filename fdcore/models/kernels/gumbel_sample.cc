#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"
#include "simd.h"

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
