// partition_by_owner on the GPU: a stable radix sort of the keys' owner ranks.
//
// One kernel computes every key's owner (as a 32-bit int) and the per-owner counts; CUB's
// radix sort, stable by definition, sorts (owner, input index) pairs over only the
// ceil(log2(world_size)) low bits; a last kernel moves the keys and writes positions.
// Every output size is known from the input, so nothing here waits on the device.
#include "cuda/cuda_api.h"

#include <cub/cub.cuh>

#include <algorithm>
#include <tuple>

#include "routing.h"

namespace sparsekit {

namespace {

constexpr int kThreads = 256;
// Owners counted in shared memory per block up to this world size (16 KiB of counters);
// beyond it each key adds to the global counts directly.
constexpr int64_t kSharedHistogramOwners = 4096;

int64_t blocks_for(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

template <typename key_t>
__global__ void owners_and_counts_kernel(const key_t* __restrict__ keys, int64_t n, int64_t world_size,
                                         int32_t* __restrict__ owners,
                                         unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int block_counts[];
  const bool shared_histogram = world_size <= kSharedHistogramOwners;
  if (shared_histogram) {
    for (int64_t owner = threadIdx.x; owner < world_size; owner += blockDim.x) block_counts[owner] = 0;
    __syncthreads();
  }
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t owner = owner_of_key(static_cast<int64_t>(keys[i]), world_size);
    owners[i] = static_cast<int32_t>(owner);
    if (shared_histogram) {
      atomicAdd(&block_counts[owner], 1u);
    } else {
      atomicAdd(&counts[owner], 1ull);
    }
  }
  if (shared_histogram) {
    __syncthreads();
    for (int64_t owner = threadIdx.x; owner < world_size; owner += blockDim.x) {
      if (block_counts[owner] != 0) atomicAdd(&counts[owner], static_cast<unsigned long long>(block_counts[owner]));
    }
  }
}

template <typename key_t>
__global__ void scatter_by_order_kernel(const key_t* __restrict__ keys, const int64_t* __restrict__ order,
                                        int64_t n, key_t* __restrict__ keys_by_owner,
                                        int64_t* __restrict__ positions) {
  for (int64_t slot = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; slot < n;
       slot += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t source = order[slot];
    keys_by_owner[slot] = keys[source];
    positions[source] = slot;
  }
}

int bits_for_owners(int64_t world_size) {
  int bits = 0;
  while ((int64_t{1} << bits) < world_size) ++bits;
  return bits;
}

}  // namespace

/// @brief Stable counting sort of keys by owner rank uint64(key) % world_size (see the
/// CPU kernel for the contract); outputs live on the keys' device.
std::tuple<Tensor, Tensor, Tensor> partition_by_owner_cuda(const Tensor& keys,
                                                                       int64_t world_size) {
  check_partition_by_owner_args(keys, world_size);
  DeviceGuard device_guard(keys.get_device_index());
  const Tensor keys_contig = as_contiguous(keys);
  const int64_t n = keys_contig.numel();
  if (world_size == 1) {
    return {torch::stable::clone(keys_contig), arange_cuda(n, keys), full_long_cuda(1, n, keys)};
  }
  Tensor counts = zeros_cuda({world_size}, kLong, keys.device());
  Tensor keys_by_owner = torch::stable::empty_like(keys_contig);
  Tensor positions = empty({n}, kLong, keys.device());
  if (n == 0) return {keys_by_owner, positions, counts};

  cudaStream_t stream = current_stream(keys);
  Tensor owners = empty({n}, kInt, keys.device());
  Tensor sorted_owners = empty({n}, kInt, keys.device());
  Tensor input_order = arange_cuda(n, keys);
  Tensor order = empty({n}, kLong, keys.device());
  const size_t shared_bytes = world_size <= kSharedHistogramOwners ? world_size * sizeof(unsigned int) : 0;

  SK_DISPATCH_INDEX_TYPES(keys_contig.scalar_type(), "partition_by_owner_cuda", [&] {
    owners_and_counts_kernel<index_t><<<blocks_for(n), kThreads, shared_bytes, stream>>>(
        keys_contig.const_data_ptr<index_t>(), n, world_size, owners.mutable_data_ptr<int32_t>(),
        reinterpret_cast<unsigned long long*>(counts.mutable_data_ptr<int64_t>()));
    SK_CUDA_KERNEL_LAUNCH_CHECK();

    const int end_bit = bits_for_owners(world_size);
    size_t temp_bytes = 0;
    SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, temp_bytes, owners.const_data_ptr<int32_t>(), sorted_owners.mutable_data_ptr<int32_t>(),
        input_order.const_data_ptr<int64_t>(), order.mutable_data_ptr<int64_t>(), n, 0, end_bit, stream));
    // At least one byte: a null temp pointer would make the second call a size query.
    Tensor temp = empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))}, kByte, keys.device());
    SK_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        temp.mutable_data_ptr(), temp_bytes, owners.const_data_ptr<int32_t>(),
        sorted_owners.mutable_data_ptr<int32_t>(), input_order.const_data_ptr<int64_t>(),
        order.mutable_data_ptr<int64_t>(), n, 0, end_bit, stream));

    scatter_by_order_kernel<index_t><<<blocks_for(n), kThreads, 0, stream>>>(
        keys_contig.const_data_ptr<index_t>(), order.const_data_ptr<int64_t>(), n,
        keys_by_owner.mutable_data_ptr<index_t>(), positions.mutable_data_ptr<int64_t>());
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {keys_by_owner, positions, counts};
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("partition_by_owner", TORCH_BOX(&partition_by_owner_cuda));
}

}  // namespace sparsekit
