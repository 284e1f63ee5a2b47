// Every decoder layer of one step in a single operator call: the same functions the per-layer path
// calls from Python (AddRmsNorm, the packed linear kernels, AttentionBlock, SiluMul or the bfloat16
// SwiGLU: their ...Into forms), in the same order on the same values, so the logits are the same to the
// bit; what goes is the Python loop and ~8 Paddle custom-op dispatches per layer (~10 us each: ~2.4 ms a
// step on a 30-layer model, a quarter of a 4-bit batch-1 decode step), and their ~10 output tensors a
// layer: every intermediate row lives in one Workspace per call. (A bfloat16 model's o and down products add
// their rows to the residual stream in their epilogue, the same sum the norm would make: FoldsResidual.)
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

#include "kernels.h"
#include "paddle/extension.h"

namespace {

// Y [M, rows] += the slot's bias, where it has one (as Paddle's broadcast add does: one float add per element).
void AddBias(const paddle::Tensor* w, int slot, int64_t M, int64_t rows, float* Y) {
  const paddle::Tensor& bias = w[slot + 2];
  if (bias.numel() == 0) return;
  PD_CHECK(bias.numel() == rows, "decoder_layers: bias width != rows");
  const float* B = bias.data<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < rows; ++n) Y[m * rows + n] += B[n];
}

// Y [M, rows] = X [M, K] . W^T (+ bias), or R + X W^T for residual rows R (ProjectRows checks them).
void Project(int64_t kind, const float* X, int64_t M, int64_t K, const paddle::Tensor* w, int slot, int64_t rows,
             float* Y, const float* R = nullptr) {
  switch (kind) {
    case kFloat32: LinearF32Into(X, M, K, w[slot], rows, Y); break;
    case kBfloat16: LinearBf16Into(X, M, K, w[slot], rows, Y, R); break;
    case kInt8: LinearInt8Into(X, M, K, w[slot], w[slot + 1], rows, Y); break;
    case kInt4: LinearInt4Into(X, M, K, w[slot], rows, Y); break;
    default: PD_CHECK(false, "decoder_layers: unknown matrix kind");
  }
  AddBias(w, slot, M, rows, Y);
}

// A layer's rows on their way into a product: float32 (x), or for a bfloat16 model already rounded as its
// products take them (xr: linear_bf16.cc's rounded rows, Bf16RowsPadded(M) of them, the padding rows zeros) by the
// norm or the SwiGLU that made them. The rounding is the one the product would make (RoundToBf16's bits), so the
// logits keep the per-layer path's bits; what goes is a float32 write, a read and a rounding pass a product.
struct Rows {
  float* x;
  uint16_t* xr;
};

// The residual add and norm into `to` (AddRmsNormInto, or AddRmsNormBf16Into for rounded rows).
void Norm(const Rows& to, const float* h, const float* delta, const paddle::Tensor& weight, int64_t T, int64_t E,
          float eps, float* sum) {
  if (to.xr) {
    AddRmsNormBf16Into(h, delta, weight.data<float>(), T, E, eps, sum, to.xr);
  } else {
    AddRmsNormInto(h, delta, weight.data<float>(), T, E, eps, sum, to.x);
  }
}

// Project of `from`'s rows, R + the product where there are residual rows R (FoldsResidual: a bfloat16 matrix
// without a bias).
void ProjectRows(int64_t kind, const Rows& from, int64_t M, int64_t K, const paddle::Tensor* w, int slot, int64_t rows,
                 float* Y, const float* R = nullptr) {
  PD_CHECK(!R || (kind == kBfloat16 && w[slot + 2].numel() == 0),
           "decoder_layers: a residual only a bias-less bf16 product adds");
  if (!from.xr) {
    Project(kind, from.x, M, K, w, slot, rows, Y, R);
    return;
  }
  LinearBf16RoundedInto(from.xr, M, K, w[slot], rows, Y, R);
  AddBias(w, slot, M, rows, Y);
}

