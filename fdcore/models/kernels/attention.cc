// fdcore's Paddle operators. Attention over a paged KV cache reads each block in place (no gather):
//
// q        [B, H, D]          float32, already scaled by 1/sqrt(D)
// k_cache  [KVH, NB, D, BS]   float32, each block's keys transposed (see ScoreRuns), or bfloat16
//          [KVH, NB, BS, D]   (see AttendHeadsBf16) (the worker's cache of one layer, shared with numpy)
// v_cache  [KVH, NB, BS, D]   float32, or bfloat16
// tables   [B, W]             int64, block ids of each row's sequence (padded)
// lengths  [B]                int64, keys each row attends to (its position + 1)
// out      [B, H, D]          float32
//
// Grouped-query attention: head h reads KV head h / (H / KVH). Softmax in float32
// with the running maximum subtracted, as the reference does.
//
// The variants (attention_avx512.h, attention_bf16.h, attention_tiles.h, attention_avx2.h, and the scalar path
// here) are one translation unit: the dispatch below inlines them as it always has.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_bf16.h"
#include "attention_keys.h"
#include "attention_tiles.h"
#include "bf16_bits.h"
#include "kernels.h"
#include "line_buffer.h"
#include "paddle/extension.h"

#if !defined(__AVX512F__)
// One (row, KV head)'s attention, one value at a time: for head sizes the vector paths do not take.
static void AttendScalar(const float* qg, int64_t G, int64_t D, const float* K, const float* V, int64_t kv_base,
                         int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
  ForEachKeyRun(K, kv_base, BS, D, table, first, L, BS, [&](int64_t l, const float* kt, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < G; ++g) {
        float s = 0.f;  // ScoreRuns' chain
        for (int64_t d = 0; d < D; ++d) s = std::fma(qg[g * D + d], kt[d * BS + i], s);
        scores[g * L + l + i] = s;
      }
  });
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * L;
    float top = row[0];
    for (int64_t l = 1; l < L; ++l) top = row[l] > top ? row[l] : top;
    float total = 0.f;
    for (int64_t l = 0; l < L; ++l) {
      row[l] = expf(row[l] - top);
      total += row[l];
    }
    const float inv = 1.f / total;
    for (int64_t l = 0; l < L; ++l) row[l] *= inv;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = 0.f;
  }
  for (int64_t l = 0; l < L; ++l) {
    const int64_t key = first + l;
    const float* __restrict__ vr = V + (kv_base + table[key / BS] * BS + key % BS) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + l];
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p * vr[d];
    }
  }
}
#endif

// One row's attention for the G query heads sharing one KV head (kv_base: its first cache row), on the
// widest path this build has; in passes of up to kMostHeads heads (the same passes for every row of a
// model, so a row's bits do not depend on its batch).
static void AttendTask(const float* qg, int64_t G, int64_t D, const float* K, const float* V, int64_t kv_base,
                       int64_t BS, const int64_t* table, int64_t first, int64_t L, float* scores, float* out) {
#if defined(__AVX512F__)
  AttendOne(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#elif defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t g = 0; g < G;) {
      const int heads = static_cast<int>(std::min<int64_t>(kMostHeads, G - g));
      Attend8For(D, heads)(qg + g * D, D, K, V, kv_base, BS, table, first, L, scores, out + g * D);
      g += heads;
    }
    return;
  }
  AttendScalar(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#else
  AttendScalar(qg, G, D, K, V, kv_base, BS, table, first, L, scores, out);
#endif
}

