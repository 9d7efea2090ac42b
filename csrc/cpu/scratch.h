#pragma once
// Grow-only scratch memory that a thread keeps between calls of a CPU kernel.
#include <cstddef>
#include <cstdlib>

#include "torch_api.h"

namespace sparsekit {

// Scratch kept by a thread between calls; above this it is freed after the call.
constexpr size_t kMaxKeptScratch = size_t{256} << 20;

/// @brief Memory a thread keeps between calls (up to kMaxKeptScratch): a fresh allocation
/// of a large buffer costs a page fault per 4 KiB, often about as much as the work done in
/// it. Not zeroed; the contents of one call are garbage to the next.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }

  void* get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      // Forgotten before the allocation: a failed one must not leave the old size with no
      // memory behind it (the next smaller request would get a null pointer).
      size_ = 0;
      data_ = std::malloc(bytes);
      SK_CHECK(data_ != nullptr, "out of memory for ", bytes, " bytes of scratch");
      size_ = bytes;
    }
    return data_;
  }

  /// Frees the memory when it is larger than what a thread keeps.
  void trim() {
    if (size_ > kMaxKeptScratch) {
      std::free(data_);
      data_ = nullptr;
      size_ = 0;
    }
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

/// @brief Trims a thread's scratch when the kernel leaves, by an error too: a call that
/// raises (a key out of range, an allocation refused) must not keep a large buffer for
/// the thread's later calls.
struct TrimOnExit {
  Scratch& scratch;
  ~TrimOnExit() { scratch.trim(); }
};

}  // namespace sparsekit
