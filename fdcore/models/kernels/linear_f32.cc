// fdcore's float32 linear layer: Y[M, N] = X[M, K] . W[N, K]^T, all float32, on CPUs with AVX-512F or AVX2
// and FMA (the path is the library's build target: fdcore.models.kernels builds it for the CPU it runs on).
//
// Why: decoding one sequence reads every weight once, so its speed is the memory's. Paddle's MKL
// (on AMD, its AVX2 path: see fdcore.models.cpu_env) streamed SmolLM2's 538 MB of float32 weights at
// ~14.5 GB/s at batch 1, on 1 thread or 2; this kernel streams them at the memory's speed (28 GB/s on
// one core of this EPYC, 33 GB/s on two), and in batches it keeps the FMA unit busy (~100 GFLOP/s on
// one core from 32 rows of X up; MKL 68 at 32 rows, as fast only from ~1000 rows). It is used at every
// batch size: the figures are in fdcore.models.matrices.F32Matrix.
//
// NOTE: the weight is packed once, at load (fdcore.models.matrices.F32Matrix), in panels of 32 output
// rows: packed[p][k][lane] = W[32 p + lane][k] (rows zero-padded to a multiple of 32). A panel is one
// contiguous stream (what the hardware prefetcher follows best), and one k step of it is two 64-byte
// loads of 16 outputs each, multiplied against a broadcast x[m][k]: the accumulators are the outputs
// themselves (no horizontal sums). 32 rows, not 64, so that SmolLM2's 576-wide projections are 18 panels
// and split evenly on 2 or 3 threads. Up to 8 rows of X share each loaded pair of weight vectors (16
// accumulators: measured best of 3x64, 4x64, 6x64, 8x32, 10x32, 12x32 and 14x32 rows x outputs); a
// panel stays in cache while every row of X passes over it, so a weight is read from memory once per
// call. A one-row pass (decoding one sequence streams W from memory) also prefetches 4 KiB ahead where
// that is faster: the int kernels' setting (fdcore_prefetch_weights, measured at load and re-tried by the
// worker). On one thread of an EPYC a software prefetch 128 to 1024 floats ahead gained nothing; SmolLM2's
// float32 batch-1 step on 2 threads of a Xeon (family 6 model 207, AVX-512 and VNNI, no BF16), steps
// alternating in one process: 0.976-0.982x the time with it (2 and 8 KiB: 0.98, 0.99).
//
// Determinism (crash-resume replays a sequence in other batches): every output is one chain of
// FMAs over k = 0, 1, ..., K - 1 from zero, computed by one thread, whatever the tile it is in, the
// number of rows of X or the thread count. So a row's result is the same to the bit alone, in any
// batch, and on any number of threads.
//
// The AVX2 path is the same computation 8 outputs to a vector (6 rows of X against half a panel per
// pass: see kRowsPerPass there), so it gives the same bits. The
// caller checks the CPU's flags (/proc/cpuinfo) before using this.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "paddle/extension.h"

