// fdcore's bfloat16-weight linear layer: Y[M, N] = X[M, K] . W[N, K]^T with W in bfloat16, X and Y in
// float32, float32 accumulation, on CPUs with AVX512-BF16 (`vdpbf16ps`).
//
// Why: decoding one token reads every weight once, so its speed is the memory's, and bfloat16 weights
// are half the bytes of float32; in batches, `vdpbf16ps` does two products per float32 lane and
// instruction. Paddle's CPU build has no bfloat16 matmul.
//
// NOTE: the weight is packed once, at load (fdcore.models.matrices.Bf16Matrix), in groups of 32 output
// rows: packed[g][kp][b][lane][e] = W[32 g + 16 b + lane][2 kp + e] (rows padded to a multiple of 32,
// the inner dimension to an even count, with zeros). One 64-byte load then holds 16 output rows x 2
// inputs, exactly what `vdpbf16ps` multiplies against a broadcast pair of X values: the accumulators
// are the outputs themselves (no horizontal sums), and each group is one contiguous stream of memory
// (what the hardware prefetcher follows best). X is rounded to bfloat16 once per call. Groups of 32
// rather than 64: SmolLM2's 576-row projections are then 18 groups, 9 a thread on 2 threads, where 9
// groups of 64 left one thread a fifth more to stream than the other.
//
// Every output is one chain of `vdpbf16ps` over the pairs of K in order, whatever the pass (8 rows, 4 or
// 1): a row's bits are the same alone as in any batch, as float32's and wint8's are, which is what a
// crash's recompute in other batches wants. One chain per output, not several summed at the end: it was
// the fastest of 1, 2, 4 and 8 on a Zen 4 EPYC (DESIGN.md, "bfloat16 weights").
//
// An MLP's gate and up projections are packed gated (fdcore.models.matrices.Bf16Matrix.pack_gated: a group's two
// 16-row blocks are the gate's and the up projection's same 16 rows) and multiplied with their SwiGLU as the
// product's epilogue (SwiGluOut): a 512-token SmolLM2 bfloat16 prefill, step / GEMM floor 1.26-1.39x -> 1.22-1.28x
// (1 thread, alternating processes, 3 rounds each), where the [M, 2 I] product went through L3 and a pass of its own.
//
// A bfloat16 model's norms and SwiGLU hand their products the rows already rounded (LinearBf16RoundedInto,
// LinearBf16SwiGluRoundedInto, and rms_norm.cc's AddRmsNormBf16Into; kernels/decoder.cc): the float32 rows
// never go to memory to be read back and rounded, the SwiGLU's activations are half the bytes, and the bits are
// those of rounding here (the same RoundToBf16). A 512-token SmolLM2 prefill against the same float32-input product
// floor (1 thread, alternating processes, 4 rounds): 1.12-1.41x -> 0.90-1.07x; 2 threads 1.09-1.13x -> 1.00-1.06x.
//
// The caller checks the CPU's flags (/proc/cpuinfo) before using this; the function carries its own
// target attribute, so the library builds on any x86-64 compiler and CPU.
#include <immintrin.h>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "exp2_bf16.h"
#include "kernels.h"
#include "line_buffer.h"
#include "paddle/extension.h"

// The lanes of a 16-lane chunk from `first` that are before `end` (first < end).
static inline __mmask16 LanesBefore(int64_t first, int64_t end) {
  return first + 16 <= end ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (end - first)) - 1);
}

// n float32 values -> bfloat16 bits (Bf16Bits). Shared with attention.cc and rms_norm.cc, whose bfloat16 KV cache and norms'
// bfloat16 rows are written with it (hidden: a direct call within the library); like every function here, run only
// where the CPU has AVX512-BF16.
__attribute__((visibility("hidden"))) FDCORE_BF16_TARGET void RoundToBf16(const float* x, int64_t n, uint16_t* r) {
  for (int64_t k = 0; k < n; k += 16) {
    const __mmask16 lanes = LanesBefore(k, n);
    _mm512_mask_cvtepi32_storeu_epi16(r + k, lanes, Bf16Bits(_mm512_maskz_loadu_ps(lanes, x + k)));
  }
}

