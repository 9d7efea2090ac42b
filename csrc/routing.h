#pragma once
// Argument checks and the owner rule shared by the CPU and CUDA partition_by_owner kernels.
#include <limits>

#include "common.h"

namespace sparsekit {

/// @brief The rank that owns a key: uint64(key) % world_size, the sharding rule of the
/// model-parallel layers. int32 keys are widened to int64 first, so an int32 key has the
/// owner of the equal int64 key.
/// @param key any int64 value, negative ones included.
/// @param world_size number of ranks, >= 1.
C10_HOST_DEVICE inline int64_t owner_of_key(int64_t key, int64_t world_size) {
  return static_cast<int64_t>(static_cast<uint64_t>(key) % static_cast<uint64_t>(world_size));
}

inline void check_partition_by_owner_args(const Tensor& keys, int64_t world_size) {
  check_key_tensor(keys, "partition_by_owner", "keys");
  SK_CHECK(keys.dim() == 1, "partition_by_owner: keys must be 1-D [N], got shape ", keys.sizes(),
              "; flatten them first");
  // Owners are sorted as 32-bit ints on the GPU.
  SK_CHECK(world_size >= 1 && world_size <= std::numeric_limits<int32_t>::max(),
              "partition_by_owner: world_size must be in [1, 2^31), got ", world_size);
}

}  // namespace sparsekit