#if defined(FDCORE_ATTENTION_TILES)
// AttendRows where the tiles take it (TilesTake). A unit: up to 16 / G consecutive rows of one sequence (Pairable,
// chained), its tiles' query rows their heads; a run: a sequence's consecutive rows (a prompt's), whose keys and
// values are laid out once for all its units where it has more than one (RunLayout). The same bits either way.
static void AttendRowsInTiles(const uint16_t* Qr, int64_t B, int64_t H, int64_t D, const uint16_t* K, const uint16_t* V,
                              int64_t KVH, int64_t NB, int64_t BS, const int64_t* T, int64_t W, const int64_t* LEN,
                              int64_t window, bool parallel, float* O, uint16_t* Or) {
  // (long: the tile units' loop over one sequence's rows, its runs and their output rows share every local)
  const int64_t G = H / KVH;
  std::vector<int64_t> units, unit_run;  // each unit's first row (then B), and its run's place in laid_out (or -1)
  struct Run {
    // offset: of its layouts in `layout` (a KV head's: keys, then values, padded_keys(keys) D words each)
    int64_t last_row, keys, offset;
  };
  std::vector<Run> laid_out;
  const auto padded_keys = [](int64_t keys) { return (keys + 31) / 32 * 32; };  // whole 32-key chunks
  int64_t words = 0;
  for (int64_t b = 0; b < B;) {
    int64_t end = b + 1;
    while (end < B && Pairable(end - 1, BS, T, W, LEN, window)) ++end;
    const int64_t per_unit = kQueryTile / G, run_units = (end - b + per_unit - 1) / per_unit;
    // a laid-out run's units go two tiles at a time (AttendRowsTiles: the keys and values loaded once for both)
    const int64_t step = run_units > 1 ? 2 * per_unit : per_unit;
    for (int64_t first = b; first < end; first += step) {
      units.push_back(first);
      unit_run.push_back(run_units > 1 ? static_cast<int64_t>(laid_out.size()) : -1);
    }
    if (run_units > 1) {
      laid_out.push_back({end - 1, LEN[end - 1], words});
      words += KVH * 2 * padded_keys(LEN[end - 1]) * D;  // (the run's last row sees the most keys)
    }
    b = end;
  }
  units.push_back(B);
  // (the calling thread's, across layers; on lines, as the laying out stores)
  thread_local LineBuffer<uint16_t> memory;
  uint16_t* const layout = memory.Get(words);
  const auto keys_laid_out = [&](const Run& r, int64_t kvh) {  // (its values follow, padded_keys(r.keys) D words on)
    return layout + r.offset + kvh * 2 * padded_keys(r.keys) * D;
  };
  std::vector<int64_t> chunks{0};  // laying out: 32-key chunks of each run's KV heads, prefix sums
  for (const Run& r : laid_out) chunks.push_back(chunks.back() + KVH * padded_keys(r.keys) / 32);
  const int64_t unit_tasks = static_cast<int64_t>(units.size() - 1) * KVH;
  const auto attend = D == 64 ? AttendRowsTiles<4> : AttendRowsTiles<2>;
  const auto keys_of = D == 64 ? TransposeKeys<4> : TransposeKeys<2>;
  const auto values_of = D == 64 ? InterleaveValues<4> : InterleaveValues<2>;
#pragma omp parallel if (parallel)
  {
    ConfigureAttentionTiles();  // each thread's own
#pragma omp for schedule(static)
    for (int64_t chunk = 0; chunk < chunks.back(); ++chunk) {
      const int64_t r = std::upper_bound(chunks.begin(), chunks.end(), chunk) - chunks.begin() - 1;
      const Run& run = laid_out[r];
      const int64_t padded = padded_keys(run.keys), kvh = (chunk - chunks[r]) / (padded / 32);
      const int64_t l = (chunk - chunks[r]) % (padded / 32) * 32;
      uint16_t* kt = keys_laid_out(run, kvh);
      const int64_t* table = T + run.last_row * W;
      keys_of(K, kvh * NB * BS, BS, table, l, run.keys, kt + l * D);
      keys_of(K, kvh * NB * BS, BS, table, l + 16, run.keys, kt + (l + 16) * D);
      values_of(V, kvh * NB * BS, BS, table, l, run.keys, kt + padded * D + l * D);
    }
    // Taken as the threads come free, the last rows' (the costliest: they see the most keys) first: interleaved
    // static shares left one of 2 threads 20 % more tile cycles than the other at times, by turns (a shared host's
    // cores do not run at one speed), and it waited out the difference. In one process, the two schedules
    // alternating call by call (2 threads, the 512-token SmolLM2 attention op): 0.98-1.00x the time on a quiet host,
    // 0.90x on a busy one. A task is computed whole by one thread: the same bits.
#pragma omp for schedule(dynamic, 1)
    for (int64_t from_last = 0; from_last < unit_tasks; ++from_last) {
      const int64_t task = unit_tasks - 1 - from_last;
      const int64_t u = task / KVH, kvh = task % KVH, head = kvh * G, b = units[u], R = units[u + 1] - b;
      RunLayout run{nullptr, nullptr};
      if (unit_run[u] >= 0) {
        const Run& r = laid_out[unit_run[u]];
        run.kt = keys_laid_out(r, kvh);
        run.vi = run.kt + padded_keys(r.keys) * D;
      }
      // the last row's table: every row's blocks are its (Pairable)
      attend(Qr + (b * H + head) * D, G, R, kQueryTile / G, K, V, head / G * NB * BS, BS, T + (b + R - 1) * W, LEN[b],
             O + (b * H + head) * D, Or ? Or + (b * H + head) * D : nullptr, H * D, run);
    }
    _tile_release();
  }
}
#endif

