// CUDA kernels of the open-addressing hash table (layout in csrc/hashtable.h).
#include "cuda/cuda_api.h"

#include <algorithm>
#include <tuple>
#include <vector>

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

// Segments (a collection's features) whose tables one launch of lookup_rows or
// hash_table_touch_tables_ takes by value; their bounds stay on the device (the launch
// reads bounds[first .. first + count]), so nothing is read back and a CUDA graph of the
// call stays right for a batch of other lengths.
constexpr int kSegmentsPerLaunch = 32;

struct RowSegments {
  const int64_t* slot_keys[kSegmentsPerLaunch];
  const int64_t* slot_rows[kSegmentsPerLaunch];
  uint64_t slot_mask[kSegmentsPerLaunch];
  int64_t direct_rows[kSegmentsPerLaunch];
  int kind[kSegmentsPerLaunch];  // 0: hash table, 1: direct, 2: left to the caller
  int first;
  int count;
};

/// Stores `value` at *verdict when the bounds do not run from 0 to n without decreasing.
__global__ void check_bounds_kernel(const int64_t* __restrict__ bounds, int64_t num_segments, int64_t n,
                                    int64_t* verdict, int64_t value) {
  if (blockIdx.x == 0 && threadIdx.x == 0 && !segment_bounds_valid(bounds, num_segments, n)) *verdict = value;
}

/// The launch's bounds, bounds[first .. first + count], into shared memory (valid bounds).
__device__ __forceinline__ void load_bounds(int64_t* shared, const int64_t* bounds, int first, int count) {
  for (int j = threadIdx.x; j <= count; j += blockDim.x) shared[j] = bounds[first + j];
  __syncthreads();
}

/// The launch's segment holding entry i, or -1 when another launch's segment holds it.
__device__ __forceinline__ int segment_of(const int64_t* begin, int count, int64_t i) {
  if (i < begin[0] || i >= begin[count]) return -1;
  int s = 0;
  while (s + 1 < count && begin[s + 1] <= i) ++s;
  return s;
}

template <typename key_t>
__global__ void lookup_rows_kernel(RowSegments segments, const int64_t* __restrict__ bounds,
                                   const key_t* __restrict__ keys, int64_t n, int64_t* __restrict__ rows,
                                   unsigned long long* __restrict__ report) {
  __shared__ int64_t begin[kSegmentsPerLaunch + 1];
  load_bounds(begin, bounds, segments.first, segments.count);
  const bool bad_bounds = report[2] != 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (bad_bounds) {  // recorded: every row -1, written by the first launch
      if (segments.first == 0 && rows != nullptr) rows[i] = -1;
      continue;
    }
    const int s = segment_of(begin, segments.count, i);
    if (s < 0) continue;
    const int64_t key = static_cast<int64_t>(keys[i]);
    if (segments.kind[s] == 0) {
      const int64_t row = probe_find(segments.slot_keys[s], segments.slot_rows[s], segments.slot_mask[s], key);
      rows[i] = row;
      if (row < 0) atomicAdd(report + 1, 1ULL);
    } else if (segments.kind[s] == 1) {
      const bool inside = static_cast<uint64_t>(key) < static_cast<uint64_t>(segments.direct_rows[s]);
      if (rows != nullptr) rows[i] = inside ? key : -2;  // null: write_rows=False, only the report
      if (!inside) atomicMin(report, static_cast<unsigned long long>(i));
    } else {
      rows[i] = -3;
    }
  }
}

struct TouchSegments {
  int64_t* last_seen[kSegmentsPerLaunch];
  int64_t* count[kSegmentsPerLaunch];
  unsigned int* seen_bits[kSegmentsPerLaunch];  // the table's bitmap (shared by its segments)
  int64_t size[kSegmentsPerLaunch];
  int64_t clock[kSegmentsPerLaunch];
  int scored[kSegmentsPerLaunch];
  int first;
  int count_segments;
};

/// Records (slot 1) the first row outside [-1, size) of a scored segment.
__global__ void check_touch_kernel(TouchSegments segments, const int64_t* __restrict__ bounds,
                                   const int64_t* __restrict__ rows, int64_t n, int64_t* __restrict__ slots) {
  __shared__ int64_t begin[kSegmentsPerLaunch + 1];
  if (slots[0] != kNoBadPosition) return;  // bad bounds: recorded, the rows' segments unknown
  load_bounds(begin, bounds, segments.first, segments.count_segments);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int s = segment_of(begin, segments.count_segments, i);
    if (s >= 0 && segments.scored[s] && (rows[i] < -1 || rows[i] >= segments.size[s])) {
      atomicMin(reinterpret_cast<unsigned long long*>(slots + 1), static_cast<unsigned long long>(i));
    }
  }
}

