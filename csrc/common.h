#pragma once
// Helpers shared by the CPU and CUDA kernels of sparsekit.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "torch_api.h"

namespace sparsekit {

/// @brief Bijective 64-bit mix (the splitmix64 finalizer): spreads clustered keys over
/// the whole table so linear probing stays short for sequential ids.
/// @param key any int64 value, sentinels included.
C10_HOST_DEVICE inline uint64_t mix_key(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// @brief Smallest power of two >= 2 * n (and >= 16): the slot count of a scratch hash
/// table that keeps its load factor at or below 0.5.
inline int64_t scratch_table_slots(int64_t n) {
  int64_t slots = 16;
  while (slots < 2 * n) slots <<= 1;
  return slots;
}

/// Sentinel of the "first bad position" slots: no bad bag / row seen.
constexpr int64_t kNoBadPosition = INT64_MAX;

/// @brief Checks the optional error slots of an op that records bad input instead of
/// raising: int64 [2] on `device`, the first bad bag (or bounds) and the first bad lookup so
/// far (kNoBadPosition: none); an op records there with the smaller position winning, so a
/// step on a GPU need not wait for the host.
inline void check_error_slots(const char* op, const std::optional<Tensor>& errors, const Device& device) {
  if (!errors.has_value()) return;
  SK_CHECK(errors->scalar_type() == kLong && errors->dim() == 1 && errors->size(0) == 2 && errors->is_contiguous() &&
               errors->device() == device,
           op, ": errors must be a contiguous int64 tensor [2] on ", device, ", got ", errors->scalar_type(),
           " of shape ", errors->sizes(), " on ", errors->device());
}

inline void check_key_tensor(const Tensor& keys, OpName op, const char* arg) {
  SK_CHECK(keys.scalar_type() == kLong || keys.scalar_type() == kInt, op, ": ", arg,
              " must be an int64 or int32 tensor of keys, got ", keys.scalar_type(),
              "; cast it with .long()");
}

inline void check_index_tensor(const Tensor& index, OpName op, const char* arg) {
  SK_CHECK(index.scalar_type() == kLong || index.scalar_type() == kInt, op, ": ", arg,
              " must be an int64 or int32 tensor, got ", index.scalar_type());
}

/// @brief The bytes a tensor spans, [begin, end): from its lowest-addressed element to its
/// highest, whatever the strides in between (a conservative extent for strided views).
inline std::pair<const char*, const char*> memory_span(const Tensor& t) {
  const char* base = static_cast<const char*>(t.const_data_ptr());
  int64_t low = 0, high = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d);
    (reach < 0 ? low : high) += reach;
  }
  const int64_t size = static_cast<int64_t>(t.element_size());
  return {base + low * size, base + (high + 1) * size};
}

/// @brief Whether the bytes two tensors span intersect (memory_span: a conservative test for
/// strided views).
inline bool memory_overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto [a_begin, a_end] = memory_span(a);
  const auto [b_begin, b_end] = memory_span(b);
  return a_begin < b_end && b_begin < a_end;
}

/// One tensor of a multi-table call for check_no_shared_writes: `arg` and `index` name it
/// (e.g. "count", 3 for count[3]); `written` when the op writes it.
struct TensorUse {
  const Tensor* tensor;
  const char* arg;
  size_t index;
  bool written;
};

/// @brief Raises naming `op` when a tensor the op writes shares memory with any other tensor
/// of the call (tensors it only reads may share memory among themselves: one rows tensor
/// for several tables). Each tensor counts by its memory_span.
/// One sort and one sweep, so calls with hundreds of tables stay cheap.
inline void check_no_shared_writes(const char* op, const std::vector<TensorUse>& uses) {
  struct Span {
    const char* begin;
    const char* end;
    size_t use;
  };
  std::vector<Span> spans;
  spans.reserve(uses.size());
  for (size_t u = 0; u < uses.size(); ++u) {
    if (uses[u].tensor->numel() == 0) continue;
    const auto [begin, end] = memory_span(*uses[u].tensor);
    spans.push_back({begin, end, u});
  }
  // Stable: tensors that start together are named in the order the call lists them.
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  // The furthest-reaching span so far, of any kind and of the written ones.
  const Span* furthest = nullptr;
  const Span* furthest_written = nullptr;
  for (const Span& span : spans) {
    const Span* other = uses[span.use].written ? furthest : furthest_written;
    if (other != nullptr && span.begin < other->end) {
      const TensorUse& a = uses[other->use];
      const TensorUse& b = uses[span.use];
      SK_CHECK(false, op, ": ", a.arg, "[", a.index, "] and ", b.arg, "[", b.index, "] share memory, and the op "
               "writes ", (a.written ? a.arg : b.arg), "; every tensor it writes must be one of its own");
    }
    if (furthest == nullptr || span.end > furthest->end) furthest = &span;
    if (uses[span.use].written && (furthest_written == nullptr || span.end > furthest_written->end)) {
      furthest_written = &span;
    }
  }
}

}  // namespace sparsekit