// Whether the rows of an attention call go through the tiles (AttendRowsInTiles): a bfloat16 cache where TilesTake.
static bool AttentionTiles(bool bf16, int64_t G, int64_t D, int64_t BS, int64_t window) {
#if defined(FDCORE_ATTENTION_TILES)
  return bf16 && TilesTake(G, D, BS, window);
#else
  return false;
#endif
}

// A head's D (a multiple of 32) rotated queries q rounded to bfloat16 as the tiles take them (vcvtne2ps2bf16, 32 at a
// time), once a row where every (row, KV head) task rounded its rows' (and read twice the bytes).
static void QueriesRounded(const float* q, int64_t D, uint16_t* r) {
#if defined(FDCORE_ATTENTION_TILES)
  for (int64_t c = 0; c < D; c += 32)
    _mm512_storeu_si512(r + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + c + 16), _mm512_loadu_ps(q + c)));
#else
  PD_CHECK(false, "attention: queries rounded for tiles in a build without them");
#endif
}

// Whether rows of G query heads a KV head, head_dim D, over a bfloat16 cache of BS-token blocks (window: sliding, 0
// none) go through the tiles in this process, which can hand the o product its rows rounded (AttendRows' Or): for
// what measures the step's products alone (benchmarks/bench_model.py's floor takes o's input as the step does).
extern "C" int fdcore_attention_rounds_rows(int64_t G, int64_t D, int64_t BS, int64_t window) {
  return AttentionTiles(true, G, D, BS, window) ? 1 : 0;
}

// The attention of B rows over their own prefixes in the paged cache (the shared core of the ops).
// window > 0: a row at position p sees only keys p - window + 1 .. p (sliding-window attention).
// Rows and KV heads are shared out over OpenMP's threads; each (row, KV head) is computed whole by
// one thread, so the result does not depend on the thread count.
// K and V: float32, or bfloat16 bits where `bf16` (AttendHeadsBf16).
// Where the tiles take the rows (AttentionTiles), their queries are Qr's, rounded to bfloat16 (QueriesRounded), and
// where Or is not null O's rows are written there instead, rounded to bfloat16 (Bf16Bits: the bits a bfloat16
// product's RoundRows would give them); returns whether they were.
static bool AttendRows(const float* Q, const uint16_t* Qr, int64_t B, int64_t H, int64_t D, const void* K,
                       const void* V, bool bf16, int64_t KVH, int64_t NB, int64_t BS, const int64_t* T, int64_t W,
                       const int64_t* LEN, int64_t window, float* O, uint16_t* Or) {
  // (long: the dispatch of every (row, KV head) task to the widest path that takes it, in one pass)
  const int64_t G = H / KVH;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t end = LEN[b];
    PD_CHECK(end >= 1 && end <= W * BS, "attention: length out of range of the block table");
    const int64_t first = FirstKey(end, window);
    for (int64_t i = first / BS; i < (end + BS - 1) / BS; ++i) {
      PD_CHECK(T[b * W + i] >= 0 && T[b * W + i] < NB, "attention: block id out of range");
    }
    work += end - first;
  }
  PD_CHECK(D <= 256, "attention: head_dim above 256");
  // A task is a row's heads of one KV head (their keys loaded once for all), or, when there are too few
  // of those to keep the threads busy (a decode step of one sequence: SmolLM2's 3 KV heads on 2 threads
  // left one idle a third of the time), a row's single query head. A head's arithmetic is the same
  // either way (AttendHeads), so the split changes no bits.
  const int64_t heads = B * KVH >= kFewestTasks ? G : 1, tasks = B * H / heads;
  const bool parallel = work * H * D >= (1 << 16);
