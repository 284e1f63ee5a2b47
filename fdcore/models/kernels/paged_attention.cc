// fdcore's Paddle operators. Attention over a paged KV cache reads each block in place (no gather):
//
// q        [B, H, D]          float32, already scaled by 1/sqrt(D)
// k_cache  [KVH, NB, BS, D]   float32 (the worker's cache of one layer, shared with numpy)
// v_cache  [KVH, NB, BS, D]   float32
// tables   [B, W]             int64, block ids of each row's sequence (padded)
// lengths  [B]                int64, keys each row attends to (its position + 1)
// out      [B, H, D]          float32
//
// Grouped-query attention: head h reads KV head h / (H / KVH). Softmax in float32
// with the running maximum subtracted, as the reference does.
#include <cmath>
#include <vector>

#include "paddle/extension.h"

// The attention of B rows over their own prefixes in the paged cache (the shared core of the ops).
// window > 0: a row at position p sees only keys p - window + 1 .. p (sliding-window attention).
static void AttendRows(const float* Q, int64_t B, int64_t H, int64_t D, const float* K, const float* V,
                       int64_t KVH, int64_t NB, int64_t BS, const int64_t* T, int64_t W, const int64_t* LEN,
                       int64_t window, float* O) {
  const int64_t G = H / KVH;
  std::vector<float> scores;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = LEN[b];
    PD_CHECK(end >= 1 && end <= W * BS, "attention: length out of range of the block table");
    const int64_t first = (window > 0 && end > window) ? end - window : 0;
    const int64_t L = end - first;  // keys this row sees: positions first .. end - 1
    const int64_t* table = T + b * W;
    for (int64_t i = first / BS; i < (end + BS - 1) / BS; ++i) {
      PD_CHECK(table[i] >= 0 && table[i] < NB, "attention: block id out of range");
    }
    scores.resize(G * L);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      const float* qg = Q + (b * H + kvh * G) * D;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t key = first + l;
        const float* __restrict__ kr = K + ((kvh * NB + table[key / BS]) * BS + key % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict__ qr = qg + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qr[d] * kr[d];
          scores[g * L + l] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* row = scores.data() + g * L;
        float top = row[0];
#pragma omp simd reduction(max : top)
        for (int64_t l = 1; l < L; ++l) top = row[l] > top ? row[l] : top;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t l = 0; l < L; ++l) {
          row[l] = expf(row[l] - top);
          total += row[l];
        }
        const float inv = 1.f / total;
        for (int64_t l = 0; l < L; ++l) row[l] *= inv;
        float* o = O + (b * H + kvh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      }
      for (int64_t l = 0; l < L; ++l) {
        const int64_t key = first + l;
        const float* __restrict__ vr = V + ((kvh * NB + table[key / BS]) * BS + key % BS) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + l];
          float* __restrict__ o = O + (b * H + kvh * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
        }
      }
    }
  }
}