// Whether the o and down products add their rows to the residual stream in their epilogue (PlainOut's R): a
// bfloat16 model's, where no layer has an o or down bias (R + (product + bias) would be another sum than the norm's
// h + delta) and no group must sum the products first. The norms then read one row a layer where they read two
// (the stream's and the product's), and the products' rows never go to memory alone; the same sums, so the same
// bits.
bool FoldsResidual(int64_t kind, const std::vector<paddle::Tensor>& weights, bool grouped) {
  if (kind != kBfloat16 || grouped) return false;
  for (size_t i = 0; i < weights.size(); i += kSlots)
    if (weights[i + kOBias].numel() > 0 || weights[i + kDownBias].numel() > 0) return false;
  return true;
}

// The MLP's activations, into `to` [M, rows / 2]: silu(gate) up of `from`'s gate and up products (rows: both
// together, with their bias): a bfloat16 model's gate_up is gated (fdcore.models.matrices.Bf16Matrix.pack_gated: SwiGLU
// in the product's epilogue, never the [M, rows] product in memory), its rows rounded both ways (Rows), the
// activations rounded there for the down product; every other kind's product goes through SiluMul. `product`
// [M, rows]: room for that product.
void GatedActivations(int64_t kind, const Rows& from, int64_t M, int64_t K, const paddle::Tensor* w, int64_t rows,
                      float* product, const Rows& to) {
  if (kind == kBfloat16) {
    PD_CHECK(from.xr && to.xr, "decoder_layers: a bfloat16 model's activations come from and go to rounded rows");
    LinearBf16SwiGluRoundedInto(from.xr, M, K, w[kGateUp], rows, w[kGateUpBias], Bf16RowWidth(rows / 2), to.xr);
  } else {
    ProjectRows(kind, from, M, K, w, kGateUp, rows, product);
    SiluMulInto(product, M, rows / 2, to.x);
  }
}