/// The first lookup of a row (its bit set first) scores it, unless the slots hold an error.
__global__ void touch_kernel(TouchSegments segments, const int64_t* __restrict__ bounds,
                             const int64_t* __restrict__ rows, int64_t n, const int64_t* __restrict__ slots) {
  __shared__ int64_t begin[kSegmentsPerLaunch + 1];
  if (slots[0] != kNoBadPosition || slots[1] != kNoBadPosition) return;
  load_bounds(begin, bounds, segments.first, segments.count_segments);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int s = segment_of(begin, segments.count_segments, i);
    if (s < 0) continue;
    const int64_t row = rows[i];
    if (!segments.scored[s] || row < 0) continue;
    const unsigned int bit = 1u << (row & 31);
    // Read first (from L2, where the atomics land): a hot row of skewed keys then costs one
    // atomic, not one per lookup serialised on its word. A stale 0 only falls to the atomic.
    unsigned int* word = segments.seen_bits[s] + (row >> 5);
    if ((__ldcg(word) & bit) || (atomicOr(word, bit) & bit)) continue;
    segments.last_seen[s][row] = segments.clock[s];
    segments.count[s][row] += 1;
  }
}

}  // namespace

/// @brief The row of every value of a collection's batch (see the schema): no host sync;
/// the first position of a key outside its direct table, the count of absent keys and the
/// bounds' verdict come back in an int64 [3] tensor.
std::tuple<Tensor, Tensor> lookup_rows_cuda(const std::vector<Tensor>& slot_keys, const std::vector<Tensor>& slot_rows,
                                            const Tensor& keys, const Tensor& bounds,
                                            const std::vector<int64_t>& segment_tables,
                                            const std::vector<int64_t>& direct_rows, bool write_rows) {
  const char* op = "lookup_rows";
  SK_CHECK(slot_keys.size() == slot_rows.size(), op, ": slot_keys holds ", slot_keys.size(), " tables but slot_rows ",
           slot_rows.size());
  check_key_tensor(keys, op, "keys");
  SK_CHECK(keys.dim() == 1, op, ": keys must be 1-D, got shape ", keys.sizes());
  for (size_t t = 0; t < slot_keys.size(); ++t) {
    check_hash_table_find_args(slot_keys[t], slot_rows[t], keys, OpName(op, static_cast<int64_t>(t)));
  }
  const size_t num_segments = segment_tables.size();
  SK_CHECK(direct_rows.size() == num_segments, op, ": segment_tables (", num_segments, ") and direct_rows (",
           direct_rows.size(), ") must hold one entry per segment");
  check_segment_bounds_arg(op, bounds, num_segments, keys.device());
  for (size_t s = 0; s < num_segments; ++s) {
    SK_CHECK(segment_tables[s] >= -2 && segment_tables[s] < static_cast<int64_t>(slot_keys.size()), op,
             ": segment_tables[", s, "] must lie in [-2, ", slot_keys.size(), "), got ", segment_tables[s]);
    SK_CHECK(write_rows || segment_tables[s] == -1, op, ": write_rows=False needs every segment direct, but "
             "segment_tables[", s, "] is ", segment_tables[s]);
  }
  const DeviceGuard device_guard(keys.get_device_index());
  const cudaStream_t stream = current_stream(keys);
  const Tensor keys_c = as_contiguous(keys);
  const Tensor bounds_c = as_contiguous(bounds);
  const int64_t n = keys_c.numel();
  Tensor rows = empty({write_rows ? n : 0}, kLong, keys.device());
  Tensor report = full_long_cuda(3, n, keys);
  int64_t* report_ptr = report.mutable_data_ptr<int64_t>();
  SK_CUDA_CHECK(cudaMemsetAsync(report_ptr + 1, 0, 2 * sizeof(int64_t), stream));
  check_bounds_kernel<<<1, 1, 0, stream>>>(bounds_c.const_data_ptr<int64_t>(), static_cast<int64_t>(num_segments), n,
                                           report_ptr + 2, 1);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  if (n == 0) return {rows, report};
  for (size_t first = 0; first < std::max<size_t>(num_segments, 1); first += kSegmentsPerLaunch) {
    RowSegments segments{};
    segments.first = static_cast<int>(first);
    for (size_t s = first; s < std::min(num_segments, first + kSegmentsPerLaunch); ++s) {
      const int i = segments.count++;
      const int64_t t = segment_tables[s];
      segments.kind[i] = t >= 0 ? 0 : (t == -1 ? 1 : 2);
      segments.slot_keys[i] = t >= 0 ? slot_keys[t].const_data_ptr<int64_t>() : nullptr;
      segments.slot_rows[i] = t >= 0 ? slot_rows[t].const_data_ptr<int64_t>() : nullptr;
      segments.slot_mask[i] = t >= 0 ? static_cast<uint64_t>(slot_keys[t].size(0) - 1) : 0;
      segments.direct_rows[i] = direct_rows[s];
    }
    SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "lookup_rows_cuda", [&] {
      lookup_rows_kernel<index_t><<<blocks_for(n), kThreads, 0, stream>>>(
          segments, bounds_c.const_data_ptr<int64_t>(), keys_c.const_data_ptr<index_t>(), n,
          write_rows ? rows.mutable_data_ptr<int64_t>() : nullptr, reinterpret_cast<unsigned long long*>(report_ptr));
      SK_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return {rows, report};
}

/// @brief Scores each distinct row a batch read once per table (see the schema). With the
/// caller's error slots no host sync; without, one: the checks' read back (bad bounds or a
/// bad row score nothing and raise).
void hash_table_touch_tables_cuda(const std::vector<Tensor>& last_seen, const std::vector<Tensor>& count,
                                  const Tensor& rows, const Tensor& bounds, const std::vector<int64_t>& segment_tables,
                                  const std::vector<int64_t>& sizes, const std::vector<int64_t>& clocks,
                                  const std::optional<Tensor>& errors) {
  const char* op = "hash_table_touch_tables_";
  const size_t num_tables = count.size();
  SK_CHECK(last_seen.size() == num_tables && sizes.size() == num_tables && clocks.size() == num_tables, op,
           ": last_seen, count, sizes and clocks must hold one entry per table");
  SK_CHECK(rows.scalar_type() == kLong && rows.dim() == 1, op, ": rows must be 1-D int64, got ", rows.scalar_type(),
           " with shape ", rows.sizes());
  for (size_t t = 0; t < num_tables; ++t) {
    SK_CHECK(last_seen[t].scalar_type() == kLong && count[t].scalar_type() == kLong && last_seen[t].dim() == 1 &&
                 count[t].dim() == 1 && last_seen[t].size(0) == count[t].size(0) && last_seen[t].is_contiguous() &&
                 count[t].is_contiguous() && last_seen[t].device() == rows.device() &&
                 count[t].device() == rows.device(),
             op, ": last_seen[", t, "] and count[", t, "] must be contiguous 1-D int64 tensors of one length on the "
             "rows' device");
    SK_CHECK(sizes[t] >= 0 && sizes[t] <= count[t].size(0), op, ": sizes[", t, "] must lie in [0, ",
             count[t].size(0), "], got ", sizes[t]);
  }
  const size_t num_segments = segment_tables.size();
  check_segment_bounds_arg(op, bounds, num_segments, rows.device());
  check_error_slots(op, errors, rows.device());
  for (size_t s = 0; s < num_segments; ++s) {
    SK_CHECK(segment_tables[s] >= -1 && segment_tables[s] < static_cast<int64_t>(num_tables), op,
             ": segment_tables[", s, "] must lie in [-1, ", num_tables, "), got ", segment_tables[s]);
  }
  std::vector<TensorUse> uses{{&rows, "rows", 0, false}};
  for (size_t t = 0; t < num_tables; ++t) {
    uses.push_back({&last_seen[t], "last_seen", t, true});
    uses.push_back({&count[t], "count", t, true});
  }
  if (errors.has_value()) uses.push_back({&*errors, "errors", 0, true});
  check_no_shared_writes(op, uses);
  const DeviceGuard device_guard(rows.get_device_index());
  const cudaStream_t stream = current_stream(rows);
  const Tensor rows_c = as_contiguous(rows);
  const Tensor bounds_c = as_contiguous(bounds);
  const int64_t* bounds_ptr = bounds_c.const_data_ptr<int64_t>();
  const int64_t n = rows_c.numel();
  Tensor slots = errors.has_value() ? *errors : full_long_cuda(2, kNoBadPosition, rows);
  int64_t* slots_ptr = slots.mutable_data_ptr<int64_t>();
  check_bounds_kernel<<<1, 1, 0, stream>>>(bounds_ptr, static_cast<int64_t>(num_segments), n, slots_ptr, 0);
  SK_CUDA_KERNEL_LAUNCH_CHECK();
  std::vector<int64_t> word_base(num_tables + 1, 0);
  for (size_t t = 0; t < num_tables; ++t) word_base[t + 1] = word_base[t] + (sizes[t] + 31) / 32;
  Tensor bits = zeros_cuda({std::max<int64_t>(1, word_base[num_tables])}, kInt, rows.device());
  unsigned int* bits_ptr = reinterpret_cast<unsigned int*>(bits.mutable_data_ptr<int32_t>());
  std::vector<TouchSegments> launches;
  for (size_t first = 0; first < num_segments && n > 0; first += kSegmentsPerLaunch) {
    TouchSegments segments{};
    segments.first = static_cast<int>(first);
    for (size_t s = first; s < std::min(num_segments, first + kSegmentsPerLaunch); ++s) {
      const int i = segments.count_segments++;
      const int64_t t = segment_tables[s];
      segments.scored[i] = t >= 0;
      segments.last_seen[i] = t >= 0 ? last_seen[t].mutable_data_ptr<int64_t>() : nullptr;
      segments.count[i] = t >= 0 ? count[t].mutable_data_ptr<int64_t>() : nullptr;
      segments.seen_bits[i] = t >= 0 ? bits_ptr + word_base[t] : nullptr;
      segments.size[i] = t >= 0 ? sizes[t] : 0;
      segments.clock[i] = t >= 0 ? clocks[t] : 0;
    }
    launches.push_back(segments);
  }
  // Every row checked before any is scored: the check launches, then the scoring ones.
  for (const TouchSegments& segments : launches) {
    check_touch_kernel<<<blocks_for(n), kThreads, 0, stream>>>(segments, bounds_ptr, rows_c.const_data_ptr<int64_t>(),
                                                               n, slots_ptr);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (const TouchSegments& segments : launches) {
    touch_kernel<<<blocks_for(n), kThreads, 0, stream>>>(segments, bounds_ptr, rows_c.const_data_ptr<int64_t>(), n,
                                                         slots_ptr);
    SK_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (errors.has_value()) return;
  // Without the caller's slots, the documented host sync: bad bounds or a bad row raise.
  const Tensor verdict = cpu(slots);
  const int64_t bad_bounds = verdict.const_data_ptr<int64_t>()[0];
  const int64_t bad = verdict.const_data_ptr<int64_t>()[1];
  if (bad_bounds == kNoBadPosition && bad == kNoBadPosition) return;
  const Tensor host = cpu(bounds_c);
  const std::vector<int64_t> offsets(host.const_data_ptr<int64_t>(), host.const_data_ptr<int64_t>() + host.numel());
  if (bad_bounds != kNoBadPosition) raise_segment_bounds(op, offsets, n);
  const int64_t s = std::upper_bound(offsets.begin(), offsets.end(), bad) - offsets.begin() - 1;
  fail(op, ": rows[", bad, "] = ", item_at(rows_c, bad), " of table ", segment_tables[s],
       " is outside its rows [-1, ", sizes[segment_tables[s]], ")");
}

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
/// Host syncs: two without num_occupied (the room check, the row check); none with it, the
/// caller then vouching for rows >= 0 (a negative row makes the call write nothing).
/// @param slot_keys, slot_rows int64[S], written in place.
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
  m.impl("lookup_rows", TORCH_BOX(&lookup_rows_cuda));
  m.impl("hash_table_touch_tables_", TORCH_BOX(&hash_table_touch_tables_cuda));
  m.impl("hash_table_find", TORCH_BOX(&hash_table_find_cuda));
  m.impl("hash_table_erase_", TORCH_BOX(&hash_table_erase_cuda));
  m.impl("hash_table_insert_absent_", TORCH_BOX(&hash_table_insert_absent_cuda));
}

}  // namespace sparsekit