#if defined(FDCORE_ATTENTION_PAIRS)
  // A prompt's consecutive rows go in pairs where they can (Pairable; the float32 cache, a task of a KV head's
  // heads): a unit is a row or a pair, a task a unit's heads of one KV head. The same bits either way.
  if (!bf16 && heads == G && D <= 64) {
    std::vector<int64_t> units;  // each unit's first row, then B: unit u is rows units[u] .. units[u + 1] - 1
    for (int64_t b = 0; b < B; b += 1 + (b + 1 < B && Pairable(b, BS, T, W, LEN, window))) units.push_back(b);
    units.push_back(B);
    if (units.size() <= static_cast<size_t>(B)) {  // (a pair among them)
      const int64_t unit_tasks = static_cast<int64_t>(units.size() - 1) * KVH;
#pragma omp parallel for schedule(static, 1) if (parallel)  // interleaved, as below
      for (int64_t task = 0; task < unit_tasks; ++task) {
        const int64_t u = task / KVH, head = task % KVH * G, b = units[u], L = LEN[b] - FirstKey(LEN[b], window);
        const float* K0 = static_cast<const float*>(K);
        const float* V0 = static_cast<const float*>(V);
        thread_local LineBuffer<float> scores;
        float* const score = scores.Get(2 * kMostHeads * (L + 1));
        if (units[u + 1] - b == 1) {
          AttendTask(Q + (b * H + head) * D, G, D, K0, V0, head / G * NB * BS, BS, T + b * W, LEN[b] - L, L,
                     score, O + (b * H + head) * D);
          continue;
        }
        AttendPair(Q + (b * H + head) * D, Q + ((b + 1) * H + head) * D, G, D, K0, V0, head / G * NB * BS, BS, T + b * W,
                   L, score, score + kMostHeads * L, O + (b * H + head) * D, O + ((b + 1) * H + head) * D);
      }
      return false;
    }
  }
#endif
#if defined(FDCORE_ATTENTION_TILES)
  if (AttentionTiles(bf16, G, D, BS, window)) {
    PD_CHECK(Qr, "attention: the tiles take the queries rounded");
    AttendRowsInTiles(Qr, B, H, D, static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V), KVH, NB, BS, T, W,
                      LEN, window, parallel, O, Or);
    return Or != nullptr;
  }
#endif
#pragma omp parallel for schedule(static, 1) if (parallel)  // interleaved: a prompt's later rows see more keys (contiguous shares gave one thread 3/4 of the work)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t b = task * heads / H, head = task * heads % H, end = LEN[b];
    const int64_t first = FirstKey(end, window);
    thread_local LineBuffer<float> scores;
    float* const score = scores.Get(std::max<int64_t>(heads, kMostHeads) * (end - first));
#if defined(FDCORE_ATTENTION_BF16)
    if (bf16) {
      thread_local LineBuffer<uint16_t> weights;
      AttendOneBf16(Q + (b * H + head) * D, heads, D, static_cast<const uint16_t*>(K), static_cast<const uint16_t*>(V),
                    head / G * NB * BS, BS, T + b * W, first, end - first, score,
                    weights.Get(std::max<int64_t>(heads, kMostHeads) * (end - first + 1)), O + (b * H + head) * D);
      continue;
    }