// The step's intermediate rows, carved out of one allocation (~10 Paddle tensors a layer cost ~25 us of
// a ~300 us SmolLM2 batch-1 layer, all of it on one thread while the others waited).
class Workspace {
 public:
  // sizes: of each buffer, in floats.
  explicit Workspace(const std::vector<int64_t>& sizes) {
    int64_t total = 0;
    for (int64_t size : sizes) {
      offsets_.push_back(total);
      total += (size + kAlign - 1) / kAlign * kAlign;
    }
    memory_ = paddle::empty({std::max<int64_t>(total, 1)}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  }
  float* operator[](size_t i) { return memory_.data<float>() + offsets_[i]; }

 private:
  static constexpr int64_t kAlign = 16;  // floats: every buffer on its own cache lines
  std::vector<int64_t> offsets_;
  paddle::Tensor memory_;
};

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

// hidden [T, E] (the embeddings); returns the final norm's output [T, E] and, where head_kind >= 0, the LM
// head's logits [R, head_rows] of the rows last_rows names (head: its packed matrix, scales (or an empty tensor)
// and an empty bias, as Project reads a slot), the product Python's linear() would make of those rows: a
// step's last Paddle calls (a row gather, the head's op, their tensors) came after the layers had streamed
// the weights through the caches, and cold they cost ~0.3 ms a SmolLM2 decode step.
std::vector<paddle::Tensor> DecoderLayers(const paddle::Tensor& hidden, const paddle::Tensor& cos,
                                          const paddle::Tensor& sin, const paddle::Tensor& slots,
                                          const paddle::Tensor& tables, const paddle::Tensor& lengths,
                                          const paddle::Tensor& last_rows, const std::vector<paddle::Tensor>& k_caches,
                                          const std::vector<paddle::Tensor>& v_caches,
                                          const std::vector<paddle::Tensor>& weights, const paddle::Tensor& final_norm,
                                          const std::vector<paddle::Tensor>& head,
                                          const paddle::Tensor& group_segment, const std::vector<int64_t>& meta,
                                          int64_t kind, int64_t num_heads, float scale, float eps,
                                          const std::vector<int64_t>& group, float group_timeout, int64_t head_kind,
                                          int64_t head_rows) {
  // (long: every layer of a step over one workspace; its phases are the functions above)
  const size_t layers = k_caches.size();
  PD_CHECK(v_caches.size() == layers, "decoder_layers: one V cache per layer");
  PD_CHECK(weights.size() == layers * kSlots, "decoder_layers: weights are not kSlots per layer");
  PD_CHECK(meta.size() == layers * kMeta, "decoder_layers: meta is not kMeta per layer");
  PD_CHECK(group.size() == 3, "decoder_layers: group is (rank, world, capacity)");
  PD_CHECK(head_kind < 0 || head.size() == 3, "decoder_layers: the head is (packed, scales, bias)");
  const Group comm(group_segment, group[0], group[1], group[2], group_timeout);
  const int64_t T = hidden.shape()[0], E = hidden.shape()[1];
  const int64_t attn_width = num_heads * (layers > 0 ? v_caches[0].shape()[3] : 0);  // (V: [KVH, NB, BS, D])
  int64_t qkv_width = 0, gate_up_width = 0, narrowest_gate_up = 0;
  for (size_t i = 0; i < layers; ++i) {
    const int64_t* m = meta.data() + i * kMeta;
    PD_CHECK(m[1] == E && m[3] == E, "decoder_layers: o and down must give back the hidden width");
    qkv_width = std::max(qkv_width, m[0]);
    gate_up_width = std::max(gate_up_width, m[2]);
    narrowest_gate_up = i == 0 ? m[2] : std::min(narrowest_gate_up, m[2]);
  }
  enum Buffer { kSumA, kSumB, kNormed, kQkvOut, kQuery, kAttn, kAttnRounded, kOut, kGateUpOut, kAct, kLast };
  // a bfloat16 model's normed rows and activations are its products' rounded rows (Rows): bfloat16 bits, two a
  // float, whole tiles of rows (the padding rows zeroed here, once: from where the narrowest layer's start, as
  // a layer's activations are rows of its own width); no [T, gate_up] product (GatedActivations)
  const bool rounded = kind == kBfloat16;
  // (floats a rounded row takes: two values a float)
  const int64_t TP = rounded ? Bf16RowsPadded(T) : T, E2 = Bf16RowWidth(E) / 2;
  const int64_t I2 = Bf16RowWidth(gate_up_width / 2) / 2, A2 = Bf16RowWidth(attn_width) / 2;
  Workspace ws({T * E, T * E, rounded ? TP * E2 : T * E, T * qkv_width, T * attn_width, T * attn_width,
                rounded ? TP * A2 : 0, T * E, rounded ? 0 : T * gate_up_width,
                rounded ? TP * I2 : T * gate_up_width / 2, T * E});
  Rows normed_rows{ws[kNormed], nullptr}, activations{ws[kAct], nullptr};
  // the attention's rows rounded for the o product where the attention writes them so (AttentionBlockInto's Or)
  uint16_t* const attention_rounded = rounded ? reinterpret_cast<uint16_t*>(ws[kAttnRounded]) : nullptr;
  if (rounded) {
    normed_rows = {nullptr, reinterpret_cast<uint16_t*>(ws[kNormed])};
    activations = {nullptr, reinterpret_cast<uint16_t*>(ws[kAct])};
    std::memset(ws[kNormed] + T * E2, 0, (TP - T) * E2 * sizeof(float));
    std::memset(ws[kAttnRounded] + T * A2, 0, (TP - T) * A2 * sizeof(float));
    const int64_t narrowest = Bf16RowWidth(narrowest_gate_up / 2) / 2;
    std::memset(ws[kAct] + T * narrowest, 0, (TP * I2 - T * narrowest) * sizeof(float));
  }
  const float* h = hidden.data<float>();
  const float* delta = nullptr;
  const bool fold = FoldsResidual(kind, weights, comm.active());
  for (size_t i = 0; i < layers; ++i) {
    const paddle::Tensor* w = weights.data() + i * kSlots;
    const int64_t* m = meta.data() + i * kMeta;
    // The residual stream alternates between two rows: the norm's outputs overlap none of its inputs; where the
    // products fold it (fold), they write it (o into kSumB, down into kSumA) and the norms only read it.
    Norm(normed_rows, h, delta, w[kInNorm], T, E, eps, fold ? nullptr : ws[kSumA]);
    if (!fold) h = ws[kSumA];
    ProjectRows(kind, normed_rows, T, E, w, kQkv, m[0], ws[kQkvOut]);
    const bool attention_was_rounded =
        AttentionBlockInto(ws[kQkvOut], T, m[0], cos, sin, slots, k_caches[i], v_caches[i], tables, lengths, w[kQNorm],
                           w[kKNorm], num_heads, scale, m[4], eps, ws[kQuery], ws[kAttn], attention_rounded);
    const Rows attention{ws[kAttn], attention_was_rounded ? attention_rounded : nullptr};
    float* o = fold ? ws[kSumB] : ws[kOut];
    ProjectRows(kind, attention, T, attn_width, w, kO, m[1], o, fold ? h : nullptr);
    if (comm.active()) comm.AllReduce(o, T * m[1]);
    Norm(normed_rows, fold ? o : h, fold ? nullptr : o, w[kPostNorm], T, E, eps, fold ? nullptr : ws[kSumB]);
    h = ws[kSumB];
    GatedActivations(kind, normed_rows, T, E, w, m[2], ws[kGateUpOut], activations);
    o = fold ? ws[kSumA] : o;  // (unfolded: o is spent, the down product reuses it)
    ProjectRows(kind, activations, T, m[2] / 2, w, kDown, m[3], o, fold ? h : nullptr);
    if (comm.active()) comm.AllReduce(o, T * m[3]);
    if (fold) {
      h = o;
    } else {
      delta = o;
    }
  }
  auto normed = paddle::empty({T, E}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  AddRmsNormInto(h, delta, final_norm.data<float>(), T, E, eps, delta ? ws[kSumA] : nullptr, normed.data<float>());
  if (head_kind < 0) return {normed, paddle::empty({0}, paddle::DataType::FLOAT32, paddle::CPUPlace())};
  const int64_t R = last_rows.numel();
  PD_CHECK(R <= T, "decoder_layers: more last rows than rows");
  const int64_t* last = last_rows.data<int64_t>();
  float* rows = ws[kLast];
  for (int64_t r = 0; r < R; ++r) {
    PD_CHECK(last[r] >= 0 && last[r] < T, "decoder_layers: last row out of range");
    std::memcpy(rows + r * E, normed.data<float>() + last[r] * E, E * sizeof(float));
  }
  auto logits = paddle::empty({R, head_rows}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  Project(head_kind, rows, R, E, head.data(), 0, head_rows, logits.data<float>());
  return {normed, logits};
}

PD_BUILD_OP(fdcore_decoder_layers)
    .Inputs({"Hidden", "Cos", "Sin", "Slots", "Tables", "Lengths", "LastRows", paddle::Vec("KCaches"),
             paddle::Vec("VCaches"), paddle::Vec("Weights"), "FinalNorm", paddle::Vec("Head"), "GroupSegment"})
    .Outputs({"Normed", "Logits"})
    .Attrs({"meta: std::vector<int64_t>", "kind: int64_t", "num_heads: int64_t", "scale: float", "eps: float",
            "group: std::vector<int64_t>", "group_timeout: float", "head_kind: int64_t", "head_rows: int64_t"})
    .SetKernelFn(PD_KERNEL(DecoderLayers));
