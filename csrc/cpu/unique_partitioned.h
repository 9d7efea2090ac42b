#pragma once
// unique for keys that are mostly distinct, in order of first occurrence: partitioned by
// hash so that every table fits in cache.
// With many distinct keys one table per thread (unique_cpu.cpp) outgrows the caches. Passes:
// A. count keys per hash bucket per block; B. scatter (key, position) into buckets in
// position order; C. dedup each bucket in a cache-sized table; D. visit the keys in order
// again, numbering first occurrences; E. other occurrences take their first one's id.
// Scratch memory is kept between calls (up to kMaxKeptScratch): fresh pages fault.
#include "torch_api.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "parallel.h"
#include "scratch.h"

namespace sparsekit {
namespace partitioned {

// Keys per bucket aimed at: its table (2 slots of 16 bytes per distinct key, 1 MiB) stays
// in L2, and passes B and D write and read no more streams than the caches can follow.
constexpr int64_t kBucketKeys = int64_t{1} << 15;
constexpr int kMaxBucketBits = 12;
// Blocks of positions per thread in passes A, B and D (each block has its own cursors).
constexpr int64_t kBlocksPerThread = 4;
constexpr int64_t kMaxBlocks = 64;
template <typename key_t>
struct Entry {
  key_t key;
  int32_t first;  // the position of the key's first occurrence (its own until pass C)
  int32_t count;  // occurrences, on the entry of the first occurrence; 0 on the others
};

template <typename key_t>
struct BucketSlot {
  key_t key;
  int32_t entry;   // the bucket-relative index of the key's first entry
  uint32_t stamp;  // the slot is in use for the current bucket iff it holds that bucket's stamp
};

/// @brief A worker's bucket table, kept between buckets and calls. Each bucket takes a new
/// stamp, so slots left by earlier buckets read as free without clearing the table.
template <typename key_t>
struct BucketTable {
  std::vector<BucketSlot<key_t>> slots;
  uint32_t stamp = 0;

  /// Readies the table for a bucket of about `distinct` keys; returns the mask to use.
  uint64_t start(int64_t distinct) {
    int64_t wanted = 16;
    while (wanted < 2 * distinct) wanted <<= 1;
    if (static_cast<int64_t>(slots.size()) < wanted) slots.assign(wanted, BucketSlot<key_t>{0, 0, 0});
    if (++stamp == 0) {  // wrapped: no stale slot may carry the new stamps
      std::fill(slots.begin(), slots.end(), BucketSlot<key_t>{0, 0, 0});
      stamp = 1;
    }
    return static_cast<uint64_t>(wanted) - 1;
  }

  /// Doubles the slots in use (mask + 1) and rehashes the current bucket's keys.
  uint64_t grow(uint64_t mask) {
    const uint64_t bigger_mask = 2 * mask + 1;
    std::vector<BucketSlot<key_t>> bigger(bigger_mask + 1, BucketSlot<key_t>{0, 0, 0});
    for (uint64_t s = 0; s <= mask; ++s) {
      if (slots[s].stamp != stamp) continue;
      uint64_t t = mix_key(static_cast<int64_t>(slots[s].key)) & bigger_mask;
      while (bigger[t].stamp == stamp) t = (t + 1) & bigger_mask;
      bigger[t] = slots[s];
    }
    slots.swap(bigger);
    return bigger_mask;
  }