#endif
    AttendTask(Q + (b * H + head) * D, heads, D, static_cast<const float*>(K), static_cast<const float*>(V),
               head / G * NB * BS, BS, T + b * W, first, end - first, score, O + (b * H + head) * D);
  }
  return false;
}

// Everything between the QKV projection and the output projection, for every row at once:
// Qwen3's per-head RMSNorm of q and k (q_norm / k_norm [D], or empty tensors: none), rotary
// embedding (HF's rotate-half, with cos / sin [T, D/2] computed by the caller, any scaling folded
// in), q scaled, k and v written into the paged cache at each row's slot, then attention over each
// row's prefix (its last `window` keys when window > 0).
// qkv [T, (H + 2 KVH) D]; slots [T] int64 (block * BS + offset); out [T, H D]. Into the caller's memory
// (decoder_layers' workspace, or the op's outputs): Qo [T, H D] (the rotated, scaled queries; where the tiles take the
// rows, rounded to bfloat16 in its memory: QueriesRounded) and O, or, where Or is
// not null and the rows go through the tiles (AttendRows), O's rows rounded to bfloat16 in Or [T, H D] (a bfloat16 o
// product's rounded X: its float32 rows never go to memory); returns whether they did.
bool AttentionBlockInto(const float* X, int64_t Tn, int64_t width, const paddle::Tensor& cos, const paddle::Tensor& sin,
                        const paddle::Tensor& slots, const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                        const paddle::Tensor& tables, const paddle::Tensor& lengths, const paddle::Tensor& q_norm,
                        const paddle::Tensor& k_norm, int64_t num_heads, float scale, int64_t window, float norm_eps,
                        float* Qo, float* O, uint16_t* Or) {
  // (long: rotary, the cache write and attention of a layer, over one set of row pointers)
  const auto vs = v_cache.shape();
  const int64_t KVH = vs[0], NB = vs[1], BS = vs[2], D = vs[3], H = num_heads, half = D / 2;
  PD_CHECK(width == (H + 2 * KVH) * D, "attention_block: qkv width does not match the heads");
  const float* C = cos.data<float>();
  const float* S = sin.data<float>();
  const int64_t* SLOT = slots.data<int64_t>();
  const bool bf16 = k_cache.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(v_cache.dtype() == k_cache.dtype() && (bf16 || k_cache.dtype() == paddle::DataType::FLOAT32),
           "attention_block: the caches must be both float32 or both bfloat16");
  const std::vector<int64_t> k_shape = bf16 ? vs : std::vector<int64_t>{KVH, NB, D, BS};  // float32: transposed blocks
  PD_CHECK(H % KVH == 0 && k_cache.shape() == k_shape, "attention_block: cache shapes do not match");
  PD_CHECK(D <= 256, "attention: head_dim above 256");
#if defined(FDCORE_ATTENTION_BF16)
  PD_CHECK(!bf16 || D % 32 == 0, "attention_block: a bfloat16 cache needs head_dim a multiple of 32");
#else
  PD_CHECK(!bf16, "attention_block: a bfloat16 cache needs a build for AVX512-BF16");
#endif
  // the cache is written in place: a row of D values at `slot` of KV head j (rounded to bfloat16 where it is), or
  // for a float32 cache's keys a column of their block (values BS apart: ForEachKeyRun's layout)
  void* Kc = const_cast<void*>(k_cache.data());
  void* Vc = const_cast<void*>(v_cache.data());
  auto store = [&](void* cache, int64_t j, int64_t slot, const float* values, bool transposed) {
    const int64_t at = (j * NB * BS + slot) * D;
    if (bf16) {
      RoundToBf16(values, D, static_cast<uint16_t*>(cache) + at);
    } else if (transposed) {
      float* column = static_cast<float*>(cache) + (j * NB * BS + slot - slot % BS) * D + slot % BS;
      for (int64_t d = 0; d < D; ++d) column[d * BS] = values[d];
    } else {
      std::memcpy(static_cast<float*>(cache) + at, values, D * sizeof(float));
    }
  };
  const bool normed = q_norm.numel() > 0;
  PD_CHECK(!normed || (q_norm.numel() == D && k_norm.numel() == D), "attention_block: q/k norm width != D");
  const float* QN = normed ? q_norm.data<float>() : nullptr;
  const float* KN = normed ? k_norm.data<float>() : nullptr;
  for (int64_t t = 0; t < Tn; ++t) PD_CHECK(SLOT[t] >= 0 && SLOT[t] < NB * BS, "attention_block: slot out of range");
  // Rows alone (each its own slots of the cache): shared out, the same bits. A 512-token SmolLM2 prefill spent
  // ~1 % of its time here on one thread while the others waited.
  // where the tiles take the rows, the queries go to them rounded (QueriesRounded), in Qo's memory
  uint16_t* const Qr = AttentionTiles(bf16, H / KVH, D, BS, window) ? reinterpret_cast<uint16_t*>(Qo) : nullptr;
#pragma omp parallel for schedule(static) if (RowsWorthSharing(Tn, width))
  for (int64_t t = 0; t < Tn; ++t) {
    float head[256], key[256], query[256];
    const float* row = X + t * (H + 2 * KVH) * D;
    const float* c = C + t * half;
    const float* s = S + t * half;
    for (int64_t h = 0; h < H + KVH; ++h) {  // query heads, then key heads, rotated
      const float* x = row + h * D;
      if (normed) {  // HF's RMSNorm over the head: x * rsqrt(mean(x^2) + eps) * weight
        float squares = 0.f;
        for (int64_t i = 0; i < D; ++i) squares += x[i] * x[i];
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(D) + norm_eps);
        const float* w = h < H ? QN : KN;
        for (int64_t i = 0; i < D; ++i) head[i] = x[i] * inv * w[i];
        x = head;
      }
      float* dst = h >= H ? key : Qr ? query : Qo + (t * H + h) * D;
      const float mul = h < H ? scale : 1.f;
      for (int64_t i = 0; i < half; ++i) {
        const float a = x[i] * c[i] - x[i + half] * s[i];
        const float b = x[i + half] * c[i] + x[i] * s[i];
        dst[i] = h < H ? a * mul : a;
        dst[i + half] = h < H ? b * mul : b;
      }
      if (h >= H) store(Kc, h - H, SLOT[t], key, true);
      if (h < H && Qr) QueriesRounded(query, D, Qr + (t * H + h) * D);
    }
    for (int64_t j = 0; j < KVH; ++j) store(Vc, j, SLOT[t], row + (H + KVH + j) * D, false);  // values, as they are
  }
  return AttendRows(Qo, Qr, Tn, H, D, Kc, Vc, bf16, KVH, NB, BS, tables.data<int64_t>(), tables.shape()[1],
             lengths.data<int64_t>(), window, O, Or);
}

