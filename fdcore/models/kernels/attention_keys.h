// How the attention kernels walk a row's keys and values in the paged cache (attention.cc and its variants).
#pragma once

#include <cstdint>

constexpr int kMostHeads = 4;     // query heads per pass over a row's keys (AVX-512: 1 past D = 128)
constexpr int64_t kFewestTasks = 8;  // (row, KV head) pairs below which attention is shared out by query head

// Visits a row's keys (or values) in runs of consecutive rows of one block, in order: visit(l, rows, run) for
// keys l .. l + run - 1 (l from 0) at rows, rows + D, ... (a division per block, not per key: BS is not a
// compile-time constant). (Prefetching the next block's rows measured no gain on SmolLM2's batch-1 decode,
// where a layer's cache comes from memory.)
template <typename T, typename Visit>
static inline void ForEachRun(const T* base, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                              int64_t first, int64_t L, Visit&& visit) {
  for (int64_t key = first, l = 0; key < first + L;) {
    const int64_t offset = key % BS, run = std::min(BS - offset, first + L - key);
    visit(l, base + (kv_base + table[key / BS] * BS + offset) * D, run);
    key += run, l += run;
  }
}

// The first key a row ending at `end` sees: window > 0 keeps its last `window` keys.
static inline int64_t FirstKey(int64_t end, int64_t window) { return (window > 0 && end > window) ? end - window : 0; }

// A run of consecutive keys of one transposed block (ForEachKeyRun): keys l .. l + n - 1, value d of key l + i
// at kt[d * BS + i].
struct KeyRun {
  int64_t l;
  const float* kt;
  int64_t n;
};

// Visits a row's keys in a float32 cache's transposed blocks ([D, BS] a block: a key's values BS apart) in runs of
// at most `width` consecutive keys of one block, in order: visit(l, kt, n) for keys l .. l + n - 1, key l + i's
// value d at kt[d * BS + i].
template <typename Visit>
static inline void ForEachKeyRun(const float* K, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                                 int64_t first, int64_t L, int64_t width, Visit&& visit) {
  for (int64_t key = first, l = 0; key < first + L;) {
    const int64_t offset = key % BS, n = std::min({BS - offset, first + L - key, width});
    visit(l, K + (kv_base + table[key / BS] * BS) * D + offset, n);
    key += n, l += n;
  }
}

// Visits a row's keys (or values) one by one, in order: visit(l, row) for key l (from 0).
template <typename T, typename Visit>
static inline void ForEachKey(const T* base, int64_t kv_base, int64_t BS, int64_t D, const int64_t* table,
                              int64_t first, int64_t L, Visit&& visit) {
  ForEachRun(base, kv_base, BS, D, table, first, L, [&](int64_t l, const T* rows, int64_t run) {
    for (int64_t j = 0; j < run; ++j) visit(l + j, rows + j * D);
  });
}

// NOTE: the weighted sums of values (o += p v) accumulate each run of keys in an array local to the run's visit,
// copied from and back to the row's: GCC (12) kept an accumulator array captured by reference in memory and
// stored all of it after every key (12 zmm stores a key at SmolLM2's 3 heads x 64 dims), and SmolLM2's 512-token
// prefill attention took 1.6-1.75x the time it takes now (one thread of a Zen 4 EPYC). The same sums in the
// same order: the same bits.