// A product's rounded X, the layout every producer of bfloat16 rows writes (RoundRows here, AddRmsNormBf16Into, the
// tile attention's output, the SwiGLU's epilogue; decoder.cc sizes its buffers by it): Bf16RowsPadded(M) rows of
// Bf16RowWidth(K) values, K's rounded (RoundRow), then a zero for an odd K (the pairs of K the kernels read whole).
// Rows: M, or for more than a tile's rows, whole tiles of 16 (the AMX path multiplies whole tiles; the padding rows
// must be zeros or at least finite, and their outputs are dropped).
__attribute__((visibility("hidden"))) int64_t Bf16RowsPadded(int64_t M) { return M <= 16 ? M : (M + 15) / 16 * 16; }
__attribute__((visibility("hidden"))) int64_t Bf16RowWidth(int64_t K) { return (K + 1) / 2 * 2; }

// One row of K float32 values into its rounded row r (Bf16RowWidth(K) values).
FDCORE_BF16_TARGET static void RoundRow(const float* x, int64_t K, uint16_t* r) {
  RoundToBf16(x, K, r);
  if (K % 2) r[K] = 0;
}

// Whether the bfloat16 kernel runs on AMX tiles where the CPU has them (default on): a setting for measuring
// and testing one path against the other, read at each call.
static int fdcore_bf16_tiles_wanted = 1;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Linux hands out AMX's tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without it the first tile instruction dies of SIGILL. Asked once per process.
static bool AmxPermitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether bfloat16 products run on tiles in this process: wanted (the setting) and granted by the OS. Shared with
// attention_tiles.h, whose bfloat16 cache is read on tiles where the products are.
__attribute__((visibility("hidden"))) bool Bf16Tiles() { return fdcore_bf16_tiles_wanted && AmxPermitted(); }

// Configures this thread's tiles 0 .. count - 1 (palette 1), tile t `rows[t]` rows of 64 bytes: the one place the
// tile configuration's layout is written (shared with attention_tiles.h).
__attribute__((visibility("hidden"))) void ConfigureTileRows(const uint8_t* rows, int count) {
  struct {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < count; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = rows[t];
  }
  // GCC's _tile_loadconfig names only the config's first 8 bytes as its operand: without this barrier the other
  // 56 may be left unwritten as dead stores (a constant-count copy of this function died of SIGSEGV at -O2)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
#endif

namespace {

constexpr int kGroup = 32;            // output rows per packed group
constexpr int kBlocks = kGroup / 16;  // 16-lane blocks per group

// Stores one 16-lane block of outputs (fewer lanes past the last real output row).
FDCORE_BF16_TARGET inline void StoreBlock(float* y, int64_t first, int64_t N, __m512 value) {
  if (first + 16 <= N) {
    _mm512_storeu_ps(y + first, value);
  } else if (first < N) {
    _mm512_mask_storeu_ps(y + first, LanesBefore(first, N), value);
  }
}

// ... added to the same block of r's row first (r + value: one float add an element, as AddRmsNorm's h + delta).
FDCORE_BF16_TARGET inline void StoreSumBlock(float* y, const float* r, int64_t first, int64_t N, __m512 value) {
  if (first < N) {
    const __mmask16 lanes = LanesBefore(first, N);
    _mm512_mask_storeu_ps(y + first, lanes, _mm512_add_ps(_mm512_maskz_loadu_ps(lanes, r + first), value));
  }
}

// silu(g) u = g u / (1 + 2^(-g log2 e)) for 16 lanes: the exponential to bfloat16's precision (Exp2ForBf16: these
// outputs are rounded to bfloat16 as the down projection's input), 1 / (1 + e) by vrcp14ps and a Newton step (within
// 2^-27 relative; vdivps has a tenth of the throughput). Past -g log2 e = 100 (g < -69.3, where g e^g is below 7e-29)
// the result is 0: e is capped there, as an infinite e would make the Newton step 0 x infinity. A NaN gate stays NaN.
FDCORE_BF16_TARGET inline __m512 SiluTimes(__m512 g, __m512 u) {
  const __m512 exponent = _mm512_mul_ps(g, _mm512_set1_ps(-kLog2E));
  const __mmask16 kept = _mm512_cmp_ps_mask(exponent, _mm512_set1_ps(100.f), _CMP_NGE_UQ);  // (NaN: kept)
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), Exp2ForBf16(_mm512_min_ps(exponent, _mm512_set1_ps(100.f))));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  return _mm512_maskz_mul_ps(kept, _mm512_mul_ps(g, r), u);
}

