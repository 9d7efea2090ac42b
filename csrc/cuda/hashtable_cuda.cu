// CUDA kernels of the open-addressing hash table (layout in csrc/hashtable.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

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

}  // namespace

/// @brief Looks keys up in the table (no host sync).
/// @param slot_keys int64[S], the key of each slot.
/// @param slot_rows int64[S], the row of each slot, -1 where empty.
/// @param keys int64 or int32 keys of any shape.
/// @return int64 rows with keys' shape, -1 where a key is absent.
at::Tensor hash_table_find_cuda(const at::Tensor& slot_keys, const at::Tensor& slot_rows, const at::Tensor& keys) {
  check_hash_table_find_args(slot_keys, slot_rows, keys);
  const c10::cuda::CUDAGuard device_guard(keys.device());
  const at::Tensor keys_c = keys.contiguous();
  at::Tensor rows = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  const int64_t num_keys = keys_c.numel();
  if (num_keys == 0) return rows;
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_find_cuda", [&] {
    find_kernel<index_t><<<blocks_for(num_keys), kThreads, 0, stream>>>(
        slot_keys.data_ptr<int64_t>(), slot_rows.data_ptr<int64_t>(), slot_mask, keys_c.data_ptr<index_t>(),
        rows.data_ptr<int64_t>(), num_keys);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
void hash_table_insert_absent_cuda(at::Tensor& slot_keys, at::Tensor& slot_rows, const at::Tensor& keys,
                                   const at::Tensor& rows, c10::optional<int64_t> num_occupied) {
  check_hash_table_insert_args(slot_keys, slot_rows, keys, rows);
  const c10::cuda::CUDAGuard device_guard(keys.device());
  const at::Tensor keys_c = keys.contiguous();
  const at::Tensor rows_c = rows.contiguous();
  const int64_t num_keys = keys_c.numel();
  if (num_keys == 0) return;
  const bool checked = !num_occupied.has_value();
  // Host sync (only without num_occupied): the count of occupied slots.
  if (checked) num_occupied = slot_rows.ge(0).sum().item<int64_t>();
  check_hash_insert_fits(*num_occupied, num_keys, slot_rows.size(0));
  at::Tensor error = at::zeros({1}, keys.options().dtype(at::kInt));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = blocks_for(num_keys);
  check_rows_kernel<<<blocks, kThreads, 0, stream>>>(rows_c.data_ptr<int64_t>(), num_keys, error.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  AT_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_insert_absent_cuda", [&] {
    insert_kernel<index_t><<<blocks, kThreads, 0, stream>>>(
        slot_keys.data_ptr<int64_t>(), slot_rows.data_ptr<int64_t>(), slot_keys.size(0), keys_c.data_ptr<index_t>(),
        rows_c.data_ptr<int64_t>(), num_keys, error.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // Host sync (only without num_occupied): the row check's flag. With the fit checked
  // above, kHashInsertTableFull cannot be set.
  if (checked) raise_hash_insert_error(error.item<int32_t>());
}

/// @brief Erases keys from the table: their slots become tombstones (no host sync).
/// @param slot_keys int64[S].
/// @param slot_rows int64[S], written in place.
/// @param keys int64 or int32 keys, distinct (absent ones are skipped).
/// @return int64 rows the keys held, -1 for an absent key.
at::Tensor hash_table_erase_cuda(const at::Tensor& slot_keys, at::Tensor& slot_rows, const at::Tensor& keys) {
  check_hash_table_erase_args(slot_keys, slot_rows, keys);
  const c10::cuda::CUDAGuard device_guard(keys.device());
  const at::Tensor keys_long = keys.contiguous().to(at::kLong);
  at::Tensor rows = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  const int64_t num_keys = keys_long.numel();
  if (num_keys == 0) return rows;
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  // Two launches: every key is found before any slot is marked, so a mark can never
  // hide a slot another thread is still probing for.
  erase_kernel<int64_t><<<blocks_for(num_keys), kThreads, 0, stream>>>(
      slot_keys.data_ptr<int64_t>(), slot_rows.data_ptr<int64_t>(), slot_mask, keys_long.data_ptr<int64_t>(),
      rows.data_ptr<int64_t>(), num_keys);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  mark_tombstones_kernel<<<blocks_for(num_keys), kThreads, 0, stream>>>(
      slot_keys.data_ptr<int64_t>(), slot_rows.data_ptr<int64_t>(), slot_mask, rows.data_ptr<int64_t>(), num_keys,
      keys_long.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return rows;
}

TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) {
  m.impl("hash_table_find", &hash_table_find_cuda);
  m.impl("hash_table_erase_", &hash_table_erase_cuda);
  m.impl("hash_table_insert_absent_", &hash_table_insert_absent_cuda);
}

}  // namespace sparsekit