namespace {

constexpr int kPanel = 32;  // output rows per packed panel
constexpr int kPrefetchAhead = 1024;  // floats (4 KiB) a one-row pass prefetches ahead (when fdcore_prefetch_weights)

#if defined(__AVX512F__)
constexpr int kVectors = kPanel / 16;  // 16-lane vectors per panel
constexpr int kRowsPerPass = 8;        // rows of X per pass over a panel

// MB rows of X (X at the first, row stride K) against one panel (W: its [K][32] floats); `outputs` of
// its 32 rows are real; Y at the first row's first output of the panel (row stride N). stream: the first
// pass of a batch over the panel, which brings it in from memory: it prefetches as a row alone does (later
// passes find the panel in cache). Not left to the load's measurement as a row alone's is: SmolLM2's float32
// products (30 layers), with and without, alternating in one process on the AVX-512 Xeon, 2 threads: 2 rows
// 0.90x the time, 4 0.83x, 8 0.77x, 16 0.82x, 32 0.88x, 64 0.92x, 512 0.98x (1 thread: 0.80-0.90x).
template <int MB>
inline void PanelRows(const float* X, int64_t K, const float* W, int64_t outputs, int64_t N, float* Y, bool stream = false) {
  __m512 acc[MB][kVectors];
  for (int j = 0; j < MB; ++j)
    for (int v = 0; v < kVectors; ++v) acc[j][v] = _mm512_setzero_ps();
  const bool prefetch = MB == 1 ? fdcore_prefetch_weights : stream;
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch)  // the two 64-byte lines of this k, kPrefetchAhead on
      for (int v = 0; v < kVectors; ++v) _mm_prefetch(reinterpret_cast<const char*>(W + k * kPanel + v * 16 + kPrefetchAhead), _MM_HINT_T0);
    __m512 w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = _mm512_loadu_ps(W + k * kPanel + v * 16);
    for (int j = 0; j < MB; ++j) {
      const __m512 x = _mm512_set1_ps(X[j * K + k]);
      for (int v = 0; v < kVectors; ++v) acc[j][v] = _mm512_fmadd_ps(w[v], x, acc[j][v]);
    }
  }
  for (int v = 0; v < kVectors && v * 16 < outputs; ++v) {
    const int64_t here = outputs - v * 16;
    const __mmask16 mask = here >= 16 ? 0xffff : static_cast<__mmask16>((1u << here) - 1);
    for (int j = 0; j < MB; ++j) _mm512_mask_storeu_ps(Y + j * N + v * 16, mask, acc[j][v]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kVectors = kPanel / 8;  // 8-lane vectors per panel
// Rows of X per pass: 6 rows against half a panel (16 outputs) at a time, 12 accumulators, the half
// panel's 2 weight vectors and one broadcast x in AVX2's 16 registers (BLIS's 6x16 tile for these
// cores): 8 loads per 12 FMAs, and 12 independent chains to hide the FMA latency. The earlier 2 rows x
// 32 outputs (8 chains, 6 loads per 8 FMAs) reached ~33 GFLOP/s at 32 rows on 2 threads of a Zen 3 EPYC,
// 0.61x Paddle's MKL there (benchmarks/bench_linear_f32.py).
constexpr int kRowsPerPass = 6;

// As the AVX-512 version, 8 outputs per vector: the same FMA chain per output, so the same bits. One row
// (decoding one sequence: W streams from memory) takes the whole panel per pass; several rows take it in
// two halves, each a 6x16 tile.
template <int MB>
inline void PanelRows(const float* X, int64_t K, const float* W, int64_t outputs, int64_t N, float* Y, bool = false) {
  constexpr int kParts = MB == 1 ? 1 : 2;          // passes over the panel
  constexpr int kPartVectors = kVectors / kParts;  // vectors (of 8 outputs) per pass
  // (a batch's first pass does not prefetch here: on the AVX-512 Xeon running this path, 2 threads, it measured
  // 0.9x the time at 2 and 4 rows, 0.84-1.18x at 8 to 32: not shown to help on a real AVX2 machine)
  const bool prefetch = MB == 1 && fdcore_prefetch_weights;
  for (int part = 0; part < kParts; ++part) {
    const int64_t first = part * kPartVectors * 8;  // this pass's first output of the panel
    if (first >= outputs) break;  // (the last panel's second half may hold none)
    const float* Wh = W + first;
    __m256 acc[MB][kPartVectors];
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j)
#pragma GCC unroll 8
      for (int v = 0; v < kPartVectors; ++v) acc[j][v] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = 0; k < K; ++k) {
      if (prefetch)
        for (int v = 0; v < kPartVectors; v += 2) _mm_prefetch(reinterpret_cast<const char*>(Wh + k * kPanel + v * 8 + kPrefetchAhead), _MM_HINT_T0);
      __m256 w[kPartVectors];
#pragma GCC unroll 8
      for (int v = 0; v < kPartVectors; ++v) w[v] = _mm256_loadu_ps(Wh + k * kPanel + v * 8);
#pragma GCC unroll 16
      for (int j = 0; j < MB; ++j) {
        const __m256 x = _mm256_broadcast_ss(X + j * K + k);
#pragma GCC unroll 8
        for (int v = 0; v < kPartVectors; ++v) acc[j][v] = _mm256_fmadd_ps(w[v], x, acc[j][v]);
      }
    }
    // NOTE: every access to acc by a constant index (loops the compiler unrolls whole), the stores to Y
    // apart: with a store that depends on `outputs` GCC kept acc in memory and stored all 12 accumulators
    // after every k step (~2.3x the time, 21 GFLOP/s on one Zen 3 core against MKL's 51 at 64 rows).
    alignas(32) float tile[MB][kPartVectors * 8];
#pragma GCC unroll 16
    for (int j = 0; j < MB; ++j)
#pragma GCC unroll 8
      for (int v = 0; v < kPartVectors; ++v) _mm256_store_ps(tile[j] + v * 8, acc[j][v]);
    const int64_t here = std::min<int64_t>(outputs - first, kPartVectors * 8);  // (fewer: the last panel's)
    for (int j = 0; j < MB; ++j) std::copy(tile[j], tile[j] + here, Y + j * N + first);
  }
}
#else
constexpr int kRowsPerPass = 1;
template <int MB>
inline void PanelRows(const float*, int64_t, const float*, int64_t, int64_t, float*, bool = false) {
  PD_CHECK(false, "linear_f32: built for a CPU without AVX2 and FMA (the caller must check its flags)");
}
#endif

