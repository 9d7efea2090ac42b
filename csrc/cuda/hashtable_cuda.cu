// CUDA kernels of the open-addressing hash table (layout in csrc/hashtable.h).
#include "cuda/cuda_api.h"

#include "hashtable.h"

namespace sparsekit {
namespace {

constexpr int kThreads = 256;

inline int64_t blocks_for(int64_t n) {
  // Grid-stride loops cover the rest; 2^20 blocks are plenty to fill any GPU.
  return std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20);
}

template <typename key_t>
__global__ void find_kernel(const int64_t* __restrict__ slot_keys, const int64_t* __restrict__ slot_rows,
                            uint64_t slot_mask, const key_t* __restrict__ keys, int64_t* __restrict__ rows_out,
                            int64_t num_keys) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_keys;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t key = static_cast<int64_t>(keys[i]);
    rows_out[i] = probe_find(slot_keys, slot_rows, slot_mask, key);
  }
}

__global__ void check_rows_kernel(const int64_t* __restrict__ rows, int64_t num_keys, int32_t* error) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_keys;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (rows[i] < 0) *error = kHashInsertNegativeRow;
  }
}

template <typename key_t>
__global__ void insert_kernel(int64_t* __restrict__ slot_keys, int64_t* __restrict__ slot_rows, int64_t num_slots,
                              const key_t* __restrict__ keys, const int64_t* __restrict__ rows, int64_t num_keys,
                              int32_t* error) {
  // A bad row seen by check_rows_kernel: leave the table unchanged.
  if (*error != kHashInsertOk) return;
  const uint64_t slot_mask = static_cast<uint64_t>(num_slots - 1);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_keys;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t key = static_cast<int64_t>(keys[i]);
    const auto row = static_cast<unsigned long long>(rows[i]);
    uint64_t slot = mix_key(key) & slot_mask;
    bool placed = false;
    // At most num_slots probes: a full table must raise, not hang the GPU.
    for (int64_t probe = 0; probe < num_slots; ++probe) {
      auto* cell = reinterpret_cast<unsigned long long*>(slot_rows + slot);
      // An empty slot or a tombstone is free. Claiming the row field makes the slot ours;
      // the key is written after, which is safe because finds run in later launches,
      // never concurrently.
      auto seen = static_cast<long long>(*reinterpret_cast<volatile long long*>(slot_rows + slot));
      while (seen < 0) {
        const auto before = atomicCAS(cell, static_cast<unsigned long long>(seen), row);
        if (before == static_cast<unsigned long long>(seen)) {
          slot_keys[slot] = key;
          placed = true;
          break;
        }
        seen = static_cast<long long>(before);
      }
      if (placed) break;
      slot = (slot + 1) & slot_mask;
    }
    if (!placed) *error = kHashInsertTableFull;
  }
}

template <typename key_t>
__global__ void erase_kernel(const int64_t* __restrict__ slot_keys, int64_t* __restrict__ slot_rows,
                             uint64_t slot_mask, const key_t* __restrict__ keys, int64_t* __restrict__ rows_out,
                             int64_t num_keys) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_keys;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = probe_slot(slot_keys, slot_rows, slot_mask, static_cast<int64_t>(keys[i]));
    rows_out[i] = slot < 0 ? kEmptySlotRow : slot_rows[slot];
  }
}

__global__ void mark_tombstones_kernel(const int64_t* __restrict__ slot_keys, int64_t* __restrict__ slot_rows,
                                       uint64_t slot_mask, const int64_t* __restrict__ rows, int64_t num_keys,
                                       const int64_t* __restrict__ keys_as_long) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_keys;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (rows[i] < 0) continue;
    // The key still sits in its slot with its row (erase_kernel only read): find it again.
    const int64_t slot = probe_slot(slot_keys, slot_rows, slot_mask, keys_as_long[i]);
    if (slot >= 0) slot_rows[slot] = kTombstoneRow;
  }
}

__global__ void count_occupied_kernel(const int64_t* __restrict__ slot_rows, int64_t num_slots,
                                      unsigned long long* __restrict__ count) {
  unsigned long long mine = 0;
  for (int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; s < num_slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    mine += slot_rows[s] >= 0;
  }
  if (mine) atomicAdd(count, mine);
}

/// @brief The number of occupied slots (rows >= 0), on the host: a sync.
int64_t count_occupied(const Tensor& slot_rows) {
  const int64_t num_slots = slot_rows.size(0);
  const DeviceGuard device_guard(slot_rows.get_device_index());
  Tensor count = zeros_cuda({1}, kLong, slot_rows.device());
  const cudaStream_t stream = current_stream(slot_rows);
  count_occupied_kernel<<<std::min<int64_t>(blocks_for(num_slots), 1024), kThreads, 0, stream>>>(
      slot_rows.const_data_ptr<int64_t>(), num_slots,
      reinterpret_cast<unsigned long long*>(count.mutable_data_ptr<int64_t>()));
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  return *cpu(count).const_data_ptr<int64_t>();
}

}  // namespace

