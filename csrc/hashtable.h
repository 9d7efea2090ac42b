#pragma once
// Argument checks and the table layout shared by the CPU and CUDA hash-table kernels.
//
// Layout: linear probing over S slots (a power of two); slot_keys / slot_rows int64[S];
// slot_rows -1 marks an empty slot, -2 a tombstone (probes go past it, inserts reuse it), so
// every int64 is a valid key. Home slot: mix_key(key) & (S - 1), int32 keys widened first.
// Callers keep at most S / 2 keys, so probes stay short and an insert finds an empty slot.
#include <vector>

#include "common.h"

namespace sparsekit {

/// Marker of an empty slot in slot_rows.
constexpr int64_t kEmptySlotRow = -1;
/// Marker of an erased key's slot: not the end of a probe sequence, free for an insert.
constexpr int64_t kTombstoneRow = -2;

/// @brief Row of `key` in the table, or kEmptySlotRow when it is absent.
/// @param slot_mask S - 1 for S slots (a power of two).
C10_HOST_DEVICE inline int64_t probe_find(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask,
                                          int64_t key) {
  uint64_t slot = mix_key(key) & slot_mask;
  // An empty slot ends the probe sequence; the bound only matters for a table filled
  // to the last slot through the raw op, where a missing key must not loop forever.
  for (uint64_t probe = 0; probe <= slot_mask; ++probe) {
    const int64_t row = slot_rows[slot];
    if (row == kEmptySlotRow) return kEmptySlotRow;
    if (row >= 0 && slot_keys[slot] == key) return row;
    slot = (slot + 1) & slot_mask;
  }
  return kEmptySlotRow;
}

/// @brief Slot of `key`, or -1 when it is absent (for erasing it).
C10_HOST_DEVICE inline int64_t probe_slot(const int64_t* slot_keys, const int64_t* slot_rows, uint64_t slot_mask,
                                          int64_t key) {
  uint64_t slot = mix_key(key) & slot_mask;
  for (uint64_t probe = 0; probe <= slot_mask; ++probe) {
    const int64_t row = slot_rows[slot];
    if (row == kEmptySlotRow) return -1;
    if (row >= 0 && slot_keys[slot] == key) return static_cast<int64_t>(slot);
    slot = (slot + 1) & slot_mask;
  }
  return -1;
}

/// @brief Checks the two slot arrays of a table: int64, 1-D, same length (a power of
/// two), contiguous and on one device.
inline void check_hash_table_slots(const Tensor& slot_keys, const Tensor& slot_rows, OpName op) {
  SK_CHECK(slot_keys.scalar_type() == kLong, op, ": slot_keys must be int64, got ",
              slot_keys.scalar_type());
  SK_CHECK(slot_rows.scalar_type() == kLong, op, ": slot_rows must be int64, got ",
              slot_rows.scalar_type());
  SK_CHECK(slot_keys.dim() == 1 && slot_rows.dim() == 1, op,
              ": slot_keys and slot_rows must be 1-D [S], got shapes ", slot_keys.sizes(), " and ",
              slot_rows.sizes());
  SK_CHECK(slot_keys.size(0) == slot_rows.size(0), op, ": slot_keys has ", slot_keys.size(0),
              " slots but slot_rows has ", slot_rows.size(0), "; they must match");
  const int64_t slots = slot_keys.size(0);
  SK_CHECK(slots > 0 && (slots & (slots - 1)) == 0, op,
              ": the slot count must be a power of two (index = hash & (S - 1)), got ", slots);
  SK_CHECK(slot_keys.is_contiguous() && slot_rows.is_contiguous(), op,
              ": slot_keys and slot_rows must be contiguous");
  SK_CHECK(slot_keys.device() == slot_rows.device(), op, ": slot_keys is on ", slot_keys.device(),
              " but slot_rows is on ", slot_rows.device(), "; keep the table on one device");
  // One array for both would have an insert write a key over a row (and a find read it).
  SK_CHECK(!memory_overlaps(slot_keys, slot_rows), op,
           ": slot_keys and slot_rows share memory; a table's two slot arrays must be tensors of their own");
}

/// @brief Checks the arguments of hash_table_find.
/// @param op how errors name the call: hash_table_find, or a table of a multi-table op.
inline void check_hash_table_find_args(const Tensor& slot_keys, const Tensor& slot_rows,
                                       const Tensor& keys, OpName op = "hash_table_find") {
  check_hash_table_slots(slot_keys, slot_rows, op);
  check_key_tensor(keys, op, "keys");
  SK_CHECK(keys.device() == slot_keys.device(), op, ": keys are on ", keys.device(),
              " but the table is on ", slot_keys.device(), "; move the keys with .to(table.device)");
}

/// @brief Checks the arguments of hash_table_erase_.
inline void check_hash_table_erase_args(const Tensor& slot_keys, const Tensor& slot_rows,
                                        const Tensor& keys) {
  check_hash_table_slots(slot_keys, slot_rows, "hash_table_erase_");
  check_key_tensor(keys, "hash_table_erase_", "keys");
  SK_CHECK(keys.device() == slot_keys.device(), "hash_table_erase_: keys are on ", keys.device(),
              " but the table is on ", slot_keys.device(), "; move the keys with .to(table.device)");
  SK_CHECK(!memory_overlaps(keys, slot_keys) && !memory_overlaps(keys, slot_rows),
           "hash_table_erase_: keys shares memory with the table's slot_keys or slot_rows, which the erase "
           "writes; pass a copy (.clone())");
}

/// @brief Checks the arguments of hash_table_insert_absent_.
inline void check_hash_table_insert_args(const Tensor& slot_keys, const Tensor& slot_rows,
                                         const Tensor& keys, const Tensor& rows) {
  check_hash_table_slots(slot_keys, slot_rows, "hash_table_insert_absent_");
  check_key_tensor(keys, "hash_table_insert_absent_", "keys");
  SK_CHECK(rows.scalar_type() == kLong, "hash_table_insert_absent_: rows must be int64, got ",
              rows.scalar_type(), "; cast it with .long()");
  SK_CHECK(rows.numel() == keys.numel(), "hash_table_insert_absent_: rows has ", rows.numel(),
              " entries but keys has ", keys.numel(), "; give one row per key");
  SK_CHECK(keys.device() == slot_keys.device() && rows.device() == slot_keys.device(),
              "hash_table_insert_absent_: keys (", keys.device(), ") and rows (", rows.device(),
              ") must be on the table's device (", slot_keys.device(), ")");
  SK_CHECK(keys.numel() <= slot_keys.size(0), "hash_table_insert_absent_: ", keys.numel(),
              " keys cannot fit in a table of ", slot_keys.size(0), " slots");
  // The insert writes the slots while it reads keys and rows: a view of the slots among them
  // would change under it (keys inserted at the wrong rows, or lost).
  const Tensor* read[] = {&keys, &rows};
  const char* read_names[] = {"keys", "rows"};
  for (int i = 0; i < 2; ++i) {
    SK_CHECK(!memory_overlaps(*read[i], slot_keys) && !memory_overlaps(*read[i], slot_rows),
             "hash_table_insert_absent_: ", read_names[i], " shares memory with the table's slot_keys or "
             "slot_rows, which the insert writes; pass a copy (.clone())");
  }
}

/// Error codes a hash_table_insert_absent_ kernel raises in its flag.
enum HashInsertError : int32_t {
  kHashInsertOk = 0,
  kHashInsertNegativeRow = 1,  // a row < 0 would read as an empty slot
  kHashInsertTableFull = 2,    // probing visited every slot without finding an empty one
};

/// @brief Checks the segment bounds of lookup_rows / hash_table_touch_tables_: int64, 1-D,
/// one more entry than segments, on `device`. Their values (from 0 to n, never decreasing)
/// are the kernels' to check: on CUDA they stay on the device.
inline void check_segment_bounds_arg(const char* op, const Tensor& bounds, size_t num_segments, const Device& device) {
  SK_CHECK(bounds.scalar_type() == kLong && bounds.dim() == 1 &&
               bounds.size(0) == static_cast<int64_t>(num_segments) + 1 && bounds.device() == device,
           op, ": bounds must be a 1-D int64 tensor of ", num_segments + 1, " entries (one more than segments) on ",
           device, ", got a ", bounds.scalar_type(), " tensor of shape ", bounds.sizes(), " on ", bounds.device());
}

/// @brief Whether segment bounds run from 0 to n and never decrease.
C10_HOST_DEVICE inline bool segment_bounds_valid(const int64_t* bounds, int64_t num_segments, int64_t n) {
  if (bounds[0] != 0 || bounds[num_segments] != n) return false;
  for (int64_t s = 0; s < num_segments; ++s) {
    if (bounds[s] > bounds[s + 1]) return false;
  }
  return true;
}

/// @brief Raises for host segment bounds that segment_bounds_valid refuses (both devices'
/// text).
inline void raise_segment_bounds(const char* op, const std::vector<int64_t>& bounds, int64_t n) {
  const size_t last = bounds.size() - 1;
  for (size_t s = 0; s < last; ++s) {
    SK_CHECK(bounds[s] <= bounds[s + 1], op, ": bounds must run from 0 to ", n, " without decreasing, got bounds[",
             s, "] = ", bounds[s], " > bounds[", s + 1, "] = ", bounds[s + 1]);
  }
  fail(op, ": bounds must run from 0 to ", n, " without decreasing, got ", bounds.front(), " .. ", bounds.back());
}

/// @brief Raises, before anything is written, when the keys cannot all find an empty slot:
/// with num_occupied + num_keys <= num_slots every probe (it wraps around) ends on one, so
/// a call that passes writes every key, and a call that fails writes nothing, on every
/// device alike. (The check trusts num_occupied: a count below the real one can run out of
/// slots half-way; the CPU kernels then put back what they claimed and raise.)
inline void check_hash_insert_fits(int64_t num_occupied, int64_t num_keys, int64_t num_slots,
                                   const char* op = "hash_table_insert_absent_") {
  SK_CHECK(num_occupied >= 0 && num_occupied <= num_slots,
              op, ": num_occupied must lie in [0, ", num_slots, "], got ", num_occupied);
  SK_CHECK(num_occupied + num_keys <= num_slots, op, ": ", num_keys,
              " keys do not fit in the ", num_slots - num_occupied, " empty slots of the table (", num_occupied,
              " of ", num_slots, " occupied); nothing was inserted. Keep the table at most half full "
              "(sparsekit.HashTable does)");
}

inline void raise_hash_insert_error(int32_t code, const char* op = "hash_table_insert_absent_") {
  SK_CHECK(code != kHashInsertNegativeRow,
              op, ": rows must be >= 0 (-1 marks an empty slot); nothing valid "
              "can be stored for a negative row");
  SK_CHECK(code != kHashInsertTableFull,
              op, ": the table has no empty slot left; keep the table at most half "
              "full (sparsekit.HashTable does) and insert only keys that are absent");
}

}  // namespace sparsekit