// What becomes of a group's two 16-output blocks of one row of X: `out(m, g, first, second)`.
// Plain: both stored as they are, Y [M, N] (N: the real output rows, fewer than the groups hold past the last), or
// where there are residual rows R [M, N], R + the product (a decoder's residual stream and the o or down product
// that adds to it, summed as the norm that reads them would: the product never goes to memory as a row of its own).
struct PlainOut {
  float* Y;
  int64_t N;
  const float* R;
  FDCORE_BF16_TARGET void operator()(int64_t m, int64_t g, __m512 first, __m512 second) const {
    if (R) {
      StoreSumBlock(Y + m * N, R + m * N, g * kGroup, N, first);
      StoreSumBlock(Y + m * N, R + m * N, g * kGroup + 16, N, second);
      return;
    }
    StoreBlock(Y + m * N, g * kGroup, N, first);
    StoreBlock(Y + m * N, g * kGroup + 16, N, second);
  }
};

// SwiGLU: a gated matrix's group g holds the gate's rows 16 g .. 16 g + 15, then the up projection's same rows
// (fdcore.models.matrices.Bf16Matrix.pack_gated); one block silu(gate + its bias) (up + its bias) is stored, row m of Y
// at Y + m stride: float32 [M, I] (stride I), or bfloat16 bits (Bf16Bits) for the down projection to take as they
// are, rows of `stride` >= I values (its rounded rows: a zero past I). bias: [2 I] (the gate's, then the up
// projection's), or null. The SwiGLU's own pass over a [M, 2 I] product (its ~6 MB a layer of a 512-token SmolLM2
// prompt through L3 and back) goes: the outputs are in registers here.
template <typename T>
struct SwiGluOut {
  T* Y;
  int64_t I, stride;
  const float* bias;
  FDCORE_BF16_TARGET void operator()(int64_t m, int64_t g, __m512 gate, __m512 up) const {
    const int64_t first = g * 16;
    if (bias) {  // as Paddle's broadcast add: one float add an element
      const __mmask16 lanes = LanesBefore(first, I);
      gate = _mm512_add_ps(gate, _mm512_maskz_loadu_ps(lanes, bias + first));
      up = _mm512_add_ps(up, _mm512_maskz_loadu_ps(lanes, bias + I + first));
    }
    if constexpr (sizeof(T) == sizeof(float)) {
      StoreBlock(Y + m * stride, first, I, SiluTimes(gate, up));
    } else if (first < stride) {
      const __m512 value = _mm512_maskz_mov_ps(LanesBefore(first, I), SiluTimes(gate, up));
      _mm512_mask_cvtepi32_storeu_epi16(Y + m * stride + first, LanesBefore(first, stride), Bf16Bits(value));
    }
  }
};

// MB rows of X against one group of 32 output rows.
template <int MB, typename Out>
FDCORE_BF16_TARGET void GroupRows(const uint32_t* Xp, int64_t KP, const uint16_t* Wg, int64_t g, int64_t m0,
                                  const Out& out) {
  __m512 acc[MB][kBlocks];
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < kBlocks; ++b) acc[j][b] = _mm512_setzero_ps();
  const uint16_t* w = Wg;
  for (int64_t kp = 0; kp < KP; ++kp, w += kGroup * 2) {
    __m512bh wb[kBlocks];
    for (int b = 0; b < kBlocks; ++b) wb[b] = (__m512bh)_mm512_loadu_si512(w + b * 32);
    for (int j = 0; j < MB; ++j) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(Xp[(m0 + j) * KP + kp]));
      for (int b = 0; b < kBlocks; ++b) acc[j][b] = _mm512_dpbf16_ps(acc[j][b], wb[b], x);
    }
  }
  for (int j = 0; j < MB; ++j) out(m0 + j, g, acc[j][0], acc[j][1]);
}

