// partition_by_owner on the CPU: a stable counting sort of keys by owner rank.
//
// The keys are cut into one contiguous chunk per thread. Each chunk counts its owners,
// an exclusive prefix over (owner, chunk) turns the counts into the first output slot
// of every (chunk, owner) pair, and each chunk then scatters its keys in input order;
// owner-major, chunk-minor slot order is what keeps the sort stable.
#include "cpu/parallel.h"

#include <algorithm>
#include <tuple>
#include <vector>

#include "routing.h"

namespace sparsekit {

namespace {

// Below this many keys per thread the histogram pass costs more than it saves.
constexpr int64_t kKeysPerChunk = 1 << 14;

template <typename key_t>
void partition_keys(const key_t* keys, int64_t n, int64_t world_size, key_t* keys_by_owner,
                    int64_t* positions, int64_t* counts) {
  // A chunk's histogram holds world_size counts: with many ranks and few keys, fewer chunks,
  // so the histograms never outweigh the keys (scratch of O(n + world_size)).
  const int64_t num_chunks = std::max<int64_t>(
      1, std::min<int64_t>({num_threads(), (n + kKeysPerChunk - 1) / kKeysPerChunk, 4 * n / world_size}));
  auto chunk_begin = [&](int64_t chunk) { return chunk * n / num_chunks; };
  // next_slot[chunk * world_size + owner]: first a histogram, then the next free output slot.
  std::vector<int64_t> next_slot(num_chunks * world_size, 0);

  parallel_for(0, num_chunks, 1, [&](int64_t first_chunk, int64_t last_chunk) {
    for (int64_t chunk = first_chunk; chunk < last_chunk; ++chunk) {
      int64_t* histogram = next_slot.data() + chunk * world_size;
      for (int64_t i = chunk_begin(chunk); i < chunk_begin(chunk + 1); ++i) {
        ++histogram[owner_of_key(static_cast<int64_t>(keys[i]), world_size)];
      }
    }
  });

  int64_t slot = 0;
  for (int64_t owner = 0; owner < world_size; ++owner) {
    const int64_t owner_start = slot;
    for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const int64_t chunk_count = next_slot[chunk * world_size + owner];
      next_slot[chunk * world_size + owner] = slot;
      slot += chunk_count;
    }
    counts[owner] = slot - owner_start;
  }

  parallel_for(0, num_chunks, 1, [&](int64_t first_chunk, int64_t last_chunk) {
    for (int64_t chunk = first_chunk; chunk < last_chunk; ++chunk) {
      int64_t* chunk_slots = next_slot.data() + chunk * world_size;
      for (int64_t i = chunk_begin(chunk); i < chunk_begin(chunk + 1); ++i) {
        const int64_t position = chunk_slots[owner_of_key(static_cast<int64_t>(keys[i]), world_size)]++;
        keys_by_owner[position] = keys[i];
        positions[i] = position;
      }
    }
  });
}

}  // namespace

/// @brief Stable counting sort of keys by owner rank uint64(key) % world_size.
/// @param keys int64 or int32 [N], any values.
/// @param world_size number of ranks, >= 1.
/// @return keys_by_owner (keys' dtype, [N]: rank 0's keys first, each rank's in input
///   order), positions (int64 [N], keys_by_owner[positions[i]] == keys[i]) and counts
///   (int64 [world_size], keys per owner).
std::tuple<Tensor, Tensor, Tensor> partition_by_owner_cpu(const Tensor& keys,
                                                                      int64_t world_size) {
  check_partition_by_owner_args(keys, world_size);
  const Tensor keys_contig = as_contiguous(keys);
  const int64_t n = keys_contig.numel();
  Tensor counts = zeros({world_size}, kLong, keys.device());
  if (world_size == 1) {
    counts.mutable_data_ptr<int64_t>()[0] = n;
    return {torch::stable::clone(keys_contig), arange_cpu(n), counts};
  }
  Tensor keys_by_owner = torch::stable::empty_like(keys_contig);
  Tensor positions = empty({n}, kLong, keys.device());
  if (n == 0) return {keys_by_owner, positions, counts};
  SK_DISPATCH_INDEX_TYPES(keys_contig.scalar_type(), "partition_by_owner_cpu", [&] {
    partition_keys<index_t>(keys_contig.const_data_ptr<index_t>(), n, world_size,
                            keys_by_owner.mutable_data_ptr<index_t>(), positions.mutable_data_ptr<int64_t>(),
                            counts.mutable_data_ptr<int64_t>());
  });
  return {keys_by_owner, positions, counts};
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("partition_by_owner", TORCH_BOX(&partition_by_owner_cpu));
}

}  // namespace sparsekit
