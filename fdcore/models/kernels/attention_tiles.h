// Attention over a bfloat16 cache on AMX tiles, up to 16 query rows at once.
// Part of attention.cc's translation unit, included by it alone (after attention_bf16.h).
#pragma once

#include "attention_bf16.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FDCORE_ATTENTION_TILES 1
// AMX tiles for a bfloat16 cache (where the bfloat16 products run on tiles: linear_bf16.cc's Bf16Tiles): up to 16
// query rows at once, the G heads of consecutive positions of one sequence that share a KV head (a decode row's G
// heads alone). Scores: 16 keys x 32 dims straight from the cache block (an A tile) against the query rows' dims in
// pairs (B), 16 keys x 16 query rows a `tdpbf16ps`, turned to a row per query; softmax per row as AttendHeadsBf16's;
// then o += p v with the weights' rows as A tiles (32 keys) and pairs of keys' values interleaved a dim at a time as
// B tiles (16 dims). A query row's arithmetic is its own, over the same 16- and 32-key chunks from key 0 whatever
// rows share its tiles: where its neighbours see more keys, its weights for them are exactly 0 (and values past the
// last key any row sees are 0), so its bits are the same in a decode step as in any prefill chunk. Taken for D of 32
// or 64, G <= 16, a block size a multiple of 16 and no sliding window (TilesTake); otherwise AttendHeadsBf16.
constexpr int kQueryTile = 16;  // query rows per tile


static bool TilesTake(int64_t G, int64_t D, int64_t BS, int64_t window) {
  return (D == 32 || D == 64) && G <= kQueryTile && BS % 16 == 0 && window == 0 && Bf16Tiles();
}


// Eight tiles of 16 rows x 64 bytes, their roles by phase. Scores: 0, 1 the scores of a 32-key step's two 16-key
// chunks (16 query rows x 16 keys where the keys are laid out; else 0 alone, 16 keys x 16 query rows), 2, 3 the
// query rows' dims 0-31 and 32-63 (loaded once a unit), 4-7 the keys (each chunk's two 32-dim halves). Weighted
// values: 0-3 o (16 query rows x 16 dims each), 4 the weights of 32 keys (16 query rows x 32 keys), 6, 7 values
// (16 pairs of keys x 16 dims).
static void ConfigureAttentionTiles() {
  const uint8_t shape[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  ConfigureTileRows(shape, 8);
}

// o's tiles 0 .. DC - 1 += the weights' tile (4: 32 keys from `weights`, rows `stride` bytes apart) times the
// values' tiles (6, 7 in turn), one 16-dim chunk each.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void WeightedValues(const uint16_t* weights, int64_t stride,
                                                                              const uint16_t* values) {
  _tile_loadd(4, weights, stride);
  _tile_loadd(6, values, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(7, values + 512, 64);
  _tile_dpbf16ps(1, 4, 7);
  if (DC == 4) {
    _tile_loadd(6, values + 1024, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, values + 1536, 64);
    _tile_dpbf16ps(3, 4, 7);
  }
}

// The values of keys l .. l + 31 as o's B tiles: per 16-dim chunk c, 16 pairs of keys x 16 dims x 2, at
// out + c * 512 (vpermt2w interleaves two keys' 16 values: word 2 i from the first, 2 i + 1 from the second);
// keys from `last` on give zeros.
template <int DC>
static inline void InterleaveValues(const uint16_t* V, int64_t kv_base, int64_t BS, const int64_t* table, int64_t l,
                                    int64_t last, uint16_t* out) {
  constexpr int64_t D = DC * 16;
  const __m512i interleave = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                               0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                               0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  for (int p = 0; p < 16; ++p) {
    const uint16_t* two[2];  // keys l + 2 p and l + 2 p + 1 (none past the last key: zeros)
    for (int e = 0; e < 2; ++e) {
      const int64_t key = l + 2 * p + e;
      two[e] = key < last ? V + (kv_base + table[key / BS] * BS + key % BS) * D : nullptr;
    }
    for (int c = 0; c < DC; ++c) {
      const __m512i a = two[0] ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(two[0] + 16 * c)))
                               : _mm512_setzero_si512();
      const __m512i b = two[1] ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(two[1] + 16 * c)))
                               : _mm512_setzero_si512();
      _mm512_store_si512(out + c * 512 + p * 32, _mm512_permutex2var_epi16(a, interleave, b));
    }
  }
}

