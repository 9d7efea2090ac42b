// CPU kernels of the open-addressing hash table (layout in csrc/hashtable.h).
#include <algorithm>
#include <atomic>
#include <functional>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu/parallel.h"

#include "hashtable.h"

namespace sparsekit {
namespace {

// Keys per parallel_for task: probing is cheap, so small grains would spend more time
// scheduling than working.
constexpr int64_t kHashGrain = 4096;

// Keys ahead whose home slots are prefetched: a table larger than the cache costs two
// misses per key (its row and key arrays), which this many lookups in flight hide.
// Tuned by benchmarks/bench_hashtable.py.
constexpr int64_t kFindPrefetchDistance = 64;
// Slots from which the prefetch pays: below, both arrays (16 bytes a slot) sit in a 2 MiB
// cache and the hints only cost instructions. Tuned by benchmarks/bench_hashtable.py.
constexpr uint64_t kFindPrefetchSlots = uint64_t{1} << 17;
// Rows ahead whose scores the scoring pass prefetches, and the table size from which it
// does (two 8-byte scores a row: 2^16 rows fill 1 MiB).
constexpr int64_t kScorePrefetchDistance = 16;
constexpr int64_t kScorePrefetchRows = int64_t{1} << 16;

/// @brief Prefetches the home slot (both arrays) of keys[i + kFindPrefetchDistance] while
/// that key lies before `end`: for reading in a find (the table does not change then),
/// kWrite for a placing.
template <bool kWrite, typename key_t>
inline void prefetch_home_slot_ahead(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask,
                                     const key_t* keys, int64_t i, int64_t end) {
  if (i + kFindPrefetchDistance < end) {
    const uint64_t ahead = mix_key(static_cast<int64_t>(keys[i + kFindPrefetchDistance])) & slot_mask;
    __builtin_prefetch(slot_rows + ahead, kWrite, 1);
    __builtin_prefetch(slot_keys + ahead, kWrite, 1);
  }
}

template <bool kPrefetch, typename key_t>
void find_range(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask, const key_t* keys,
                int64_t* rows_out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (kPrefetch) prefetch_home_slot_ahead<false>(slot_keys, slot_rows, slot_mask, keys, i, end);
    rows_out[i] = probe_find(slot_keys, slot_rows, slot_mask, static_cast<int64_t>(keys[i]));
  }
}

/// @brief find_range with the prefetching loop where the table is large enough to pay for it.
template <typename key_t>
void find_range_in(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask, const key_t* keys,
                   int64_t* rows_out, int64_t begin, int64_t end) {
  if (slot_mask + 1 >= kFindPrefetchSlots) {
    find_range<true>(slot_keys, slot_rows, slot_mask, keys, rows_out, begin, end);
  } else {
    find_range<false>(slot_keys, slot_rows, slot_mask, keys, rows_out, begin, end);
  }
}

template <typename key_t>
void find_keys(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask, const key_t* keys,
               int64_t* rows_out, int64_t num_keys) {
  parallel_for(0, num_keys, kHashGrain, [&](int64_t begin, int64_t end) {
    find_range_in(slot_keys, slot_rows, slot_mask, keys, rows_out, begin, end);
  });
}

/// @brief What placing one key changed: the slot it claimed (-1: none) and what that slot
/// held before (its row field, -1 empty or -2 tombstone, and its key field).
struct PlacedSlot {
  int64_t slot;
  int64_t row;
  int64_t key;
};

/// @brief Stores `key` with `row` in the first free slot (empty or tombstone) of its probe
/// sequence and records in `placed` what it overwrote; false when every slot was visited
/// without one.
inline bool place_key(int64_t* slot_keys, int64_t* slot_rows, uint64_t slot_mask, int64_t key, int64_t row,
                      PlacedSlot& placed) {
  uint64_t slot = mix_key(key) & slot_mask;
  // At most num_slots probes: a full table must raise, not spin forever.
  for (uint64_t probe = 0; probe <= slot_mask; ++probe) {
    // An empty slot or a tombstone is free. Claiming the row field makes the slot ours;
    // the key is written after, which is safe because finds never run concurrently with
    // an insert.
    int64_t seen = __atomic_load_n(&slot_rows[slot], __ATOMIC_RELAXED);
    while (seen < 0) {
      if (__atomic_compare_exchange_n(&slot_rows[slot], &seen, row, /*weak=*/false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        placed = {static_cast<int64_t>(slot), seen, slot_keys[slot]};
        slot_keys[slot] = key;
        return true;
      }
    }
    slot = (slot + 1) & slot_mask;
  }
  return false;
}

/// @brief A placing's prefetch_home_slot_ahead, for writing, where the table is large enough
/// to miss the caches (as find_range_in decides): placing a key in a cold table costs two
/// misses a key without it.
template <typename key_t>
inline void prefetch_slot_ahead(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask,
                                const key_t* keys, int64_t i, int64_t end) {
  if (slot_mask + 1 >= kFindPrefetchSlots) {
    prefetch_home_slot_ahead<true>(slot_keys, slot_rows, slot_mask, keys, i, end);
  }
}

/// @brief Puts back every slot a failed placing claimed, so the call changes nothing. A
/// placing fails only when the caller's occupancy (num_occupied, sizes) understates the
/// slots in use: the room check before it trusts that count.
inline void undo_placed(int64_t* slot_keys, int64_t* slot_rows, const PlacedSlot& placed) {
  if (placed.slot < 0) return;
  slot_rows[placed.slot] = placed.row;
  slot_keys[placed.slot] = placed.key;
}

template <typename key_t>
int32_t insert_keys(int64_t* slot_keys, int64_t* slot_rows, int64_t num_slots, const key_t* keys,
                    const int64_t* rows, int64_t num_keys) {
  const uint64_t slot_mask = static_cast<uint64_t>(num_slots - 1);
  std::atomic<int32_t> error{kHashInsertOk};
  std::vector<PlacedSlot> placed(num_keys, PlacedSlot{-1, 0, 0});
  parallel_for(0, num_keys, kHashGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      prefetch_slot_ahead(slot_keys, slot_rows, slot_mask, keys, i, end);
      if (!place_key(slot_keys, slot_rows, slot_mask, static_cast<int64_t>(keys[i]), rows[i], placed[i])) {
        error.store(kHashInsertTableFull, std::memory_order_relaxed);
        return;
      }
    }
  });
  if (error.load() != kHashInsertOk) {
    for (const PlacedSlot& p : placed) undo_placed(slot_keys, slot_rows, p);
  }
  return error.load();
}

}  // namespace

