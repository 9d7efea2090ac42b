// Hash-based unique on the GPU, in order of first occurrence.
// The scratch table stores positions into `keys` (every int64 is a valid key), lowered by
// atomicMin, so each slot ends at its key's first occurrence whatever the schedule; a scan
// of first occurrences numbers the ids. Counts aggregate per tile in shared memory (a hot
// key would serialise global atomics). The one host sync reads the unique count back.
#include "cuda/cuda_api.h"

#include <cub/cub.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include "common.h"

namespace sparsekit {
namespace {

constexpr int kInsertThreads = 256;
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;  // grid-stride beyond this
// Outputs kernel: a block owns a tile of kOutputThreads * kOutputItems positions and counts
// them in a shared table twice that size (load <= 0.5), flushed with one global atomic per
// distinct id per tile.
constexpr int kOutputThreads = 256;
constexpr int kOutputItems = 8;
constexpr int64_t kOutputTile = int64_t{kOutputThreads} * kOutputItems;
constexpr int kCountSlotBits = 12;
constexpr int kCountSlots = 1 << kCountSlotBits;
constexpr int kCountProbes = 16;  // then fall back to a global atomic: still exact

// 32-bit positions and slot indices while both fit: n <= 2^30 gives at most 2^31 slots.
constexpr int64_t kMaxNarrowKeys = int64_t{1} << 30;

__device__ __forceinline__ int32_t atomic_cas(int32_t* address, int32_t expected, int32_t desired) {
  return atomicCAS(address, expected, desired);
}
__device__ __forceinline__ int64_t atomic_cas(int64_t* address, int64_t expected, int64_t desired) {
  return static_cast<int64_t>(atomicCAS(reinterpret_cast<unsigned long long*>(address),
                                        static_cast<unsigned long long>(expected),
                                        static_cast<unsigned long long>(desired)));
}
__device__ __forceinline__ void atomic_min(int32_t* address, int32_t value) { atomicMin(address, value); }
__device__ __forceinline__ void atomic_min(int64_t* address, int64_t value) {
  atomicMin(reinterpret_cast<long long*>(address), static_cast<long long>(value));
}

/// @brief Phase 1: places every position in its key's slot; a slot keeps the smallest
/// position of its key. slot_of[i] receives the slot of keys[i].
/// Why it is race-free: a slot goes from -1 to a position of one key and then only lowers
/// that position, so a stale read is either -1 (the CAS then returns the real holder) or a
/// position of the same key (at worst one redundant atomicMin). Probing is linear and
/// nothing is ever removed, so two threads with the same key walk the same slots and meet.
template <typename key_t, typename pos_t>
__global__ void __launch_bounds__(kInsertThreads)
    insert_positions_kernel(const key_t* __restrict__ keys, int64_t n, pos_t* table, uint64_t mask,
                            pos_t* __restrict__ slot_of) {
  constexpr pos_t kEmpty = -1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const key_t key = keys[i];
    const pos_t me = static_cast<pos_t>(i);
    uint64_t slot = mix_key(static_cast<int64_t>(key)) & mask;
    while (true) {
      // A volatile read: other threads CAS this slot concurrently (a stale -1 only sends
      // this thread to the CAS, which sees the truth).
      pos_t held = *reinterpret_cast<volatile pos_t*>(table + slot);
      if (held == kEmpty) {
        held = atomic_cas(table + slot, kEmpty, me);
        if (held == kEmpty) break;  // claimed an empty slot
      }
      if (keys[held] == key) {
        if (me < held) atomic_min(table + slot, me);
        break;
      }
      slot = (slot + 1) & mask;  // load <= 0.5: an empty slot is always ahead
    }
    slot_of[i] = static_cast<pos_t>(slot);
  }
}

/// Scan input: 1 at a position that its slot kept (a first occurrence), else 0.
template <typename pos_t>
struct IsFirstOccurrence {
  const pos_t* table;
  const pos_t* slot_of;
  __host__ __device__ pos_t operator()(int64_t i) const {
    return table[slot_of[i]] == static_cast<pos_t>(i) ? pos_t{1} : pos_t{0};
  }
};

/// @brief Phase 3: inverse[i] = id of keys[i]; unique_keys[id] = keys[i] at first
/// occurrences; counts[id] += occurrences, pre-aggregated per tile in shared memory.
/// counts must be zero on entry.
template <typename key_t, typename pos_t>
__global__ void __launch_bounds__(kOutputThreads)
    write_outputs_kernel(const key_t* __restrict__ keys, int64_t n, const pos_t* __restrict__ table,
                         const pos_t* __restrict__ slot_of, const pos_t* __restrict__ first_rank,
                         key_t* __restrict__ unique_keys, int64_t* __restrict__ inverse,
                         int64_t* __restrict__ counts) {
  constexpr pos_t kEmpty = -1;
  __shared__ pos_t tile_ids[kCountSlots];
  __shared__ unsigned int tile_counts[kCountSlots];
  for (int s = threadIdx.x; s < kCountSlots; s += blockDim.x) {
    tile_ids[s] = kEmpty;
    tile_counts[s] = 0;
  }

  // All loads first, so each thread has kOutputItems independent gathers in flight.
  const int64_t tile_begin = static_cast<int64_t>(blockIdx.x) * kOutputTile;
  pos_t first[kOutputItems];
#pragma unroll
  for (int k = 0; k < kOutputItems; ++k) {
    const int64_t i = tile_begin + k * kOutputThreads + threadIdx.x;
    first[k] = i < n ? table[slot_of[i]] : kEmpty;
  }
  pos_t id[kOutputItems];
#pragma unroll
  for (int k = 0; k < kOutputItems; ++k) id[k] = first[k] != kEmpty ? first_rank[first[k]] - 1 : kEmpty;
  __syncthreads();  // shared table initialised

#pragma unroll
  for (int k = 0; k < kOutputItems; ++k) {
    const int64_t i = tile_begin + k * kOutputThreads + threadIdx.x;
    if (i >= n) break;
    inverse[i] = static_cast<int64_t>(id[k]);
    if (first[k] == static_cast<pos_t>(i)) unique_keys[id[k]] = keys[i];
    // Fibonacci hashing: the ids first seen in a tile are consecutive, and an identity
    // hash would pack them into one long run that pushes hot ids past kCountProbes.
    unsigned int slot = (static_cast<unsigned int>(id[k]) * 2654435769u) >> (32 - kCountSlotBits);
    bool counted = false;
    for (int probe = 0; probe < kCountProbes; ++probe) {
      // Always the CAS (a plain read first would race with the other threads' CAS, which
      // compute-sanitizer's racecheck reports): the old value says claimed, ours, or taken.
      const pos_t held = atomic_cas(&tile_ids[slot], kEmpty, id[k]);
      if (held == kEmpty || held == id[k]) {
        atomicAdd(&tile_counts[slot], 1u);
        counted = true;
        break;
      }
      slot = (slot + 1) & (kCountSlots - 1);
    }
    if (!counted) atomicAdd(reinterpret_cast<unsigned long long*>(counts + id[k]), 1ull);
  }
  __syncthreads();

  for (int s = threadIdx.x; s < kCountSlots; s += blockDim.x) {
    const pos_t held = tile_ids[s];
    if (held != kEmpty) {
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + held),
                static_cast<unsigned long long>(tile_counts[s]));
    }
  }
}

