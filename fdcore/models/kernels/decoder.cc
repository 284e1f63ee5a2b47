// Every decoder layer of one step in a single operator call: the same functions the per-layer path
// calls from Python (AddRmsNorm, the packed linear kernels, AttentionBlock, SiluMul), in the same order
// on the same values, so the logits are the same to the bit; what goes is the Python loop and ~8
// Paddle custom-op dispatches per layer (~10 us each: ~2.4 ms a step on a 30-layer model, a quarter of
// a 4-bit batch-1 decode step).
//
// weights: kSlots tensors per layer (see Slot; an empty tensor where a layer has none of that kind),
// meta: per layer the output rows of qkv, o, gate_up and down, then its sliding window (0: none);
// kind: how every layer's projections are packed (Kind).
//
// A rank of a tensor-parallel group (group: the group communicator's shared segment, fdcore/ipc/allreduce.py;
// an empty tensor for a whole model) sums its o and down products with the group's after each layer, here,
// by the same protocol and in the same order as the communicator's Python all_reduce (so the two interleave
// freely and give the same bits): no return to Python between layers.
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "paddle/extension.h"

std::vector<paddle::Tensor> LinearF32(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows);
std::vector<paddle::Tensor> LinearBf16(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows);
std::vector<paddle::Tensor> LinearInt8(const paddle::Tensor& x, const paddle::Tensor& w, const paddle::Tensor& scales,
                                       int64_t rows);
std::vector<paddle::Tensor> LinearInt4(const paddle::Tensor& x, const paddle::Tensor& w, int64_t rows);
std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& hidden, const paddle::Tensor& delta,
                                       const paddle::Tensor& weight, float eps);
std::vector<paddle::Tensor> SiluMul(const paddle::Tensor& gate_up);
std::vector<paddle::Tensor> AttentionBlock(const paddle::Tensor& qkv, const paddle::Tensor& cos,
                                           const paddle::Tensor& sin, const paddle::Tensor& slots,
                                           const paddle::Tensor& k_cache, const paddle::Tensor& v_cache,
                                           const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                           const paddle::Tensor& q_norm, const paddle::Tensor& k_norm,
                                           int64_t num_heads, float scale, int64_t window, float norm_eps);

namespace {

enum Kind : int64_t { kFloat32 = 0, kBfloat16 = 1, kInt8 = 2, kInt4 = 3 };
enum Slot : int {
  kInNorm, kQkv, kQkvScales, kQkvBias, kO, kOScales, kOBias, kPostNorm,
  kGateUp, kGateUpScales, kGateUpBias, kDown, kDownScales, kDownBias, kQNorm, kKNorm, kSlots
};
constexpr int kMeta = 5;  // qkv, o, gate_up, down rows; window

// x . W^T (+ bias, added as Paddle's broadcast add does: one float add per element).
paddle::Tensor Project(int64_t kind, const paddle::Tensor& x, const paddle::Tensor* w, int slot, int64_t rows) {
  paddle::Tensor y;
  switch (kind) {
    case kFloat32: y = LinearF32(x, w[slot], rows)[0]; break;
    case kBfloat16: y = LinearBf16(x, w[slot], rows)[0]; break;
    case kInt8: y = LinearInt8(x, w[slot], w[slot + 1], rows)[0]; break;
    case kInt4: y = LinearInt4(x, w[slot], rows)[0]; break;
    default: PD_CHECK(false, "decoder_layers: unknown matrix kind");
  }
  const paddle::Tensor& bias = w[slot + 2];
  if (bias.numel() > 0) {
    PD_CHECK(bias.numel() == rows, "decoder_layers: bias width != rows");
    float* Y = y.data<float>();
    const float* B = bias.data<float>();
    const int64_t M = x.shape()[0];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < rows; ++n) Y[m * rows + n] += B[n];
  }
  return y;
}

// The communicator's segment: per buffer set (2) and rank a 64-byte line (generation, byte count; word 2 of
// set 0 rank 0's line: the supervisor's abort flag), then per set and rank a slot of `capacity` bytes.
class Group {
 public:
  Group(const paddle::Tensor& segment, int64_t rank, int64_t world, int64_t capacity, double timeout)
      : base_(segment.numel() > 0 ? const_cast<uint8_t*>(segment.data<uint8_t>()) : nullptr),
        rank_(rank), world_(world), capacity_(capacity), timeout_(timeout) {
    PD_CHECK(!base_ || segment.numel() == 2 * world * (kLine + capacity), "decoder_layers: group segment size");
  }
  bool active() const { return base_ != nullptr; }