/// @brief Looks keys up in the table.
/// @param slot_keys int64[S], the key of each slot.
/// @param slot_rows int64[S], the row of each slot, -1 where empty.
/// @param keys int64 or int32 keys of any shape.
/// @return int64 rows with keys' shape, -1 where a key is absent.
Tensor hash_table_find_cpu(const Tensor& slot_keys, const Tensor& slot_rows, const Tensor& keys) {
  check_hash_table_find_args(slot_keys, slot_rows, keys);
  const Tensor keys_c = as_contiguous(keys);
  Tensor rows = empty(keys.sizes(), kLong, keys.device());
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_find_cpu", [&] {
    find_keys<index_t>(slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_mask,
                       keys_c.mutable_data_ptr<index_t>(), rows.mutable_data_ptr<int64_t>(), keys_c.numel());
  });
  return rows;
}

/// @brief Places distinct keys that are absent from the table; slot of keys[i] gets rows[i].
/// @param slot_keys int64[S], written in place.
/// @param slot_rows int64[S], written in place.
/// @param keys int64 or int32 keys, distinct and absent from the table (not checked).
/// @param rows int64 rows (>= 0), one per key.
/// @param num_occupied occupied slots when the caller knows them (sparsekit.HashTable: its
///        size); None: counted here (one pass over the slots).
void hash_table_insert_absent_cpu(Tensor& slot_keys, Tensor& slot_rows, const Tensor& keys,
                                  const Tensor& rows, std::optional<int64_t> num_occupied) {
  check_hash_table_insert_args(slot_keys, slot_rows, keys, rows);
  const Tensor keys_c = as_contiguous(keys);
  const Tensor rows_c = as_contiguous(rows);
  const int64_t num_keys = keys_c.numel();
  if (num_keys == 0) return;
  const int64_t num_slots = slot_rows.size(0);
  if (!num_occupied.has_value()) {
    const int64_t* slot_rows_ptr = slot_rows.mutable_data_ptr<int64_t>();
    std::vector<int64_t> counts(chunk_workers(num_slots, kHashGrain * 16), 0);
    parallel_chunks_indexed(num_slots, kHashGrain * 16, [&](int64_t worker, int64_t begin, int64_t end) {
      int64_t count = 0;
      for (int64_t s = begin; s < end; ++s) count += slot_rows_ptr[s] >= 0;
      counts[worker] += count;
    });
    num_occupied = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  }
  check_hash_insert_fits(*num_occupied, num_keys, num_slots);
  const int64_t* rows_ptr = rows_c.mutable_data_ptr<int64_t>();
  // Validate every row before touching the table, so a bad call leaves it unchanged.
  std::atomic<bool> negative_row{false};
  parallel_for(0, num_keys, kHashGrain * 4, [&](int64_t begin, int64_t end) {
    bool bad = false;
    for (int64_t i = begin; i < end; ++i) bad |= rows_ptr[i] < 0;
    if (bad) negative_row.store(true, std::memory_order_relaxed);
  });
  if (negative_row.load()) raise_hash_insert_error(kHashInsertNegativeRow);
  int32_t error = kHashInsertOk;
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_insert_absent_cpu", [&] {
    error = insert_keys<index_t>(slot_keys.mutable_data_ptr<int64_t>(), slot_rows.mutable_data_ptr<int64_t>(), slot_keys.size(0),
                                 keys_c.mutable_data_ptr<index_t>(), rows_ptr, num_keys);
  });
  raise_hash_insert_error(error);
}