// The keys l .. l + 15 (l a multiple of 16) as the scores' B tiles: per 32-dim chunk c, 16 pairs of dims x 16 keys
// x 2, at out + c * 512 (a 16 x 16 transpose of 32-bit pairs); keys from `last` on give zeros.
template <int DC>
static inline void TransposeKeys(const uint16_t* K, int64_t kv_base, int64_t BS, const int64_t* table, int64_t l,
                                 int64_t last, uint16_t* out) {
  constexpr int64_t D = DC * 16;
  if (l >= last) {
    std::memset(out, 0, D / 32 * 1024);
    return;
  }
  const uint16_t* keys = K + (kv_base + table[l / BS] * BS + l % BS) * D;  // 16 keys in one block (BS % 16 == 0)
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(D / 2));  // each key's first pair, in pairs
  const __mmask16 seen = Tail(last - l);
  for (int64_t c = 0; c < D / 32; ++c)
    for (int p = 0; p < 16; ++p)
      _mm512_store_si512(out + c * 512 + p * 32,
                         _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), seen, rows, keys + 32 * c + 2 * p, 4));
}

// A run's keys and values laid out once as its units' B tiles (TransposeKeys, InterleaveValues: the chunk from key
// l at kt + l D and vi + l D): a prompt's units otherwise turned the keys' scores into rows with a gather per query
// row and interleaved every value again, unit after unit.
struct RunLayout {
  const uint16_t* kt;
  const uint16_t* vi;
};

// The scores of two tiles of query rows (tiles 2, 3: the first's dims 0-31, 32-63; 4, 5: the second's) against keys
// laid out (RunLayout) 16 at a time (tiles 6, 7: their two 32-dim halves; 0, 1: the two tiles' scores), as rows of
// `score` (the second tile's from row 16), each key's chunk loaded once for both: the two tiles together load half
// the keys from L2 that they did one after the other. The same tile products as one tile's (AttendRowsTiles).
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void PairScores(uint16_t (*query_rows)[2 * 16][32],
                                                                          const uint16_t* kt, int64_t last,
                                                                          int64_t padded, float* score) {
  constexpr int64_t D = DC * 16;
  _tile_loadd(2, query_rows[0][0], 64);
  _tile_loadd(4, query_rows[0][16], 64);
  if (D == 64) {
    _tile_loadd(3, query_rows[1][0], 64);
    _tile_loadd(5, query_rows[1][16], 64);
  }
  for (int64_t l = 0; l < last; l += 16) {
    const uint16_t* keys = kt + l * D;
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(6, keys, 64);
    _tile_dpbf16ps(0, 2, 6);
    _tile_dpbf16ps(1, 4, 6);
    if (D == 64) {
      _tile_loadd(7, keys + 512, 64);
      _tile_dpbf16ps(0, 3, 7);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, score + l, padded * 4);
    _tile_stored(1, score + 16 * padded + l, padded * 4);
  }
}

// o [2][DC][16 rows x 16 dims] of two tiles of query rows: their weights (rows of `weight`, the second tile's from row
// 16; tiles 4, 5) times the values laid out (tiles 6, 7), two 16-dim chunks a pass over the keys (tiles 0, 1: the
// first tile's, 2, 3: the second's). Each o tile sums the same products in the same key order as one tile's
// (WeightedValues), so the same bits; each chunk of values is loaded once for both tiles.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static inline void PairWeightedValues(const uint16_t* weight,
                                                                                  int64_t padded, const uint16_t* vi,
                                                                                  int64_t last, float (*o)[DC][256]) {
  constexpr int64_t D = DC * 16;
  for (int c = 0; c < DC; c += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t l = 0; l < last; l += 32) {
      const uint16_t* values = vi + l * D + c * 512;
      _tile_loadd(4, weight + l, padded * 2);
      _tile_loadd(5, weight + 16 * padded + l, padded * 2);
      _tile_loadd(6, values, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, values + 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o[0][c], 64);
    _tile_stored(1, o[0][c + 1], 64);
    _tile_stored(2, o[1][c], 64);
    _tile_stored(3, o[1][c + 1], 64);
  }
}