  // x[n] summed with every rank's, in rank order (the communicator's all_reduce).
  void AllReduce(float* x, int64_t n) const {
    const int64_t bytes = n * static_cast<int64_t>(sizeof(float));
    PD_CHECK(bytes <= capacity_, "decoder_layers: ", bytes, " bytes do not fit the group's slots");
    const int64_t generation = std::max(Load(Word(0, rank_)), Load(Word(1, rank_))) + 1;
    const int part = static_cast<int>(generation & 1);
    std::memcpy(Slot(part, rank_), x, bytes);
    Store(Word(part, rank_) + 1, bytes);
    Store(Word(part, rank_), generation);  // last: publishes the slot
    for (int64_t r = 0; r < world_; ++r) Wait(Word(part, r), generation);
    const float* first = reinterpret_cast<const float*>(Slot(part, 0));
    for (int64_t i = 0; i < n; ++i) {
      float sum = first[i];
      for (int64_t r = 1; r < world_; ++r) sum += reinterpret_cast<const float*>(Slot(part, r))[i];
      x[i] = sum;
    }
  }

 private:
  static constexpr int64_t kLine = 64, kSpins = 2000;
  int64_t* Word(int part, int64_t rank) const {
    return reinterpret_cast<int64_t*>(base_ + (part * world_ + rank) * kLine);
  }
  uint8_t* Slot(int part, int64_t rank) const { return base_ + 2 * world_ * kLine + (part * world_ + rank) * capacity_; }
  static int64_t Load(int64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
  static void Store(int64_t* word, int64_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); }

  void Wait(int64_t* word, int64_t generation) const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_);
    for (int64_t spins = 0; Load(word) < generation; ++spins) {
      if (spins < kSpins) {
        __builtin_ia32_pause();
        continue;
      }
      PD_CHECK(Load(Word(0, 0) + 2) == 0, "fdcore group aborted: a rank of the group is gone");
      PD_CHECK(std::chrono::steady_clock::now() < deadline, "fdcore group: a rank missed generation ", generation,
               " for ", timeout_, " s");
      const timespec nap{0, 20000};  // 20 us: a peer still computing needs the core more than we do
      nanosleep(&nap, nullptr);
    }
  }

  uint8_t* base_;
  int64_t rank_, world_, capacity_;
  double timeout_;
};

}  // namespace

// hidden [T, E] (the embeddings); returns the final norm's output [T, E].
std::vector<paddle::Tensor> DecoderLayers(const paddle::Tensor& hidden, const paddle::Tensor& cos,
                                          const paddle::Tensor& sin, const paddle::Tensor& slots,
                                          const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                          const std::vector<paddle::Tensor>& k_caches,
                                          const std::vector<paddle::Tensor>& v_caches,
                                          const std::vector<paddle::Tensor>& weights, const paddle::Tensor& final_norm,
                                          const paddle::Tensor& group_segment, const std::vector<int64_t>& meta,
                                          int64_t kind, int64_t num_heads, float scale, float eps,
                                          const std::vector<int64_t>& group, float group_timeout) {
  const size_t layers = k_caches.size();
  PD_CHECK(v_caches.size() == layers, "decoder_layers: one V cache per layer");
  PD_CHECK(weights.size() == layers * kSlots, "decoder_layers: weights are not kSlots per layer");
  PD_CHECK(meta.size() == layers * kMeta, "decoder_layers: meta is not kMeta per layer");
  PD_CHECK(group.size() == 3, "decoder_layers: group is (rank, world, capacity)");
  const Group comm(group_segment, group[0], group[1], group[2], group_timeout);
  const paddle::Tensor none = paddle::empty({0}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  paddle::Tensor h = hidden, delta = none;
  for (size_t i = 0; i < layers; ++i) {
    const paddle::Tensor* w = weights.data() + i * kSlots;
    const int64_t* m = meta.data() + i * kMeta;
    auto normed = AddRmsNorm(h, delta, w[kInNorm], eps);
    h = normed[0];
    const paddle::Tensor qkv = Project(kind, normed[1], w, kQkv, m[0]);
    const paddle::Tensor attn = AttentionBlock(qkv, cos, sin, slots, k_caches[i], v_caches[i], tables, lengths,
                                               w[kQNorm], w[kKNorm], num_heads, scale, m[4], eps)[0];
    paddle::Tensor o = Project(kind, attn, w, kO, m[1]);
    if (comm.active()) comm.AllReduce(o.data<float>(), o.numel());
    normed = AddRmsNorm(h, o, w[kPostNorm], eps);
    h = normed[0];
    const paddle::Tensor gate_up = Project(kind, normed[1], w, kGateUp, m[2]);
    delta = Project(kind, SiluMul(gate_up)[0], w, kDown, m[3]);
    if (comm.active()) comm.AllReduce(delta.data<float>(), delta.numel());
  }
  return {AddRmsNorm(h, delta, final_norm, eps)[1]};
}

PD_BUILD_OP(fdcore_decoder_layers)
    .Inputs({"Hidden", "Cos", "Sin", "Slots", "Tables", "Lengths", paddle::Vec("KCaches"), paddle::Vec("VCaches"),
             paddle::Vec("Weights"), "FinalNorm", "GroupSegment"})
    .Outputs({"Normed"})
    .Attrs({"meta: std::vector<int64_t>", "kind: int64_t", "num_heads: int64_t", "scale: float", "eps: float",
            "group: std::vector<int64_t>", "group_timeout: float"})
    .SetKernelFn(PD_KERNEL(DecoderLayers));
