// A thread's scratch memory that starts on a cache line (64 bytes). std::vector's own memory does not: glibc
// serves a large allocation by mmap, 16 bytes past a page boundary, so every 64-byte row an AMX tile or an
// AVX-512 vector loaded from it, or a tile stored to it, straddled two lines. Measured on an AMX Xeon (1 thread,
// the two alternating call by call in one process): a 512-token SmolLM2 prompt's bfloat16 attention 0.86-0.91x
// the time with its scores and weights in a LineBuffer; its o and qkv products on float32 input (rounded into
// one) 0.79-0.83x.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

template <typename T>
class LineBuffer {
 public:
  // Room for n values from a 64-byte boundary (grown, never shrunk; its contents are not kept across calls).
  T* Get(size_t n) {
    storage_.resize(n + kLine / sizeof(T));
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(storage_.data()) + kLine - 1) & ~uintptr_t{kLine - 1});
  }

 private:
  static constexpr size_t kLine = 64;
  std::vector<T> storage_;
};