/// @brief Looks keys up in the table (no host sync).
/// @param slot_keys int64[S], the key of each slot.
/// @param slot_rows int64[S], the row of each slot, -1 where empty.
/// @param keys int64 or int32 keys of any shape.
/// @return int64 rows with keys' shape, -1 where a key is absent.
Tensor hash_table_find_cuda(const Tensor& slot_keys, const Tensor& slot_rows, const Tensor& keys) {
  check_hash_table_find_args(slot_keys, slot_rows, keys);
  const DeviceGuard device_guard(keys.get_device_index());
  const Tensor keys_c = as_contiguous(keys);
  Tensor rows = empty(keys.sizes(), kLong, keys.device());
  const int64_t num_keys = keys_c.numel();
  if (num_keys == 0) return rows;
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  const cudaStream_t stream = current_stream(keys);
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_find_cuda", [&] {
    find_kernel<index_t><<<blocks_for(num_keys), kThreads, 0, stream>>>(
        slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_mask, keys_c.mutable_data_ptr<index_t>(),
        rows.mutable_data_ptr<int64_t>(), num_keys);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return rows;
}

/// @brief Places distinct keys that are absent from the table; slot of keys[i] gets rows[i].
///
/// Without num_occupied: two host syncs, one to count the occupied slots (so a call that
/// does not fit raises before anything is written) and one to read the row check's flag.
/// With num_occupied (sparsekit.HashTable passes its size, and rows it made itself,
/// arange(size, size + n)): none; the caller then also vouches for rows >= 0 (a negative
/// row makes the call write nothing, without raising).
/// @param slot_keys int64[S], written in place.
/// @param slot_rows int64[S], written in place.
/// @param keys int64 or int32 keys, distinct and absent from the table (not checked).
/// @param rows int64 rows (>= 0), one per key.
/// @param num_occupied occupied slots when the caller knows them; None: counted here.
void hash_table_insert_absent_cuda(Tensor& slot_keys, Tensor& slot_rows, const Tensor& keys,
                                   const Tensor& rows, std::optional<int64_t> num_occupied) {
  check_hash_table_insert_args(slot_keys, slot_rows, keys, rows);
  const DeviceGuard device_guard(keys.get_device_index());
  const Tensor keys_c = as_contiguous(keys);
  const Tensor rows_c = as_contiguous(rows);
  const int64_t num_keys = keys_c.numel();
  if (num_keys == 0) return;
  const bool checked = !num_occupied.has_value();
  // Host sync (only without num_occupied): the count of occupied slots.
  if (checked) num_occupied = count_occupied(slot_rows);
  check_hash_insert_fits(*num_occupied, num_keys, slot_rows.size(0));
  Tensor error = zeros_cuda({1}, kInt, keys.device());
  const cudaStream_t stream = current_stream(keys);
  const int64_t blocks = blocks_for(num_keys);
  check_rows_kernel<<<blocks, kThreads, 0, stream>>>(rows_c.mutable_data_ptr<int64_t>(), num_keys, error.mutable_data_ptr<int32_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_insert_absent_cuda", [&] {
    insert_kernel<index_t><<<blocks, kThreads, 0, stream>>>(
        slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_keys.size(0), keys_c.mutable_data_ptr<index_t>(),
        rows_c.mutable_data_ptr<int64_t>(), num_keys, error.mutable_data_ptr<int32_t>());
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // Host sync (only without num_occupied): the row check's flag. With the fit checked
  // above, kHashInsertTableFull cannot be set.
  if (checked) raise_hash_insert_error(*cpu(error).const_data_ptr<int32_t>());
}

/// @brief Erases keys from the table: their slots become tombstones (no host sync).
/// @param slot_keys int64[S].
/// @param slot_rows int64[S], written in place.
/// @param keys int64 or int32 keys, distinct (absent ones are skipped).
/// @return int64 rows the keys held, -1 for an absent key.
Tensor hash_table_erase_cuda(const Tensor& slot_keys, Tensor& slot_rows, const Tensor& keys) {
  check_hash_table_erase_args(slot_keys, slot_rows, keys);
  const DeviceGuard device_guard(keys.get_device_index());
  const Tensor keys_long = as_contiguous(to_dtype(keys, kLong));
  Tensor rows = empty(keys.sizes(), kLong, keys.device());
  const int64_t num_keys = keys_long.numel();
  if (num_keys == 0) return rows;
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  const cudaStream_t stream = current_stream(keys);
  // Two launches: every key is found before any slot is marked, so a mark can never
  // hide a slot another thread is still probing for.
  erase_kernel<int64_t><<<blocks_for(num_keys), kThreads, 0, stream>>>(
      slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_mask, keys_long.mutable_data_ptr<int64_t>(),
      rows.mutable_data_ptr<int64_t>(), num_keys);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  mark_tombstones_kernel<<<blocks_for(num_keys), kThreads, 0, stream>>>(
      slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_mask, rows.mutable_data_ptr<int64_t>(), num_keys,
      keys_long.mutable_data_ptr<int64_t>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  return rows;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("hash_table_find", TORCH_BOX(&hash_table_find_cuda));
  m.impl("hash_table_erase_", TORCH_BOX(&hash_table_erase_cuda));
  m.impl("hash_table_insert_absent_", TORCH_BOX(&hash_table_insert_absent_cuda));
}

}  // namespace sparsekit
