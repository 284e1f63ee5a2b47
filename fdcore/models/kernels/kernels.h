// Every function one kernel file calls in another, and the enums Python mirrors (fdcore.models.kernels reads
// Kind and Slot from this file, and a test checks them against the header). A prototype lives
// here once: a definition that drifts from it fails to compile or to link (-Wl,--no-undefined), not at load.
// Everything here is internal to the library (hidden: a direct call, no PLT); Python reaches the operators
// through Paddle's registry (PD_BUILD_OP) and the settings through their extern "C" functions.
#pragma once

#include <cstdint>

#include "paddle/extension.h"

#define FDCORE_INTERNAL __attribute__((visibility("hidden")))
// The bfloat16 kernels carry their own target, so the library builds on any x86-64 CPU; callers check the flags.
#define FDCORE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))

// How a decoder layer's projections are packed (the one-call decoder's `kind`; fdcore.models.kernels.DECODER_KINDS).
enum Kind : int64_t { kFloat32 = 0, kBfloat16 = 1, kInt8 = 2, kInt4 = 3 };

// A layer's tensors in the one-call decoder's `weights`, kSlots a layer (fdcore.models.kernels.DECODER_SLOTS).
enum Slot : int {
  kInNorm, kQkv, kQkvScales, kQkvBias, kO, kOScales, kOBias, kPostNorm,
  kGateUp, kGateUpScales, kGateUpBias, kDown, kDownScales, kDownBias, kQNorm, kKNorm, kSlots
};

// A layer's values in the one-call decoder's `meta`: its qkv, o, gate_up and down rows, then its sliding window
// (0: none) (fdcore.models.kernels.DECODER_META).
constexpr int kMeta = 5;

// linear_f32.cc: Y [M, rows] = X [M, K] times a packed float32 weight.
FDCORE_INTERNAL void LinearF32Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows,
                                   float* Y);

// linear_bf16.cc: the bfloat16 products (float32 X rounded here, or X already rounded: Xr), R an optional residual
// added in the epilogue; the gated product with its SwiGLU; the rounded-row layout; the AMX tile settings.
FDCORE_INTERNAL void LinearBf16Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows,
                                    float* Y, const float* R);
FDCORE_INTERNAL void LinearBf16RoundedInto(const uint16_t* Xr, int64_t M, int64_t K, const paddle::Tensor& w,
                                           int64_t rows, float* Y, const float* R);
FDCORE_INTERNAL void LinearBf16SwiGluRoundedInto(const uint16_t* Xr, int64_t M, int64_t K, const paddle::Tensor& w,
                                                 int64_t rows, const paddle::Tensor& bias, int64_t stride,
                                                 uint16_t* Yr);
FDCORE_INTERNAL int64_t Bf16RowsPadded(int64_t M);  // rows of a rounded X (whole tiles past 16)
FDCORE_INTERNAL int64_t Bf16RowWidth(int64_t n);    // values of a rounded row of n (even)
FDCORE_INTERNAL FDCORE_BF16_TARGET void RoundToBf16(const float* x, int64_t n, uint16_t* r);  // nearest even
FDCORE_INTERNAL bool Bf16Tiles();  // whether products run on AMX tiles here (wanted, and granted by the OS)
FDCORE_INTERNAL void ConfigureTileRows(const uint8_t* rows, int count);  // this thread's tiles: rows[t] x 64 B

// linear_int8.cc: the int8 product; the activations' quantizer (shared with linear_int4.cc); the threads' rule.
FDCORE_INTERNAL void LinearInt8Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w,
                                    const paddle::Tensor& scales, int64_t rows, float* Y);
FDCORE_INTERNAL void QuantizeBlock(const float* x, int64_t left, int8_t* q, float* scale, int32_t* sum);
FDCORE_INTERNAL bool RowsWorthSharing(int64_t rows, int64_t width);  // share a loop over rows out over threads?
extern int fdcore_prefetch_weights;  // whether one-row passes prefetch their weights (a process setting)

// linear_int4.cc: the 4-bit product (llama.cpp's Q4_1 blocks).
FDCORE_INTERNAL void LinearInt4Into(const float* X, int64_t M, int64_t K, const paddle::Tensor& w, int64_t rows,
                                    float* Y);

// rms_norm.cc: S = H + DL (where given), N = S's RMSNorm times W; the bfloat16 form writes N rounded (R).
FDCORE_INTERNAL void AddRmsNormInto(const float* H, const float* DL, const float* W, int64_t T, int64_t E, float eps,
                                    float* S, float* N);
FDCORE_INTERNAL void AddRmsNormBf16Into(const float* H, const float* DL, const float* W, int64_t T, int64_t E,
                                        float eps, float* S, uint16_t* R);

// silu_mul.cc: O [T, I] = silu(G's first half) * G's second half.
FDCORE_INTERNAL void SiluMulInto(const float* G, int64_t T, int64_t I, float* O);

// attention.cc: rotary, the cache write and attention of one layer's qkv rows (false: the output went to O, not Or).
FDCORE_INTERNAL bool AttentionBlockInto(const float* X, int64_t Tn, int64_t width, const paddle::Tensor& cos,
                                        const paddle::Tensor& sin, const paddle::Tensor& slots,
                                        const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                                        const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                        const paddle::Tensor& q_norm, const paddle::Tensor& k_norm,
                                        int64_t num_heads, float scale, int64_t window, float norm_eps, float* Qo,
                                        float* O, uint16_t* Or);