// X's rows as bfloat16 (RoundToBf16), each padded to 2 KP values (an odd K leaves a zero in the last pair),
// rows shared out across threads. The scalar loop, after a clearing pass, was ~2.5 % of a 512-token SmolLM2
// bf16 prefill's CPU time on one thread while the other waited: this made the prefill 3-4 % faster (2 threads
// of a Zen 4 EPYC, alternating in one process), decoding unchanged.
FDCORE_BF16_TARGET void RoundRows(const float* X, int64_t M, int64_t K, int64_t KP, uint16_t* R) {
#pragma omp parallel for schedule(static) if (M >= 8 && M * K >= (1 << 16))
  for (int64_t m = 0; m < M; ++m) RoundRow(X + m * K, K, R + m * KP * 2);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX path (CPUs with AMX-BF16, e.g. Sapphire Rapids and later Xeons): `tdpbf16ps` multiplies a tile of 16
// rows x 32 inputs of X by one of 32 inputs x 16 outputs of W per instruction, 16 times the products of a
// `vdpbf16ps`. The packed layout above is already what a B tile wants: rows are pairs of K, each 64 bytes
// holding 16 outputs x 2 inputs, a block's rows 128 bytes apart (the group's two blocks interleave). X's
// rounded rows are A tiles as they are (stride 4 KP bytes). Every row, alone or in a batch of any size,
// goes through the same tiles over K in the same order (a tile's row m depends on X's row m alone), so a
// row's bits are the same in any batch here too. They differ from the AVX512-BF16 path's (the tiles' error
// to a float64 reference is 2-3x smaller), so a serving process keeps one path (fdcore_set_bf16_tiles is for
// measuring and testing the other).
constexpr int kTileRows = 16;  // rows of X per A tile (and per C tile)
constexpr int kTilePairs = 16; // pairs of K per tile step (32 bfloat16 inputs: one 64-byte tile row)
// The tiles take K in steps of 32 inputs; a matrix whose K is not a multiple of 32 keeps the AVX512-BF16 path
// for every batch (the choice is the matrix's, never the batch's: a row's bits must not depend on its batch).
inline bool UseAmx(int64_t KP) { return KP % kTilePairs == 0 && Bf16Tiles(); }

// Tiles 0-3: C (two row blocks x the group's two 16-output blocks); 4, 5: A (X's row blocks); 6, 7: B.
// `rows`: X's rows per A and C tile (fewer than 16 for a batch smaller than a tile).
void ConfigureTiles(int rows) {
  const uint8_t shape[8] = {uint8_t(rows), uint8_t(rows), uint8_t(rows), uint8_t(rows), uint8_t(rows), uint8_t(rows),
                            kTilePairs, kTilePairs};
  ConfigureTileRows(shape, 8);
}

// Hands a row block's two C tiles (16-output blocks first and second of group g, stored in `first`, `second`) to
// `out`, row by row: X's rows m0 .. (fewer past M).
template <typename Out>
FDCORE_BF16_TARGET void OutTiles(const float* first, const float* second, int rows, int64_t m0, int64_t M, int64_t g,
                                 const Out& out) {
  for (int r = 0; r < rows && m0 + r < M; ++r)
    out(m0 + r, g, _mm512_load_ps(first + r * 16), _mm512_load_ps(second + r * 16));
}

// One group of 32 outputs against two row blocks of X (m0 and m0 + rows; kBoth false: the first only).
template <bool kBoth, typename Out>
FDCORE_BF16_TARGET __attribute__((target("amx-tile,amx-bf16"))) void GroupTiles(
    const uint16_t* Xr, int64_t KP, const uint16_t* Wg, int rows, int64_t m0, int64_t M, int64_t g, const Out& out) {
  _tile_zero(0);
  _tile_zero(1);
  if (kBoth) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = KP * 4, w_stride = kGroup * 4;
  const uint16_t* x0 = Xr + m0 * KP * 2;
  const uint16_t* x1 = x0 + rows * KP * 2;
  for (int64_t kp = 0; kp < KP; kp += kTilePairs) {
    const uint16_t* w = Wg + kp * kGroup * 2;
    _tile_loadd(6, w, w_stride);
    _tile_loadd(7, w + 32, w_stride);
    _tile_loadd(4, x0 + kp * 2, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kBoth) {
      _tile_loadd(5, x1 + kp * 2, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float first[kTileRows * 16], second[kTileRows * 16];
  _tile_stored(0, first, 64);
  _tile_stored(1, second, 64);
  OutTiles(first, second, rows, m0, M, g, out);
  if (kBoth) {
    _tile_stored(2, first, 64);
    _tile_stored(3, second, 64);
    OutTiles(first, second, rows, m0 + rows, M, g, out);
  }
}

// Group g against X's rows m0 .. end - 1 (m0 a multiple of 2 rows, end <= M), two tiles at a time.
template <typename Out>
FDCORE_BF16_TARGET __attribute__((target("amx-tile,amx-bf16"))) void GroupRowTiles(
    const uint16_t* Xr, int64_t KP, const uint16_t* Wg, int rows, int64_t m0, int64_t end, int64_t M, int64_t g,
    const Out& out) {
  for (; m0 + rows < end; m0 += 2 * rows) GroupTiles<true>(Xr, KP, Wg, rows, m0, M, g, out);
  if (m0 < end) GroupTiles<false>(Xr, KP, Wg, rows, m0, M, g, out);
}

// Whether a product's threads share out X's rows (each thread its rows, against every group of W) rather than W's
// groups (each thread its groups, against every row of X): where X is about as big as W or bigger (a prompt's rows
// against a matrix of as many outputs: SmolLM2's o and down), each thread then keeps half of X in its L2, and its
// rows' outputs are in its own caches for what reads them next by rows (the residual add and norm). SmolLM2's
// products at 2 threads, the two splits alternating call by call in one process (rows / groups): 512 rows: o 0.88x,
// down 0.90x, qkv 1.05x, gate_up 1.12x; 1024 rows: o 0.80x, down 0.68x, qkv 1.04x; 256 rows: o 0.94x, down 1.08x.
// Either way every output is the same tile chain over K: the same bits.
inline bool SplitRows(int64_t M, int64_t G) { return M >= 8 * kTileRows && 5 * M >= 4 * G * kGroup; }

// Xr: X's rows rounded (RoundRows), padded with zero rows to a whole number of tiles.
template <typename Out>
FDCORE_BF16_TARGET __attribute__((target("amx-tile,amx-bf16"))) void LinearTiles(
    const uint16_t* Xr, int64_t M, int64_t KP, const uint16_t* Wp, int64_t G, const Out& out, bool parallel) {
  const int rows = static_cast<int>(std::min<int64_t>(M, kTileRows));
  const int64_t group_size = KP * kGroup * 2;
  const bool by_rows = parallel && SplitRows(M, G);
#pragma omp parallel if (parallel)
  {
    ConfigureTiles(rows);  // the tile configuration is each thread's own
    if (by_rows) {  // this thread's share of the pairs of row tiles, in one run
      const int64_t pairs = (M + 2 * rows - 1) / (2 * rows), threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t first = pairs * t / threads * 2 * rows, end = std::min(M, pairs * (t + 1) / threads * 2 * rows);
      for (int64_t g = 0; g < G && first < end; ++g)
        GroupRowTiles(Xr, KP, Wp + g * group_size, rows, first, end, M, g, out);
    } else {
#pragma omp for schedule(static)
      for (int64_t g = 0; g < G; ++g) GroupRowTiles(Xr, KP, Wp + g * group_size, rows, 0, M, M, g, out);
    }
    _tile_release();  // a thread that leaves its tiles configured costs every context switch 8 KB more to save
  }
}
#endif

// X's rounded rows Xr [Bf16RowsPadded(M), 2 KP] (RoundRows' layout; the padding rows zeros) times the packed W's G
// groups, each group's outputs to `out` (PlainOut, SwiGluOut).
template <typename Out>
FDCORE_BF16_TARGET void LinearRounded(const uint16_t* Xr, int64_t M, int64_t KP, const uint16_t* Wp, int64_t G,
                                      const Out& out) {
  // Groups of output rows are split across the OpenMP threads (OMP_NUM_THREADS): each streams its
  // own share of W, which is what lets one sequence's decoding use more than one core's bandwidth.
  const bool parallel = G > 1 && M * G * kGroup * KP * 2 >= (1 << 18);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (UseAmx(KP)) {
    LinearTiles(Xr, M, KP, Wp, G, out, parallel);
    return;
  }
#endif
  const auto* Xp = reinterpret_cast<const uint32_t*>(Xr);
  const int64_t group_size = KP * kGroup * 2;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* Wg = Wp + g * group_size;
    int64_t m0 = 0;
    for (; m0 + 8 <= M; m0 += 8) GroupRows<8>(Xp, KP, Wg, g, m0, out);
    for (; m0 + 4 <= M; m0 += 4) GroupRows<4>(Xp, KP, Wg, g, m0, out);
    for (; m0 < M; ++m0) GroupRows<1>(Xp, KP, Wg, g, m0, out);
  }
}

// X [M, K] float32 rounded (RoundRows, into a buffer of this thread's, on lines: the tiles load its rows), then
// LinearRounded.
template <typename Out>
FDCORE_BF16_TARGET void Linear(const float* X, int64_t M, int64_t K, const uint16_t* Wp, int64_t G, int64_t KP,
                               const Out& out) {
  thread_local LineBuffer<uint16_t> buffer;
  const int64_t padded = Bf16RowsPadded(M);
  uint16_t* const rounded = buffer.Get(padded * KP * 2);
  RoundRows(X, M, K, KP, rounded);
  std::memset(rounded + M * KP * 2, 0, (padded - M) * KP * 2 * sizeof(uint16_t));
  LinearRounded(rounded, M, KP, Wp, G, out);
}

}  // namespace

// 1: the AMX path is used where the CPU and the OS allow it (the default); 0: the AVX512-BF16 path everywhere.
extern "C" void fdcore_set_bf16_tiles(int on) { fdcore_bf16_tiles_wanted = on; }
// Whether a bfloat16 product of a suitable shape runs on AMX tiles in this process.
extern "C" int fdcore_bf16_tiles() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return Bf16Tiles();
#else
  return 0;
#endif
}

// w [G, KP, 2, 16, 2] bfloat16, the packed weight of an inner dimension K: its groups G (checked).
static int64_t PackedGroups(const paddle::Tensor& w, int64_t K) {
  const auto& ws = w.shape();
  PD_CHECK(w.dtype() == paddle::DataType::BFLOAT16, "linear_bf16: w must be bfloat16");
  PD_CHECK(ws.size() == 5 && ws[2] == kBlocks && ws[3] == 16 && ws[4] == 2, "linear_bf16: w is not packed");
  PD_CHECK(ws[1] == (K + 1) / 2, "linear_bf16: x and w disagree on the inner dimension");
  return ws[0];
}

// PackedGroups, and that `rows` outputs fill its last group.
static int64_t PlainGroups(const paddle::Tensor& w, int64_t K, int64_t rows) {
  const int64_t G = PackedGroups(w, K);
  PD_CHECK(rows > G * kGroup - kGroup && rows <= G * kGroup, "linear_bf16: rows does not fit the packed groups");
  return G;
}

// x [M, K] float32; w the packed weight (PackedGroups); rows = N, the real output count.
// Y [M, rows] = X [M, K] . W^T into the caller's memory (decoder_layers' workspace, or the op's output), or R + X W^T
// for residual rows R [M, rows] (null: none; not Y).
void LinearBf16Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows, float* Y,
                    const float* R) {
  const int64_t G = PlainGroups(w, K, rows);
  Linear(X, M, K, static_cast<const uint16_t*>(w.data()), G, w.shape()[1], PlainOut{Y, rows, R});
}