/// @brief Erases keys from the table: their slots become tombstones.
/// @param slot_keys int64[S].
/// @param slot_rows int64[S], written in place.
/// @param keys int64 or int32 keys, distinct (absent ones are skipped).
/// @return int64 rows the keys held, -1 for an absent key.
Tensor hash_table_erase_cpu(const Tensor& slot_keys, Tensor& slot_rows, const Tensor& keys) {
  check_hash_table_erase_args(slot_keys, slot_rows, keys);
  const Tensor keys_c = as_contiguous(keys);
  Tensor rows = empty(keys.sizes(), kLong, keys.device());
  const uint64_t slot_mask = static_cast<uint64_t>(slot_keys.size(0) - 1);
  const int64_t* skeys = slot_keys.mutable_data_ptr<int64_t>();
  int64_t* srows = slot_rows.mutable_data_ptr<int64_t>();
  int64_t* out = rows.mutable_data_ptr<int64_t>();
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_erase_cpu", [&] {
    const index_t* k = keys_c.mutable_data_ptr<index_t>();
    // Every key is probed first, then the slots are marked: a concurrent mark never
    // changes another key's probe (a tombstone does not end a sequence), but keeping the
    // phases apart keeps the reads plain.
    std::vector<int64_t> slots(keys_c.numel());
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        slots[i] = probe_slot(skeys, srows, slot_mask, static_cast<int64_t>(k[i]));
        out[i] = slots[i] < 0 ? kEmptySlotRow : srows[slots[i]];
      }
    });
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (slots[i] >= 0) srows[slots[i]] = kTombstoneRow;
      }
    });
  });
  return rows;
}

namespace {

/// @brief Checks the CSR `offsets` of `num_tables` tables over `n` entries: offsets[0] == 0,
/// never decreasing, offsets[num_tables] == n.
void check_table_offsets(const std::vector<int64_t>& offsets, size_t num_tables, int64_t n, const char* op) {
  SK_CHECK(offsets.size() == num_tables + 1, op, ": offsets must hold one more entry than there are tables (",
           num_tables + 1, "), got ", offsets.size());
  if (C10_LIKELY(segment_bounds_valid(offsets.data(), static_cast<int64_t>(num_tables), n))) return;
  // Invalid: which rule it breaks, in the words of the multi-table ops' offsets.
  SK_CHECK(offsets.front() == 0 && offsets.back() == n, op, ": offsets must run from 0 to ", n, ", got ",
           offsets.front(), " .. ", offsets.back());
  for (size_t t = 0; t < num_tables; ++t) {
    SK_CHECK(offsets[t] <= offsets[t + 1], op, ": offsets must never decrease, got offsets[", t, "] = ", offsets[t],
             " > offsets[", t + 1, "] = ", offsets[t + 1]);
  }
}

/// @brief The segment bounds (checked by check_segment_bounds_arg) as host values.
std::vector<int64_t> host_bounds(const Tensor& bounds) {
  const Tensor b = as_contiguous(bounds);
  const int64_t* p = b.const_data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + b.numel());
}

}  // namespace