std::vector<paddle::Tensor> AttentionBlock(const paddle::Tensor& qkv, const paddle::Tensor& cos,
                                           const paddle::Tensor& sin, const paddle::Tensor& slots,
                                           const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                                           const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                           const paddle::Tensor& q_norm, const paddle::Tensor& k_norm,
                                           int64_t num_heads, float scale, int64_t window, float norm_eps) {
  const int64_t Tn = qkv.shape()[0], D = v_cache.shape()[3];
  auto q = paddle::empty({Tn, num_heads, D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  auto out = paddle::empty({Tn, num_heads * D}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  AttentionBlockInto(qkv.data<float>(), Tn, qkv.shape()[1], cos, sin, slots, k_cache, v_cache, tables, lengths, q_norm,
                     k_norm, num_heads, scale, window, norm_eps, q.data<float>(), out.data<float>(), nullptr);
  return {out};
}

PD_BUILD_OP(fdcore_attention_block)
    .Inputs({"QKV", "Cos", "Sin", "Slots", "KCache", "VCache", "Tables", "Lengths", "QNorm", "KNorm"})
    .Outputs({"Out"})
    .Attrs({"num_heads: int64_t", "scale: float", "window: int64_t", "norm_eps: float"})
    .SetKernelFn(PD_KERNEL(AttentionBlock));