// The SwiGLU's checks (rows: 2 I, the gate's and the up projection's; bias [2 I] or empty) and its bias, or null.
static const float* SwiGluBias(const paddle::Tensor& w, int64_t G, int64_t rows, const paddle::Tensor& bias) {
  const int64_t I = rows / 2;
  PD_CHECK(rows % 2 == 0 && I > G * 16 - 16 && I <= G * 16, "linear_bf16_swiglu: rows does not fit the packed groups");
  PD_CHECK(bias.numel() == 0 || bias.numel() == rows, "linear_bf16_swiglu: bias width != rows");
  return bias.numel() > 0 ? bias.data<float>() : nullptr;
}

// The SwiGLU of a gated matrix (SwiGluOut): Y [M, rows / 2] = silu(X gate^T + gate bias) (X up^T + up bias), rows
// the gate's and the up projection's together (2 I); bias [2 I] (the gate's, then the up projection's), or an empty
// tensor for none.
void LinearBf16SwiGluInto(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows,
                          const paddle::Tensor& bias, float* Y) {
  const int64_t G = PackedGroups(w, K);
  const float* b = SwiGluBias(w, G, rows, bias);
  Linear(X, M, K, static_cast<const uint16_t*>(w.data()), G, w.shape()[1], SwiGluOut<float>{Y, rows / 2, rows / 2, b});
}