/// @brief hash_table_find over several tables: keys[offsets[t] : offsets[t + 1]] in table t.
/// @param slot_keys, slot_rows the tables' slot arrays (one pair per table).
/// @param keys int64 or int32 [n], grouped by table.
/// @param offsets [T + 1] CSR bounds of each table's keys.
/// @return int64 [n] rows, -1 where a key is absent from its table.
Tensor hash_table_find_tables_cpu(const std::vector<Tensor>& slot_keys, const std::vector<Tensor>& slot_rows,
                                  const Tensor& keys, const std::vector<int64_t>& offsets) {
  SK_CHECK(slot_keys.size() == slot_rows.size(), "hash_table_find_tables: slot_keys holds ", slot_keys.size(),
           " tables but slot_rows ", slot_rows.size(), "; give both arrays of every table");
  check_key_tensor(keys, "hash_table_find_tables", "keys");
  SK_CHECK(keys.dim() == 1, "hash_table_find_tables: keys must be 1-D, got shape ", keys.sizes());
  for (size_t t = 0; t < slot_keys.size(); ++t) {
    check_hash_table_find_args(slot_keys[t], slot_rows[t], keys,
                               OpName("hash_table_find_tables", static_cast<int64_t>(t)));
  }
  check_table_offsets(offsets, slot_keys.size(), keys.numel(), "hash_table_find_tables");
  const Tensor keys_c = as_contiguous(keys);
  Tensor rows = empty(keys.sizes(), kLong, keys.device());
  std::vector<const int64_t*> skeys, srows;
  std::vector<uint64_t> masks;
  for (size_t t = 0; t < slot_keys.size(); ++t) {
    skeys.push_back(slot_keys[t].const_data_ptr<int64_t>());
    srows.push_back(slot_rows[t].const_data_ptr<int64_t>());
    masks.push_back(static_cast<uint64_t>(slot_keys[t].size(0) - 1));
  }
  int64_t* out = rows.mutable_data_ptr<int64_t>();
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_find_tables_cpu", [&] {
    const index_t* k = keys_c.const_data_ptr<index_t>();
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
        find_range_in(skeys[t], srows[t], masks[t], k, out, b, e);
      });
    });
  });
  return rows;
}

/// @brief Scores the rows several tables were asked for: for rows[i] of table t (i in
/// [offsets[t], offsets[t + 1])), last_seen[t][rows[i]] = clocks[t] and count[t][rows[i]]
/// += 1; -1 (an absent key) is skipped. Every row is checked before anything is written.
void hash_table_score_tables_cpu(const std::vector<Tensor>& last_seen, const std::vector<Tensor>& count, const Tensor& rows,
                                 const std::vector<int64_t>& offsets, const std::vector<int64_t>& clocks) {
  const char* op = "hash_table_score_tables_";
  SK_CHECK(last_seen.size() == count.size() && clocks.size() == count.size(), op, ": last_seen (",
           last_seen.size(), "), count (", count.size(), ") and clocks (", clocks.size(),
           ") must hold one entry per table");
  SK_CHECK(rows.scalar_type() == kLong && rows.dim() == 1, op, ": rows must be 1-D int64, got ",
           rows.scalar_type(), " with shape ", rows.sizes());
  for (size_t t = 0; t < count.size(); ++t) {
    SK_CHECK(last_seen[t].scalar_type() == kLong && count[t].scalar_type() == kLong && last_seen[t].dim() == 1 &&
                 count[t].dim() == 1 && last_seen[t].size(0) == count[t].size(0) && last_seen[t].is_contiguous() &&
                 count[t].is_contiguous(),
             op, ": last_seen[", t, "] and count[", t, "] must be contiguous 1-D int64 tensors of one length");
    SK_CHECK(last_seen[t].device() == rows.device() && count[t].device() == rows.device(), op,
             ": table ", t, "'s scores are not on the rows' device (", rows.device(), ")");
  }
  check_table_offsets(offsets, count.size(), rows.numel(), op);
  std::vector<TensorUse> uses{{&rows, "rows", 0, false}};
  for (size_t t = 0; t < count.size(); ++t) {
    uses.push_back({&last_seen[t], "last_seen", t, true});
    uses.push_back({&count[t], "count", t, true});
  }
  check_no_shared_writes(op, uses);
  const Tensor rows_c = as_contiguous(rows);
  const int64_t* r = rows_c.const_data_ptr<int64_t>();
  std::atomic<int64_t> bad{rows_c.numel()};
  // Whether every table's rows strictly ascend (a collection scores its distinct rows in
  // sorted order): then no row repeats, no two tasks share a score, and the writes below
  // need no atomics (a lock-prefixed add per row is costly).
  std::atomic<bool> ascending{true};
  parallel_for(0, rows_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
    bool rising = true;
    for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
      const int64_t size = count[t].size(0);
      const int64_t first = offsets[t];
      for (int64_t i = b; i < e; ++i) {
        if (r[i] < -1 || r[i] >= size) {
          int64_t seen = bad.load(std::memory_order_relaxed);
          while (i < seen && !bad.compare_exchange_weak(seen, i, std::memory_order_relaxed)) {
          }
          return;
        }
        rising &= i == first || r[i] > r[i - 1];
      }
    });
    if (!rising) ascending.store(false, std::memory_order_relaxed);
  });
  const int64_t first_bad = bad.load();
  if (first_bad < rows_c.numel()) {
    const int64_t t =
        std::upper_bound(offsets.begin(), offsets.end(), first_bad) - offsets.begin() - 1;
    SK_CHECK(false, op, ": rows[", first_bad, "] = ", r[first_bad], " of table ", t,
             " is outside its scores [-1, ", count[t].size(0), ")");
  }
  std::vector<int64_t*> seen_ptr, count_ptr;
  for (size_t t = 0; t < count.size(); ++t) {
    seen_ptr.push_back(last_seen[t].mutable_data_ptr<int64_t>());
    count_ptr.push_back(count[t].mutable_data_ptr<int64_t>());
  }
  auto score = [&](auto distinct) {
    parallel_for(0, rows_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
        const bool prefetch = count[t].size(0) >= kScorePrefetchRows;
        int64_t* seen = seen_ptr[t];
        int64_t* counts = count_ptr[t];
        const int64_t clock = clocks[t];
        for (int64_t i = b; i < e; ++i) {
          if (prefetch && i + kScorePrefetchDistance < e) {
            const int64_t ahead = r[i + kScorePrefetchDistance];
            if (ahead >= 0) {
              __builtin_prefetch(seen + ahead, 1, 1);
              __builtin_prefetch(counts + ahead, 1, 1);
            }
          }
          const int64_t row = r[i];
          if (row < 0) continue;
          if constexpr (decltype(distinct)::value) {
            seen[row] = clock;
            counts[row] += 1;
          } else {
            // A row repeated across two tasks: the stamp is the same value, the count atomic.
            __atomic_store_n(&seen[row], clock, __ATOMIC_RELAXED);
            __atomic_fetch_add(&counts[row], 1, __ATOMIC_RELAXED);
          }
        }
      });
    });
  };
  if (ascending.load()) {
    score(std::true_type{});
  } else {
    score(std::false_type{});
  }
}

