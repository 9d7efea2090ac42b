#pragma once
// Helpers shared by the CPU and CUDA kernels of sparsekit.
#include <cstdint>

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

inline void check_key_tensor(const Tensor& keys, const char* op, const char* arg) {
  SK_CHECK(keys.scalar_type() == kLong || keys.scalar_type() == kInt, op, ": ", arg,
              " must be an int64 or int32 tensor of keys, got ", keys.scalar_type(),
              "; cast it with .long()");
}

inline void check_index_tensor(const Tensor& index, const char* op, const char* arg) {
  SK_CHECK(index.scalar_type() == kLong || index.scalar_type() == kInt, op, ": ", arg,
              " must be an int64 or int32 tensor, got ", index.scalar_type());
}

}  // namespace sparsekit