// The same two products of X already rounded: Xr [Bf16RowsPadded(M), 2 KP] bfloat16 bits (RoundRows' layout, the
// padding rows zeros; KP = (K + 1) / 2), as a norm that rounds its own output gives them (AddRmsNormBf16Into).
void LinearBf16RoundedInto(const uint16_t* Xr, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows, float* Y,
                           const float* R) {
  const int64_t G = PlainGroups(w, K, rows);
  LinearRounded(Xr, M, w.shape()[1], static_cast<const uint16_t*>(w.data()), G, PlainOut{Y, rows, R});
}

// ... and the SwiGLU's activations as bfloat16 bits, rows of `stride` >= rows / 2 values (a zero past rows / 2):
// the down projection's rounded X as it is (stride Bf16RowWidth(I)). Rows M .. of Yr are left as they are.
void LinearBf16SwiGluRoundedInto(const uint16_t* Xr, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows,
                                 const paddle::Tensor& bias, int64_t stride, uint16_t* Yr) {
  const int64_t G = PackedGroups(w, K);
  const float* b = SwiGluBias(w, G, rows, bias);
  PD_CHECK(stride >= rows / 2, "linear_bf16_swiglu: rows of ", stride, " values cannot hold ", rows / 2);
  LinearRounded(Xr, M, w.shape()[1], static_cast<const uint16_t*>(w.data()), G,
                SwiGluOut<uint16_t>{Yr, rows / 2, stride, b});
}