/// @brief The row of every value of a collection's batch: segment s (keys[offsets[s] :
/// offsets[s + 1]], a feature's values) is found in hash table segment_tables[s] (-1 where
/// absent), or is the key itself for a direct table (segment_tables[s] == -1 with
/// direct_rows[s] rows; -2 for a key outside [0, direct_rows[s])), or is left -3
/// (segment_tables[s] == -2: the caller resolves it). Also returns, as an int64 [2], the first
/// position of a key outside its direct table (keys.numel() when there is none) and the
/// number of keys absent from their hash table.
std::tuple<Tensor, Tensor> lookup_rows_cpu(const std::vector<Tensor>& slot_keys, const std::vector<Tensor>& slot_rows,
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
  const std::vector<int64_t> offsets = host_bounds(bounds);
  const Tensor keys_c = as_contiguous(keys);
  Tensor rows = empty({write_rows ? keys_c.numel() : 0}, kLong, keys.device());
  Tensor first_bad = empty({3}, kLong, keys.device());
  int64_t* report = first_bad.mutable_data_ptr<int64_t>();
  if (!segment_bounds_valid(offsets.data(), static_cast<int64_t>(num_segments), keys_c.numel())) {
    // Recorded, as the CUDA kernel must without a host read: every row -1.
    std::fill(rows.mutable_data_ptr<int64_t>(), rows.mutable_data_ptr<int64_t>() + rows.numel(), int64_t{-1});
    report[0] = keys_c.numel();
    report[1] = 0;
    report[2] = 1;
    return {rows, first_bad};
  }
  std::atomic<int64_t> bad{keys_c.numel()};
  std::atomic<int64_t> absent{0};
  int64_t* out = rows.mutable_data_ptr<int64_t>();
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "lookup_rows_cpu", [&] {
    const index_t* k = keys_c.const_data_ptr<index_t>();
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t s, int64_t b, int64_t e) {
        const int64_t t = segment_tables[s];
        if (t >= 0) {
          find_range_in(slot_keys[t].const_data_ptr<int64_t>(), slot_rows[t].const_data_ptr<int64_t>(),
                        static_cast<uint64_t>(slot_keys[t].size(0) - 1), k, out, b, e);
          int64_t missing = 0;
          for (int64_t i = b; i < e; ++i) missing += out[i] < 0;
          if (missing) absent.fetch_add(missing, std::memory_order_relaxed);
        } else if (t == -1) {
          const uint64_t bound = static_cast<uint64_t>(direct_rows[s]);
          int64_t first = INT64_MAX;
          // A key u (as uint64) lies outside [0, bound) iff the top bit of u | ~(u - bound) is
          // set (bound < 2^63): adds, nots and ors, which baseline x86-64 vectorizes where its
          // vectors have no 64-bit compare. The first key outside is then found by a scan.
          uint64_t outside = 0;
          if (write_rows) {
            constexpr uint64_t kOutside = static_cast<uint64_t>(int64_t{-2});
            for (int64_t i = b; i < e; ++i) {
              const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(k[i]));
              const uint64_t is_outside = (u | ~(u - bound)) >> 63;
              out[i] = static_cast<int64_t>(u ^ ((u ^ kOutside) & (uint64_t{0} - is_outside)));  // -2 or u
              outside |= is_outside << 63;
            }
          } else {
            for (int64_t i = b; i < e; ++i) {
              const uint64_t u = static_cast<uint64_t>(static_cast<int64_t>(k[i]));
              outside |= u | ~(u - bound);
            }
          }
          for (int64_t i = b; (outside >> 63) != 0 && i < e; ++i) {
            if (static_cast<uint64_t>(static_cast<int64_t>(k[i])) >= bound) {
              first = i;
              break;
            }
          }
          int64_t seen = bad.load(std::memory_order_relaxed);
          while (first < seen && !bad.compare_exchange_weak(seen, first, std::memory_order_relaxed)) {
          }
        } else {
          std::fill(out + b, out + e, int64_t{-3});
        }
      });
    });
  });
  report[0] = bad.load();
  report[1] = absent.load();
  report[2] = 0;
  return {rows, first_bad};
}