// The last R (< kRowsPerPass) rows of X against a panel.
template <int R>
inline void PanelRest(const float* X, int64_t rest, int64_t K, const float* W, int64_t outputs,
                                        int64_t N, float* Y, bool stream) {
  if constexpr (R > 0) {
    if (rest == R) {
      PanelRows<R>(X, K, W, outputs, N, Y, stream);
    } else {
      PanelRest<R - 1>(X, rest, K, W, outputs, N, Y, stream);
    }
  }
}

void Linear(const float* X, int64_t M, int64_t K, const float* W, int64_t P, int64_t N, float* Y) {
  // Panels are split across the OpenMP threads (OMP_NUM_THREADS) in contiguous, equal shares: each
  // thread streams its own part of W (the LM head's 1536 panels: 768 each on 2 threads), which is
  // what lets one sequence's decoding use more than one core's bandwidth.
  const bool parallel = P > 1 && M * N * K >= (1 << 18);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t p = 0; p < P; ++p) {
    const float* Wp = W + p * K * kPanel;
    const int64_t outputs = std::min<int64_t>(kPanel, N - p * kPanel);
    int64_t m = 0;
    for (; m + kRowsPerPass <= M; m += kRowsPerPass)
      PanelRows<kRowsPerPass>(X + m * K, K, Wp, outputs, N, Y + m * N + p * kPanel, m == 0);
    PanelRest<kRowsPerPass - 1>(X + m * K, M - m, K, Wp, outputs, N, Y + m * N + p * kPanel, m == 0);
  }
}

}  // namespace

// x [M, K] float32; w [P, K, 32] float32 (the packed weight); rows = N, the real output count.
// Y [M, rows] = X [M, K] . W^T into the caller's memory (decoder_layers' workspace, or the op's output).
void LinearF32Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows, float* Y) {
  const auto& s = w.shape();
  PD_CHECK(w.dtype() == paddle::DataType::FLOAT32, "linear_f32: w must be float32");
  PD_CHECK(s.size() == 3 && s[2] == kPanel, "linear_f32: w is not packed");
  const int64_t P = s[0];
  PD_CHECK(s[1] == K, "linear_f32: x and w disagree on the inner dimension");
  PD_CHECK(rows > P * kPanel - kPanel && rows <= P * kPanel, "linear_f32: rows does not fit the packed panels");
  if (M > 0) Linear(X, M, K, w.data<float>(), P, rows, Y);
}

std::vector<paddle::Tensor> LinearF32(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows) {
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, "linear_f32: x must be float32");
  PD_CHECK(x.shape().size() == 2, "linear_f32: x must be [M, K]");
  const int64_t M = x.shape()[0];
  auto y = paddle::empty({M, rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  LinearF32Into(x.data<float>(), M, x.shape()[1], w, rows, y.data<float>());
  return {y};
}

PD_BUILD_OP(fdcore_linear_f32)
    .Inputs({"X", "W"})
    .Outputs({"Y"})
    .Attrs({"rows: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearF32));
