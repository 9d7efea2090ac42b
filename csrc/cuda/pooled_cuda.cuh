#pragma once
// What the pooled read (pooled_cuda.cu) and its gradient and fused update
// (pooled_backward_cuda.cu) share: launch sizes, the errors slots and their read back.
// In an anonymous namespace: each translation unit has its own copy, kernel included, so
// nothing is defined twice at link.
#include "cuda/cuda_api.h"

#include <algorithm>
#include <cstdint>
#include <optional>

#include "pooled.h"

namespace sparsekit {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// Features whose pointers one launch takes by value (the read, the backward's grouping).
constexpr int kFeaturesPerLaunch = 32;

__device__ __forceinline__ void record_min(long long* slot, int64_t position) {
  atomicMin(reinterpret_cast<unsigned long long*>(slot), static_cast<unsigned long long>(position));
}

inline int64_t blocks_for(int64_t threads) {
  return std::max<int64_t>(1, std::min<int64_t>((threads + kThreads - 1) / kThreads, int64_t{1} << 20));
}

/// @brief The errors slots of a call: the caller's, or a fresh pair read back at the end.
Tensor error_slots(const std::optional<Tensor>& errors, const Tensor& like, cudaStream_t stream) {
  if (errors.has_value()) return *errors;
  Tensor slots = empty({2}, kLong, like.device());
  SK_CUDA_CHECK(cudaMemsetAsync(slots.mutable_data_ptr(), 0x7F, 2 * sizeof(int64_t), stream));
  // 0x7F... in every byte: INT64_MAX's neighbour, above every position (kNoBadPosition's role).
  return slots;
}

/// @brief Without the caller's slots: the op's one host read, then the CPU kernel's errors.
void raise_recorded(const char* op, const std::optional<Tensor>& errors, const Tensor& slots, const Tensor& offsets,
                    const Tensor& rows, const PooledLayout& layout) {
  if (errors.has_value()) return;
  const Tensor host = cpu(slots);
  const int64_t bad_bag = host.const_data_ptr<int64_t>()[0];
  const int64_t bad_position = host.const_data_ptr<int64_t>()[1];
  const int64_t bags = layout.num_features * layout.batch;
  if (bad_bag < bags + 1 && bad_bag >= 0) {
    fail(pooled_offsets_message(op, bad_bag, item_at(offsets, bad_bag), item_at(offsets, bad_bag + 1), layout.nnz));
  }
  if (bad_position < layout.nnz && bad_position >= 0) {
    // The bag of the bad lookup names its table (the error path reads the offsets back).
    const Tensor host_offsets = cpu(offsets);
    const int64_t* first = host_offsets.const_data_ptr<int64_t>();
    const int64_t bag = std::max<int64_t>(0, (std::upper_bound(first, first + bags + 1, bad_position) - first) - 1);
    const int64_t t = layout.feature_tables[std::min(bag, bags - 1) / std::max<int64_t>(layout.batch, 1)];
    fail(pooled_row_message(op, bad_position, item_at(rows, bad_position), t, t >= 0 ? layout.table_rows[t] : 0));
  }
}

/// @brief Bag 0 stands for a batch of no bags whose offsets or lookups are bad.
__global__ void check_no_bags_kernel(const int64_t* offsets, int64_t nnz, long long* errors) {
  if (offsets[0] != 0 || nnz != 0) record_min(errors, 0);
}

}  // namespace
}  // namespace sparsekit