  void trim() {
    if (slots.capacity() * sizeof(BucketSlot<key_t>) > kMaxKeptScratch) {
      std::vector<BucketSlot<key_t>>().swap(slots);
      stamp = 0;
    }
  }
};

/// @brief Pass C for one bucket: dedups entries[0, m) in order (a table sized for
/// `guess` distinct keys, grown when that was low); adds 1 to
/// firsts[position >> block_shift] for each first occurrence.
template <typename key_t>
void dedup_bucket(Entry<key_t>* entries, int64_t m, int64_t guess, BucketTable<key_t>& table, int64_t* firsts,
                  int block_shift) {
  uint64_t mask = table.start(std::min(m, guess));
  const uint32_t stamp = table.stamp;
  int64_t used = 0;
  for (int64_t j = 0; j < m; ++j) {
    Entry<key_t>& entry = entries[j];
    // The bucket took the hash's high bits; the slot takes its low bits.
    uint64_t s = mix_key(static_cast<int64_t>(entry.key)) & mask;
    BucketSlot<key_t>* slots = table.slots.data();
    while (slots[s].stamp == stamp && slots[s].key != entry.key) s = (s + 1) & mask;
    if (slots[s].stamp == stamp) {
      Entry<key_t>& first = entries[slots[s].entry];
      ++first.count;
      entry.first = first.first;
      entry.count = 0;
      continue;
    }
    if (2 * (used + 1) > static_cast<int64_t>(mask + 1)) {
      // More distinct keys than guessed (the input's estimate spread evenly): double.
      mask = table.grow(mask);
      slots = table.slots.data();
      s = mix_key(static_cast<int64_t>(entry.key)) & mask;
      while (slots[s].stamp == stamp) s = (s + 1) & mask;
    }
    slots[s] = BucketSlot<key_t>{entry.key, static_cast<int32_t>(j), stamp};
    entry.count = 1;
    ++firsts[entry.first >> block_shift];
    ++used;
  }
}

/// @brief unique of keys[0, n) (n < 2^31) with about `expected_distinct` distinct keys;
/// fills unique_keys, counts (allocated here) and inverse.
template <typename key_t>
void unique_partitioned(const key_t* keys, int64_t n, int64_t expected_distinct, Tensor& unique_keys,
                        int64_t* inverse, Tensor& counts) {
  int bits = 1;
  while (bits < kMaxBucketBits && (n >> bits) > kBucketKeys) ++bits;
  const int64_t num_buckets = int64_t{1} << bits;
  auto bucket_of = [bits](key_t key) -> int64_t {
    return static_cast<int64_t>(mix_key(static_cast<int64_t>(key)) >> (64 - bits));
  };
  const int64_t threads = in_parallel_region() ? 1 : num_threads();
  // Blocks of a power-of-two length: a position's block is a shift away.
  const int64_t wanted_blocks = std::min<int64_t>(kMaxBlocks, std::max<int64_t>(1, threads * kBlocksPerThread));
  int block_shift = 0;
  while ((int64_t{1} << block_shift) * wanted_blocks < n) ++block_shift;
  const int64_t block_length = int64_t{1} << block_shift;
  const int64_t num_blocks = (n + block_length - 1) / block_length;
  auto block_end = [&](int64_t b) { return std::min(n, (b + 1) * block_length); };

  // A: per block, keys per bucket.
  std::vector<int64_t> cursor(num_blocks * num_buckets, 0);
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t* histogram = cursor.data() + b * num_buckets;
      for (int64_t i = b * block_length; i < block_end(b); ++i) ++histogram[bucket_of(keys[i])];
    }
  });
  // Bucket-major, blocks in order within a bucket: cursor[b][p] = where block b's keys of
  // bucket p start.
  std::vector<int64_t> bucket_start(num_buckets + 1, 0);
  scan_counts_by_column(cursor.data(), num_blocks, num_buckets, bucket_start.data());
  const std::vector<int64_t> cursor_d = cursor;

  thread_local Scratch entry_scratch;
  const TrimOnExit trim_entries{entry_scratch};  // on an error too (an allocation refused below)
  Entry<key_t>* entries = static_cast<Entry<key_t>*>(entry_scratch.get(n * sizeof(Entry<key_t>)));

  // B: scatter.
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t* next = cursor.data() + b * num_buckets;
      for (int64_t i = b * block_length; i < block_end(b); ++i) {
        entries[next[bucket_of(keys[i])]++] = Entry<key_t>{keys[i], static_cast<int32_t>(i), 0};
      }
    }
  });

  // C: dedup each bucket; count first occurrences per (worker, block of positions).
  const int64_t guess = expected_distinct / num_buckets * 5 / 4 + 64;
  const int64_t workers = chunk_workers(num_buckets, 1);
  std::vector<int64_t> firsts(workers * num_blocks, 0);
  parallel_chunks_indexed(num_buckets, 1, [&](int64_t worker, int64_t p_begin, int64_t p_end) {
    thread_local BucketTable<key_t> table;
    struct TrimTable {
      BucketTable<key_t>& table;
      ~TrimTable() { table.trim(); }
    } const trim_table{table};  // a growth that fails must not keep the table's old slots either
    int64_t* my_firsts = firsts.data() + worker * num_blocks;
    for (int64_t p = p_begin; p < p_end; ++p) {
      Entry<key_t>* bucket = entries + bucket_start[p];
      const int64_t m = bucket_start[p + 1] - bucket_start[p];
      dedup_bucket(bucket, m, guess, table, my_firsts, block_shift);
    }
  });
  std::vector<int64_t> first_id(num_blocks + 1, 0);
  for (int64_t b = 0; b < num_blocks; ++b) {
    first_id[b + 1] = first_id[b];
    for (int64_t w = 0; w < workers; ++w) first_id[b + 1] += firsts[w * num_blocks + b];
  }

  // D: ids of the first occurrences, in position order; the others note where theirs is.
  const int64_t num_unique = first_id[num_blocks];
  unique_keys = empty({num_unique}, unique_keys.scalar_type(), unique_keys.device());
  counts = empty({num_unique}, counts.scalar_type(), counts.device());
  key_t* out_keys = unique_keys.mutable_data_ptr<key_t>();
  int64_t* out_counts = counts.mutable_data_ptr<int64_t>();
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    std::vector<int64_t> next(num_buckets);
    for (int64_t b = b_begin; b < b_end; ++b) {
      std::copy_n(cursor_d.data() + b * num_buckets, num_buckets, next.data());
      int64_t id = first_id[b];
      for (int64_t i = b * block_length; i < block_end(b); ++i) {
        const Entry<key_t>& entry = entries[next[bucket_of(keys[i])]++];
        if (entry.count != 0) {
          out_keys[id] = keys[i];
          out_counts[id] = entry.count;
          inverse[i] = id++;
        } else {
          inverse[i] = ~static_cast<int64_t>(entry.first);
        }
      }
    }
  });

  // E: the other occurrences take their first occurrence's id (set in D, never negative).
  parallel_chunks(n, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (inverse[i] < 0) inverse[i] = inverse[~inverse[i]];
    }
  });
}

}  // namespace partitioned
}  // namespace sparsekit