// Rows b .. b + R - 1 (consecutive positions of one sequence, each seeing one key more) of KV head kvh: its G query
// heads each (Qr: their queries rounded to bfloat16, QueriesRounded; their outputs to O, or rounded to Or), position
// r's head g in tile r / P at row (r % P) G + g, P = per_tile positions a tile (16 / G at most); one tile, or two where
// the keys and values are laid out (PairScores, PairWeightedValues). D / 16 = DC o tiles. `run`: the keys and values
// already laid out (RunLayout), or nulls: laid out here as they are needed (scores: the keys straight from the cache as
// A tiles, the query rows' dims in pairs as B tiles, and a gather a query row turns them to rows). A row's bits are the
// same in either tile, alone or paired. Two tiles at a time: a 512-token SmolLM2 attention op (1 thread, one tile a
// task or two alternating call by call in one process) 0.89-0.94x the time, the rest of a pair's work (scores, softmax)
// as before.
template <int DC>
__attribute__((target("amx-tile,amx-bf16"))) static void AttendRowsTiles(
    const uint16_t* Qr, int64_t G, int64_t R, int64_t per_tile, const uint16_t* K, const uint16_t* V, int64_t kv_base,
    int64_t BS, const int64_t* table, int64_t L0, float* O, uint16_t* Or, int64_t row_stride, RunLayout run) {
  // (long: a unit's tiles stay configured and loaded across its scores, softmax and products)
  constexpr int64_t D = DC * 16;
  const int tiles = R > per_tile ? 2 : 1;
  const int64_t last = L0 + R - 1, padded = (last + 31) / 32 * 32;
  thread_local LineBuffer<float> scores;  // (on lines: the tiles store and load rows of 64 bytes)
  thread_local LineBuffer<uint16_t> weights;
  // rows of a tile past its query rows (query rows, weights) are left as they are: a tile row's results are its
  // own, and those rows' are never read
  float* const score = scores.Get(tiles * kQueryTile * padded);  // (thread_local: looked up once, not at every use)
  uint16_t* const weight = weights.Get(tiles * kQueryTile * padded);
  int64_t rows_of[2] = {std::min(R, per_tile) * G, (R - std::min(R, per_tile)) * G};  // query rows in each tile
  const auto source = [&](int t, int64_t i) {  // tile t's row i: its query's (and output's) place in Q (O)
    return (t * per_tile + i / G) * row_stride + (i % G) * D;
  };
  // the query rows rounded to bfloat16 as AttendHeadsBf16's q: as A tiles ([D / 32][tile rows][32 dims]) where
  // the keys are laid out, else as B tiles ([D / 32][16 pairs of dims][16 query rows][2])
  alignas(64) uint16_t queries[D / 32][16][kQueryTile][2];
  alignas(64) uint16_t query_rows[D / 32][2 * kQueryTile][32] = {};
  for (int t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < rows_of[t]; ++i) {
      const uint16_t* q = Qr + source(t, i);
      for (int64_t c = 0; c < D / 32; ++c) {
        _mm512_store_si512(query_rows[c][t * kQueryTile + i], _mm512_loadu_si512(q + 32 * c));
      }
    }
  if (!run.kt)
    for (int64_t c = 0; c < D / 32; ++c)
      for (int p = 0; p < 16; ++p)
        for (int64_t n = 0; n < rows_of[0]; ++n) {
          queries[c][p][n][0] = query_rows[c][n][2 * p];
          queries[c][p][n][1] = query_rows[c][n][2 * p + 1];
        }
  if (tiles == 2) {
    PairScores<DC>(query_rows, run.kt, last, padded, score);
  } else if (run.kt) {
    _tile_loadd(2, query_rows[0], 64);
    if (D == 64) _tile_loadd(3, query_rows[1], 64);
    for (int64_t l = 0; l < last; l += 32) {  // scores of 16 query rows x 16 keys, twice, stored as rows
      const uint16_t* keys = run.kt + l * D;  // (laid out up to `padded`: zeros past the run's last key)
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(4, keys, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(6, keys + 16 * D, 64);
      _tile_dpbf16ps(1, 2, 6);
      if (D == 64) {
        _tile_loadd(5, keys + 512, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_loadd(7, keys + 16 * D + 512, 64);
        _tile_dpbf16ps(1, 3, 7);
      }
      _tile_stored(0, score + l, padded * 4);
      _tile_stored(1, score + l + 16, padded * 4);
    }
  } else {
    alignas(64) float block[16 * kQueryTile];
    const __m512i across = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(kQueryTile));
    _tile_loadd(2, queries[0], 64);
    if (D == 64) _tile_loadd(3, queries[1], 64);
    for (int64_t l = 0; l < last; l += 16) {  // 16 keys x 16 query rows, then a column per query row
      const uint16_t* keys = K + (kv_base + table[l / BS] * BS + l % BS) * D;
      _tile_zero(0);
      _tile_loadd(4, keys, D * 2);
      _tile_dpbf16ps(0, 4, 2);
      if (D == 64) {
        _tile_loadd(5, keys + 32, D * 2);
        _tile_dpbf16ps(0, 5, 3);
      }
      _tile_stored(0, block, 64);
      for (int64_t n = 0; n < rows_of[0]; ++n)
        _mm512_storeu_ps(score + n * padded + l, _mm512_i32gather_ps(across, block + n, 4));
    }
  }
  __m512 inverse[2][kQueryTile];
  for (int t = 0; t < tiles; ++t) {
    int64_t lengths[kQueryTile];
    for (int64_t i = 0; i < rows_of[t]; ++i) lengths[i] = L0 + t * per_tile + i / G;
    float* const tile_score = score + t * kQueryTile * padded;
    uint16_t* const tile_weight = weight + t * kQueryTile * padded;
    Bf16Weights(static_cast<int>(rows_of[t]), tile_score, padded, lengths, padded, tile_weight, padded, inverse[t]);
    for (int64_t i = 0; i < rows_of[t]; ++i)  // weights of exactly 0 for the keys it does not see
      std::fill(tile_weight + i * padded + (lengths[i] + 15) / 16 * 16, tile_weight + (i + 1) * padded, uint16_t{0});
  }
  alignas(64) float o[2][DC][kQueryTile * 16];
  if (tiles == 2) {
    PairWeightedValues<DC>(weight, padded, run.vi, last, o);
  } else {
    _tile_zero(0);  // (tile numbers are immediates: no loop)
    _tile_zero(1);
    if (DC == 4) {
      _tile_zero(2);
      _tile_zero(3);
    }
    alignas(64) uint16_t values[DC * 512];
    for (int64_t l = 0; l < last; l += 32) {
      const uint16_t* chunk = run.vi ? run.vi + l * D : values;
      if (!run.vi) InterleaveValues<DC>(V, kv_base, BS, table, l, last, values);
      WeightedValues<DC>(weight + l, padded * 2, chunk);
    }
    _tile_stored(0, o[0][0], 64);
    _tile_stored(1, o[0][1], 64);
    if (DC == 4) {
      _tile_stored(2, o[0][2], 64);
      _tile_stored(3, o[0][3], 64);
    }
  }
  for (int t = 0; t < tiles; ++t)
    for (int64_t i = 0; i < rows_of[t]; ++i) {
      const int64_t at = source(t, i);
      for (int c = 0; c < DC; ++c) {
        const __m512 value = _mm512_mul_ps(_mm512_loadu_ps(o[t][c] + i * 16), inverse[t][i]);
        if (Or) {
          _mm512_mask_cvtepi32_storeu_epi16(Or + at + 16 * c, 0xffff, Bf16Bits(value));
        } else {
          _mm512_storeu_ps(O + at + 16 * c, value);
        }
      }
    }
}
#endif