template <typename key_t, typename pos_t>
void unique_launch(const Tensor& keys, Tensor& unique_keys, Tensor& inverse, Tensor& counts) {
  const int64_t n = keys.numel();
  const cudaStream_t stream = current_stream(keys);
  const ScalarType pos_dtype = scalar_type_of<pos_t>();
  const key_t* key_ptr = keys.mutable_data_ptr<key_t>();

  const int64_t num_slots = scratch_table_slots(n);
  Tensor table = empty({num_slots}, pos_dtype, keys.device());
  Tensor slot_of = empty({n}, pos_dtype, keys.device());
  Tensor first_rank = empty({n}, pos_dtype, keys.device());
  pos_t* table_ptr = table.mutable_data_ptr<pos_t>();
  pos_t* slot_of_ptr = slot_of.mutable_data_ptr<pos_t>();
  pos_t* first_rank_ptr = first_rank.mutable_data_ptr<pos_t>();

  // All-ones bytes are -1 in two's complement: the empty slot.
  SK_CUDA_CHECK(cudaMemsetAsync(table_ptr, 0xFF, num_slots * sizeof(pos_t), stream));
  const int64_t insert_blocks = std::min<int64_t>((n + kInsertThreads - 1) / kInsertThreads, kMaxGridBlocks);
  insert_positions_kernel<key_t, pos_t><<<static_cast<unsigned int>(insert_blocks), kInsertThreads, 0, stream>>>(
      key_ptr, n, table_ptr, static_cast<uint64_t>(num_slots - 1), slot_of_ptr);
  SK_CUDA_KERNEL_LAUNCH_CHECK();

  auto is_first = thrust::make_transform_iterator(thrust::make_counting_iterator<int64_t>(0),
                                                  IsFirstOccurrence<pos_t>{table_ptr, slot_of_ptr});
  const pos_t num_items = static_cast<pos_t>(n);  // n fits pos_t by the choice of pos_t
  size_t temp_bytes = 0;
  SK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, temp_bytes, is_first, first_rank_ptr, num_items, stream));
  // At least one byte: a null temp pointer would make the second call a size query.
  Tensor temp = empty({std::max<int64_t>(1, static_cast<int64_t>(temp_bytes))}, kByte, keys.device());
  SK_CUDA_CHECK(cub::DeviceScan::InclusiveSum(temp.data_ptr(), temp_bytes, is_first, first_rank_ptr, num_items,
                                               stream));

  // The one host sync of unique: the output sizes depend on the number of unique keys.
  // torch's own device-to-host copy, so torch.cuda.set_sync_debug_mode sees it like
  // torch's own syncs.
  const pos_t num_unique = *cpu(slice0(first_rank, n - 1, n)).const_data_ptr<pos_t>();

  unique_keys = empty({static_cast<int64_t>(num_unique)}, keys.scalar_type(), keys.device());
  counts = zeros_cuda({static_cast<int64_t>(num_unique)}, kLong, keys.device());
  const int64_t output_blocks = (n + kOutputTile - 1) / kOutputTile;
  SK_CHECK(output_blocks <= std::numeric_limits<int32_t>::max(), "unique: ", n, " keys need ", output_blocks,
           " output blocks, more than a CUDA grid holds");
  write_outputs_kernel<key_t, pos_t><<<static_cast<unsigned int>(output_blocks), kOutputThreads, 0, stream>>>(
      key_ptr, n, table_ptr, slot_of_ptr, first_rank_ptr, unique_keys.mutable_data_ptr<key_t>(),
      inverse.mutable_data_ptr<int64_t>(), counts.mutable_data_ptr<int64_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
}