/// @brief Scores the rows a collection's batch read, each distinct row of a table once
/// (however often the batch read it): last_seen = the table's clock, count += 1. Segment s
/// (rows[offsets[s] : offsets[s + 1]]) reads table segment_tables[s] (-1: not scored here);
/// rows of -1 are skipped. Every row is checked against sizes[t] (the table's keys) before
/// anything is written.
void hash_table_touch_tables_cpu(const std::vector<Tensor>& last_seen, const std::vector<Tensor>& count,
                                 const Tensor& rows, const Tensor& bounds, const std::vector<int64_t>& segment_tables,
                                 const std::vector<int64_t>& sizes, const std::vector<int64_t>& clocks,
                                 const std::optional<Tensor>& errors) {
  const char* op = "hash_table_touch_tables_";
  const size_t num_tables = count.size();
  SK_CHECK(last_seen.size() == num_tables && sizes.size() == num_tables && clocks.size() == num_tables, op,
           ": last_seen (", last_seen.size(), "), count (", num_tables, "), sizes (", sizes.size(), ") and clocks (",
           clocks.size(), ") must hold one entry per table");
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
  check_segment_bounds_arg(op, bounds, segment_tables.size(), rows.device());
  check_error_slots(op, errors, rows.device());
  for (size_t s = 0; s < segment_tables.size(); ++s) {
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
  const std::vector<int64_t> offsets = host_bounds(bounds);
  int64_t* slots = errors.has_value() ? errors->mutable_data_ptr<int64_t>() : nullptr;
  if (!segment_bounds_valid(offsets.data(), static_cast<int64_t>(segment_tables.size()), rows.numel())) {
    if (slots == nullptr) raise_segment_bounds(op, offsets, rows.numel());
    slots[0] = 0;
    return;
  }
  const Tensor rows_c = as_contiguous(rows);
  const int64_t* r = rows_c.const_data_ptr<int64_t>();
  std::atomic<int64_t> bad{rows_c.numel()};
  parallel_for(0, rows_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
    for_each_table_range(offsets, begin, end, [&](int64_t s, int64_t b, int64_t e) {
      const int64_t t = segment_tables[s];
      if (t < 0) return;
      for (int64_t i = b; i < e; ++i) {
        if (r[i] < -1 || r[i] >= sizes[t]) {
          int64_t seen = bad.load(std::memory_order_relaxed);
          while (i < seen && !bad.compare_exchange_weak(seen, i, std::memory_order_relaxed)) {
          }
          return;
        }
      }
    });
  });
  if (slots != nullptr) {
    // Recorded instead of raised; nothing is scored while the slots hold an error.
    slots[1] = std::min(slots[1], bad.load() < rows_c.numel() ? bad.load() : kNoBadPosition);
    if (slots[0] != kNoBadPosition || slots[1] != kNoBadPosition) return;
  } else if (bad.load() < rows_c.numel()) {
    const int64_t i = bad.load();
    const int64_t s = std::upper_bound(offsets.begin(), offsets.end(), i) - offsets.begin() - 1;
    fail(op, ": rows[", i, "] = ", r[i], " of table ", segment_tables[s], " is outside its rows [-1, ",
         sizes[segment_tables[s]], ")");
  }
  // One bit per row in use of each table: the first lookup of a row to set it scores it.
  // The bitmap is the calling thread's, kept zero between calls: the words this call sets
  // are cleared after it (a pass over its rows), so a call costs its rows, not its tables'
  // sizes.
  std::vector<int64_t> bit_base(num_tables + 1, 0);
  for (size_t t = 0; t < num_tables; ++t) bit_base[t + 1] = bit_base[t] + (sizes[t] + 63) / 64 * 64;
  thread_local std::vector<uint64_t> seen_bits;
  if (seen_bits.size() < static_cast<size_t>(bit_base[num_tables] / 64)) {
    seen_bits.resize(static_cast<size_t>(bit_base[num_tables] / 64), 0);
  }
  // The calling thread's bitmap, by address: the workers' own thread_locals are others.
  uint64_t* const bitmap = seen_bits.data();
  std::vector<int64_t*> seen_ptr, count_ptr;
  for (size_t t = 0; t < num_tables; ++t) {
    seen_ptr.push_back(last_seen[t].mutable_data_ptr<int64_t>());
    count_ptr.push_back(count[t].mutable_data_ptr<int64_t>());
  }
  parallel_for(0, rows_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
    for_each_table_range(offsets, begin, end, [&](int64_t s, int64_t b, int64_t e) {
      const int64_t t = segment_tables[s];
      if (t < 0) return;
      uint64_t* bits = bitmap + bit_base[t] / 64;
      for (int64_t i = b; i < e; ++i) {
        const int64_t row = r[i];
        if (row < 0) continue;
        const uint64_t bit = uint64_t{1} << (row & 63);
        // A plain read first: a hot row's word is then only read after its first lookup, not
        // bounced between the threads by an atomic write per lookup (skewed keys).
        if ((__atomic_load_n(&bits[row >> 6], __ATOMIC_RELAXED) & bit) ||
            (__atomic_fetch_or(&bits[row >> 6], bit, __ATOMIC_RELAXED) & bit)) {
          continue;
        }
        seen_ptr[t][row] = clocks[t];
        count_ptr[t][row] += 1;
      }
    });
  });
  parallel_for(0, rows_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
    for_each_table_range(offsets, begin, end, [&](int64_t s, int64_t b, int64_t e) {
      const int64_t t = segment_tables[s];
      if (t < 0) return;
      uint64_t* bits = bitmap + bit_base[t] / 64;
      for (int64_t i = b; i < e; ++i) {
        // Written only while set: a hot word is cleared once, then only read.
        if (r[i] >= 0 && __atomic_load_n(&bits[r[i] >> 6], __ATOMIC_RELAXED) != 0) {
          __atomic_store_n(&bits[r[i] >> 6], uint64_t{0}, __ATOMIC_RELAXED);
        }
      }
    });
  });
}