// Everything between the QKV projection and the output projection, for every row at once:
// Qwen3's per-head RMSNorm of q and k (q_norm / k_norm [D], or empty tensors: none), rotary
// embedding (HF's rotate-half, with cos / sin [T, D/2] computed by the caller, any scaling folded
// in), q scaled, k and v written into the paged cache at each row's slot, then attention over each
// row's prefix (its last `window` keys when window > 0).
// qkv [T, (H + 2 KVH) D]; slots [T] int64 (block * BS + offset); out [T, H D].
std::vector<paddle::Tensor> AttentionBlock(const paddle::Tensor& qkv, const paddle::Tensor& cos,
                                           const paddle::Tensor& sin, const paddle::Tensor& slots,
                                           const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                                           const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                           const paddle::Tensor& q_norm, const paddle::Tensor& k_norm,
                                           int64_t num_heads, float scale, int64_t window, float norm_eps) {
  const auto ks = k_cache.shape();
  const int64_t KVH = ks[0], NB = ks[1], BS = ks[2], D = ks[3], H = num_heads, half = D / 2;
  const int64_t Tn = qkv.shape()[0];
  PD_CHECK(qkv.shape()[1] == (H + 2 * KVH) * D, "attention_block: qkv width does not match the heads");
  PD_CHECK(H % KVH == 0 && v_cache.shape() == ks, "attention_block: cache shapes do not match");
  auto q = paddle::empty({Tn, H, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto out = paddle::empty({Tn, H * D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* X = qkv.data<float>();
  const float* C = cos.data<float>();
  const float* S = sin.data<float>();
  const int64_t* SLOT = slots.data<int64_t>();
  float* Kc = const_cast<float*>(k_cache.data<float>());  // the cache is written in place
  float* Vc = const_cast<float*>(v_cache.data<float>());
  float* Qo = q.data<float>();
  const bool normed = q_norm.numel() > 0;
  PD_CHECK(!normed || (q_norm.numel() == D && k_norm.numel() == D), "attention_block: q/k norm width != D");
  const float* QN = normed ? q_norm.data<float>() : nullptr;
  const float* KN = normed ? k_norm.data<float>() : nullptr;
  std::vector<float> head(D);
  for (int64_t t = 0; t < Tn; ++t) {
    const float* row = X + t * (H + 2 * KVH) * D;
    const float* c = C + t * half;
    const float* s = S + t * half;
    PD_CHECK(SLOT[t] >= 0 && SLOT[t] < NB * BS, "attention_block: slot out of range");
    for (int64_t h = 0; h < H + KVH; ++h) {  // query heads, then key heads, rotated
      const float* x = row + h * D;
      if (normed) {  // HF's RMSNorm over the head: x * rsqrt(mean(x^2) + eps) * weight
        float squares = 0.f;
        for (int64_t i = 0; i < D; ++i) squares += x[i] * x[i];
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + norm_eps);
        const float* w = h < H ? QN : KN;
        for (int64_t i = 0; i < D; ++i) head[i] = x[i] * inv * w[i];
        x = head.data();
      }
      float* dst = h < H ? Qo + (t * H + h) * D : Kc + ((h - H) * NB * BS + SLOT[t]) * D;
      const float mul = h < H ? scale : 1.f;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i] * c[i] - x[i + half] * s[i];
        const float b = x[i + half] * c[i] + x[i] * s[i];
        dst[i] = h < H ? a * mul : a;
        dst[i + half] = h < H ? b * mul : b;
      }
    }
    for (int64_t j = 0; j < KVH; ++j) {  // values, as they are
      const float* x = row + (H + KVH + j) * D;
      float* dst = Vc + (j * NB * BS + SLOT[t]) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = x[i];
    }
  }
  AttendRows(Qo, Tn, H, D, Kc, Vc, KVH, NB, BS, tables.data<int64_t>(), tables.shape()[1],
             lengths.data<int64_t>(), window, out.data<float>());
  return {out};
}

PD_BUILD_OP(fdcore_attention_block)
    .Inputs({"QKV", "Cos", "Sin", "Slots", "KCache", "VCache", "Tables", "Lengths", "QNorm", "KNorm"})
    .Outputs({"Out"})
    .Attrs({"num_heads: int64_t", "scale: float", "window: int64_t", "norm_eps: float"})
    .SetKernelFn(PD_KERNEL(AttentionBlock));

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

std::vector<paddle::Tensor> GumbelSample(const paddle::Tensor& logits, const paddle::Tensor& keys,
                                         const paddle::Tensor& inv_temperature) {
  const int64_t R = logits.shape()[0], V = logits.shape()[1];
  auto out = paddle::empty({R}, paddle::DataType::INT64, paddle::CPUPlace());
  const float* X = logits.data<float>();
  const int64_t* KEY = keys.data<int64_t>();
  const float* INV_T = inv_temperature.data<float>();
  int64_t* O = out.data<int64_t>();
  std::vector<float> score(V);
  for (int64_t r = 0; r < R; ++r) {
    const uint64_t key = static_cast<uint64_t>(KEY[r]);
    const uint32_t k1 = static_cast<uint32_t>(key), k2 = static_cast<uint32_t>(key >> 32);
    const float* row = X + r * V;
    const float inv_t = INV_T[r];
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) {
      const uint32_t h = mix32(mix32(k1 ^ (static_cast<uint32_t>(i) * 0x9E3779B9U)) + k2);
      const float u = (static_cast<float>(h >> 8) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
      score[i] = row[i] * inv_t - logf(-logf(u));
    }
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i) best = score[i] > score[best] ? i : best;
    O[r] = best;
  }
  return {out};
}

PD_BUILD_OP(fdcore_gumbel_sample)
    .Inputs({"Logits", "Keys", "InvTemperature"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(GumbelSample));

// ---------------------------------------------------------------------------------------------
// Residual add + RMSNorm in one pass (no hand-over to numpy and back between Paddle ops):
//   hidden_out = hidden + delta          (delta may be empty: then hidden_out = hidden)
//   normed     = hidden_out * rsqrt(mean(hidden_out^2) + eps) * weight
// hidden, delta [T, E] float32; weight [E] float32.
std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& hidden, const paddle::Tensor& delta,
                                       const paddle::Tensor& weight, float eps) {
  const int64_t T = hidden.shape()[0], E = hidden.shape()[1];
  const bool add = delta.numel() > 0;
  PD_CHECK(!add || delta.numel() == T * E, "add_rms_norm: delta shape differs from hidden");
  auto sum = paddle::empty({T, E}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto normed = paddle::empty({T, E}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* __restrict__ H = hidden.data<float>();
  const float* __restrict__ DL = add ? delta.data<float>() : nullptr;
  const float* __restrict__ W = weight.data<float>();
  float* __restrict__ S = sum.data<float>();
  float* __restrict__ N = normed.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* h = H + t * E;
    float* s = S + t * E;
    if (add) {
      const float* d = DL + t * E;
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) s[e] = h[e] + d[e];
    } else {
#pragma omp simd
      for (int64_t e = 0; e < E; ++e) s[e] = h[e];
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t e = 0; e < E; ++e) squares += s[e] * s[e];
    const float scale = 1.f / std::sqrt(squares / static_cast<float>(E) + eps);
    float* n = N + t * E;
#pragma omp simd
    for (int64_t e = 0; e < E; ++e) n[e] = s[e] * scale * W[e];
  }
  return {sum, normed};
}

PD_BUILD_OP(fdcore_add_rms_norm)
    .Inputs({"Hidden", "Delta", "Weight"})
    .Outputs({"Sum", "Normed"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

// SwiGLU: out = silu(gate) * up for gate_up = [gate | up] along the last axis ([T, 2I] -> [T, I]).
std::vector<paddle::Tensor> SiluMul(const paddle::Tensor& gate_up) {
  const int64_t T = gate_up.shape()[0], I = gate_up.shape()[1] / 2;
  auto out = paddle::empty({T, I}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  const float* __restrict__ G = gate_up.data<float>();
  float* __restrict__ O = out.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* g = G + t * 2 * I;
    const float* u = g + I;
    float* o = O + t * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
  return {out};
}

PD_BUILD_OP(fdcore_silu_mul).Inputs({"GateUp"}).Outputs({"Out"}).SetKernelFn(PD_KERNEL(SiluMul));
