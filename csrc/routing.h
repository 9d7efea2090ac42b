#pragma once
// Argument checks and the owner rule shared by the CPU and CUDA partition_by_owner kernels.
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

/// Most ranks partition_by_owner takes: 2^24 (16,777,216), beyond any cluster. The counts
/// (and on the CPU a histogram per thread) hold world_size int64: near 2^31 ranks they
/// would take 16 GiB, which a machine that overcommits memory hands out and then kills
/// the process for touching, instead of failing the allocation.
constexpr int64_t kMaxWorldSize = int64_t{1} << 24;

inline void check_partition_by_owner_args(const Tensor& keys, int64_t world_size) {
  check_key_tensor(keys, "partition_by_owner", "keys");
  SK_CHECK(keys.dim() == 1, "partition_by_owner: keys must be 1-D [N], got shape ", keys.sizes(),
              "; flatten them first");
  SK_CHECK(world_size >= 1 && world_size <= kMaxWorldSize,
              "partition_by_owner: world_size must be in [1, 2^24], got ", world_size);
}

}  // namespace sparsekit