/// @brief Gives several tables' new keys their rows in one call (an EmbeddingBagCollection
/// step whose tables grow without eviction): keys[offsets[t] : offsets[t + 1]], distinct and
/// absent from table t (not checked), take rows sizes[t], sizes[t] + 1, ... in order; each
/// is stored in its slot and in row_keys[t] at its row, and count[t] at its row is cleared.
/// Every table is checked (arrays, room for its rows and slots) before anything is written.
/// @param sizes the keys each table holds (HashTable's len): its first free row.
void hash_table_place_tables_cpu(const std::vector<Tensor>& slot_keys, const std::vector<Tensor>& slot_rows,
                                 const std::vector<Tensor>& row_keys, const std::vector<Tensor>& count,
                                 const Tensor& keys, const std::vector<int64_t>& offsets,
                                 const std::vector<int64_t>& sizes) {
  const char* op = "hash_table_place_tables_";
  const size_t num_tables = slot_keys.size();
  SK_CHECK(slot_rows.size() == num_tables && row_keys.size() == num_tables && count.size() == num_tables &&
               sizes.size() == num_tables,
           op, ": slot_keys (", num_tables, "), slot_rows (", slot_rows.size(), "), row_keys (", row_keys.size(),
           "), count (", count.size(), ") and sizes (", sizes.size(), ") must hold one entry per table");
  check_key_tensor(keys, op, "keys");
  SK_CHECK(keys.dim() == 1, op, ": keys must be 1-D, got shape ", keys.sizes());
  check_table_offsets(offsets, num_tables, keys.numel(), op);
  for (size_t t = 0; t < num_tables; ++t) {
    check_hash_table_find_args(slot_keys[t], slot_rows[t], keys, OpName(op, static_cast<int64_t>(t)));
    SK_CHECK(row_keys[t].scalar_type() == kLong && count[t].scalar_type() == kLong && row_keys[t].dim() == 1 &&
                 count[t].dim() == 1 && row_keys[t].size(0) == count[t].size(0) && row_keys[t].is_contiguous() &&
                 count[t].is_contiguous() && row_keys[t].device() == keys.device() &&
                 count[t].device() == keys.device(),
             op, ": row_keys[", t, "] and count[", t, "] must be contiguous 1-D int64 tensors of one length on ",
             keys.device());
    const int64_t num_new = offsets[t + 1] - offsets[t];
    const int64_t capacity = row_keys[t].size(0);
    SK_CHECK(sizes[t] >= 0 && sizes[t] <= capacity - num_new, op, ": table ", t, " holds ", sizes[t], " of its ",
             capacity, " rows, so its ", num_new, " new keys do not fit; nothing was inserted");
    check_hash_insert_fits(sizes[t], num_new, slot_keys[t].size(0), "hash_table_place_tables_");
  }
  std::vector<TensorUse> uses{{&keys, "keys", 0, false}};
  for (size_t t = 0; t < num_tables; ++t) {
    uses.push_back({&slot_keys[t], "slot_keys", t, true});
    uses.push_back({&slot_rows[t], "slot_rows", t, true});
    uses.push_back({&row_keys[t], "row_keys", t, true});
    uses.push_back({&count[t], "count", t, true});
  }
  check_no_shared_writes(op, uses);
  std::vector<int64_t*> skeys, srows, rkeys, counts;
  std::vector<uint64_t> masks;
  for (size_t t = 0; t < num_tables; ++t) {
    skeys.push_back(slot_keys[t].mutable_data_ptr<int64_t>());
    srows.push_back(slot_rows[t].mutable_data_ptr<int64_t>());
    rkeys.push_back(row_keys[t].mutable_data_ptr<int64_t>());
    counts.push_back(count[t].mutable_data_ptr<int64_t>());
    masks.push_back(static_cast<uint64_t>(slot_keys[t].size(0) - 1));
  }
  const Tensor keys_c = as_contiguous(keys);
  std::atomic<bool> full{false};
  std::vector<PlacedSlot> placed(keys_c.numel(), PlacedSlot{-1, 0, 0});
  SK_DISPATCH_INDEX_TYPES(keys_c.scalar_type(), "hash_table_place_tables_cpu", [&] {
    const index_t* k = keys_c.const_data_ptr<index_t>();
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          prefetch_slot_ahead(skeys[t], srows[t], masks[t], k, i, e);
          const int64_t row = sizes[t] + (i - offsets[t]);
          if (!place_key(skeys[t], srows[t], masks[t], static_cast<int64_t>(k[i]), row, placed[i])) {
            full.store(true, std::memory_order_relaxed);
            return;
          }
        }
      });
    });
    if (full.load()) {
      // Every table's claimed slots go back; row_keys and count are written only below.
      for_each_table_range(offsets, 0, keys_c.numel(), [&](int64_t t, int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) undo_placed(skeys[t], srows[t], placed[i]);
      });
      return;
    }
    parallel_for(0, keys_c.numel(), kHashGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const int64_t row = sizes[t] + (i - offsets[t]);
          rkeys[t][row] = static_cast<int64_t>(k[i]);
          counts[t][row] = 0;
        }
      });
    });
  });
  // Reached only when sizes[t] understates the slots in use (the room check above trusts
  // it); nothing is left written then.
  raise_hash_insert_error(full.load() ? kHashInsertTableFull : kHashInsertOk, "hash_table_place_tables_");
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("lookup_rows", TORCH_BOX(&lookup_rows_cpu));
  m.impl("hash_table_touch_tables_", TORCH_BOX(&hash_table_touch_tables_cpu));
  m.impl("hash_table_find", TORCH_BOX(&hash_table_find_cpu));
  m.impl("hash_table_erase_", TORCH_BOX(&hash_table_erase_cpu));
  m.impl("hash_table_insert_absent_", TORCH_BOX(&hash_table_insert_absent_cpu));
  m.impl("hash_table_find_tables", TORCH_BOX(&hash_table_find_tables_cpu));
  m.impl("hash_table_score_tables_", TORCH_BOX(&hash_table_score_tables_cpu));
  m.impl("hash_table_place_tables_", TORCH_BOX(&hash_table_place_tables_cpu));
}

}  // namespace sparsekit