// x [M, K] bfloat16 as a product's rounded rows: x's own memory where it is laid out so (K even, M a whole number of
// tiles or at most one), else a copy padded so in this thread's `copy`.
static const uint16_t* RoundedRows(const paddle::Tensor& x, LineBuffer<uint16_t>& copy) {
  const int64_t M = x.shape()[0], K = x.shape()[1], width = Bf16RowWidth(K), padded = Bf16RowsPadded(M);
  const auto* bits = static_cast<const uint16_t*>(x.data());
  if (width == K && padded == M) return bits;
  uint16_t* const rows = copy.Get(padded * width);
  std::memset(rows, 0, padded * width * sizeof(uint16_t));
  for (int64_t m = 0; m < M; ++m) std::memcpy(rows + m * width, bits + m * K, K * sizeof(uint16_t));
  return rows;
}

// x float32, or bfloat16 taken as it is (a caller's activations already rounded: LinearBf16RoundedInto).
std::vector<paddle::Tensor> LinearBf16(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows) {
  const bool rounded = x.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(rounded || x.dtype() == paddle::DataType::FLOAT32, "linear_bf16: x must be float32 or bfloat16");
  const int64_t M = x.shape()[0], K = x.shape()[1];
  auto y = paddle::empty({M, rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  if (rounded) {
    thread_local LineBuffer<uint16_t> copy;
    LinearBf16RoundedInto(RoundedRows(x, copy), M, K, w, rows, y.data<float>(), nullptr);
  } else {
    LinearBf16Into(x.data<float>(), M, K, w, rows, y.data<float>(), nullptr);
  }
  return {y};
}

std::vector<paddle::DataType> Float32Out(const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(fdcore_linear_bf16)
    .Inputs({"X", "W"})
    .Outputs({"Y"})
    .Attrs({"rows: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearBf16))
    .SetInferDtypeFn(PD_INFER_DTYPE(Float32Out));

// x float32: float32 activations out; x bfloat16 (already rounded): bfloat16 activations out, as the down
// projection takes them (LinearBf16SwiGluRoundedInto).
std::vector<paddle::Tensor> LinearBf16SwiGlu(const paddle::Tensor& x, const paddle::Tensor& w,
                                             const paddle::Tensor& bias, int64_t rows) {
  const bool rounded = x.dtype() == paddle::DataType::BFLOAT16;
  PD_CHECK(rounded || x.dtype() == paddle::DataType::FLOAT32, "linear_bf16_swiglu: x must be float32 or bfloat16");
  const int64_t M = x.shape()[0], K = x.shape()[1], I = rows / 2;
  auto y = paddle::empty({M, I}, x.dtype(), paddle::CPUPlace());
  if (rounded) {
    thread_local LineBuffer<uint16_t> copy;
    LinearBf16SwiGluRoundedInto(RoundedRows(x, copy), M, K, w, rows, bias, I, static_cast<uint16_t*>(y.data()));
  } else {
    LinearBf16SwiGluInto(x.data<float>(), M, K, w, rows, bias, y.data<float>());
  }
  return {y};
}

PD_BUILD_OP(fdcore_linear_bf16_swiglu)
    .Inputs({"X", "W", "Bias"})
    .Outputs({"Y"})
    .Attrs({"rows: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearBf16SwiGlu));