/// @brief Hash-based unique of a CUDA tensor of int32/int64 keys (any shape, read flattened).
/// @param keys_in keys; every int64 value is valid.
/// @return (unique_keys [U] of keys' dtype in order of first occurrence, inverse int64 of
/// keys' shape with keys == unique_keys[inverse], counts int64 [U]). Syncs the host once.
std::tuple<Tensor, Tensor, Tensor> unique_cuda(const Tensor& keys_in) {
  check_key_tensor(keys_in, "unique", "keys");
  SK_CHECK(keys_in.is_cuda(), "unique: expected a CUDA tensor, got ", keys_in.device());
  const DeviceGuard guard(keys_in.get_device_index());
  const Tensor keys = as_contiguous(keys_in);
  const int64_t n = keys.numel();
  Tensor unique_keys = empty({0}, keys.scalar_type(), keys.device());
  Tensor inverse = empty(keys.sizes(), kLong, keys.device());
  Tensor counts = empty({0}, kLong, keys.device());
  if (n == 0) return {unique_keys, inverse, counts};
  SK_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_cuda", [&] {
    using key_t = index_t;
    if (n <= kMaxNarrowKeys) {
      unique_launch<key_t, int32_t>(keys, unique_keys, inverse, counts);
    } else {
      unique_launch<key_t, int64_t>(keys, unique_keys, inverse, counts);
    }
  });
  return {unique_keys, inverse, counts};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("unique", TORCH_BOX(&unique_cuda));
}

}  // namespace sparsekit
