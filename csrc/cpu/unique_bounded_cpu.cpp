// Sorted unique of keys in a small range [-1, bound) (an embedding gradient's row numbers)
// by a bitmap of the values present: a bit set and a rank read in a cache-resident bitmap,
// cheaper than any hashing. Passes: A. each worker sets its keys' bits in its own bitmap;
// B. OR the bitmaps, count set bits per block; C. each word's rank; D. each key's rank;
// E. (grouping) positions stably counting-sorted by key. Independent of the thread count.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "common.h"
#include "cpu/grouping.h"
#include "cpu/cpu_features.h"
#include "parallel.h"
#include "scratch.h"

namespace sparsekit {
namespace {

// Bits of a bitmap per code up to which rank_codes numbers codes with the bitmap.
constexpr int64_t kBitmapBitsPerKey = 128;
// Keys per piece of passes A and D.
constexpr int64_t kKeyGrain = int64_t{1} << 15;
// Ranks whose counters pass E prefetches before it counts them.
constexpr int64_t kCountBlock = 64;
// Positions ahead whose cursor (twice this) and slot (this) the scatter of pass E prefetches.
constexpr int64_t kScatterAhead = 16;
// Words per piece of passes B and C (32 KiB of the merged bitmap).
constexpr int64_t kWordGrain = int64_t{1} << 12;

/// @brief The set bits of a 64-bit word: popcnt through inline assembly when the CPU has it
/// (a baseline x86-64 build turns __builtin_popcountll into a libgcc call), inline
/// bit-twiddling otherwise.
inline int64_t popcount64(uint64_t x) {
#if defined(__x86_64__)
  if (C10_LIKELY(kCpuFeatures.popcnt)) {
    uint64_t count;
    asm("popcnt %1, %0" : "=r"(count) : "r"(x) : "cc");
    return static_cast<int64_t>(count);
  }
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return static_cast<int64_t>((x * 0x0101010101010101ULL) >> 56);
#else
  return __builtin_popcountll(x);
#endif
}

/// @brief E: a stable counting sort of positions [0, n) by their rank inv[i] in [0,
/// num_unique): order lists the positions of rank 0, then of rank 1, ..., each rank's in
/// increasing order, and offsets ([num_unique + 1]) bounds each rank's run. The positions
/// are cut into `parts` fixed ranges, each counted and scattered by one thread with cursors
/// of its own, so no two threads touch one counter (hot keys would make shared counters
/// bounce between cores) and the result does not depend on the thread count.
void group_by_key(const int64_t* inv, int64_t n, int64_t num_unique, int64_t parts, Tensor& offsets, Tensor& order) {
  offsets = empty({num_unique + 1}, kLong, offsets.device());
  order = empty({n}, kLong, order.device());
  int64_t* out_offsets = offsets.mutable_data_ptr<int64_t>();
  int64_t* out_order = order.mutable_data_ptr<int64_t>();
  thread_local Scratch cursor_scratch;
  const TrimOnExit trim_cursors{cursor_scratch};
  int64_t* cursors = static_cast<int64_t*>(allocate_host_or_fail(
      "unique_bounded", "the grouping's cursors", 8.0 * static_cast<double>(parts) * static_cast<double>(num_unique),
      [&] { return cursor_scratch.get(sizeof(int64_t) * static_cast<size_t>(parts * num_unique)); }));
  auto part_begin = [&](int64_t p) { return n * p / parts; };

  // Counts per part, each part's counters in a block of their own. A block of ranks is
  // prefetched before it is counted: the counters of mostly distinct keys are out of cache.
  parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      int64_t* count = cursors + p * num_unique;
      std::memset(count, 0, sizeof(int64_t) * static_cast<size_t>(num_unique));
      for (int64_t block = part_begin(p); block < part_begin(p + 1); block += kCountBlock) {
        const int64_t block_end = std::min(part_begin(p + 1), block + kCountBlock);
        for (int64_t i = block; i < block_end; ++i) __builtin_prefetch(&count[inv[i]], 1);
        for (int64_t i = block; i < block_end; ++i) ++count[inv[i]];
      }
    }
  });

  // Offsets, and each part's cursors: where its first position of every rank goes.
  scan_counts_by_column(cursors, parts, num_unique, out_offsets);

  // The scatter, each part in position order through its own cursors (the cursor and the
  // slot it points at prefetched ahead, the slot one step after its cursor).
  parallel_for(0, parts, 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; ++p) {
      int64_t* cursor = cursors + p * num_unique;
      const int64_t begin = part_begin(p), end = part_begin(p + 1);
      for (int64_t i = begin; i < end; ++i) {
        if (i + 2 * kScatterAhead < end) __builtin_prefetch(&cursor[inv[i + 2 * kScatterAhead]], 1);
        if (i + kScatterAhead < end) __builtin_prefetch(&out_order[cursor[inv[i + kScatterAhead]]], 1);
        out_order[cursor[inv[i]]++] = i;
      }
    }
  });
}

template <typename key_t>
void unique_bounded_kernel(const key_t* keys, int64_t n, int64_t bound, bool group, Tensor& unique_keys,
                           Tensor& inverse, Tensor& offsets, Tensor& order) {
  const InlineWhileContended contended(n, kKeyGrain);  // before chunk_workers sizes the bitmaps
  // Bit v + 1 stands for value v, so that -1 is bit 0.
  const int64_t num_words = (bound + 1 + 63) / 64;
  const int64_t num_blocks = (num_words + kWordGrain - 1) / kWordGrain;
  const int64_t workers = chunk_workers(n, kKeyGrain);
  thread_local Scratch scratch;
  const TrimOnExit trim_bitmaps{scratch};  // on an error too (a key out of range)
  uint64_t* bitmaps = static_cast<uint64_t*>(allocate_host_or_fail(
      "unique_bounded", message("bound=", bound, " (", workers + 2, " bitmaps of bound + 1 bits)"),
      8.0 * static_cast<double>(workers + 2) * static_cast<double>(num_words),
      [&] { return scratch.get(sizeof(uint64_t) * static_cast<size_t>((workers + 2) * num_words)); }));
  uint64_t* merged = bitmaps + workers * num_words;
  int64_t* ranks = reinterpret_cast<int64_t*>(merged + num_words);  // set bits in the words before each word
  std::vector<int64_t> block_first(num_blocks + 1, 0);

  // A: the bits, after zeroing every worker's bitmap; keys out of range are noted.
  parallel_chunks(workers * num_words, kWordGrain * 4, [&](int64_t begin, int64_t end) {
    std::memset(bitmaps + begin, 0, sizeof(uint64_t) * static_cast<size_t>(end - begin));
  });
  std::atomic<bool> out_of_range{false};
  parallel_chunks_indexed(n, kKeyGrain, [&](int64_t worker, int64_t begin, int64_t end) {
    uint64_t* bits = bitmaps + worker * num_words;
    bool bad = false;
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t bit = static_cast<uint64_t>(static_cast<int64_t>(keys[i]) + 1);
      // One unsigned compare catches both ends: a key below -1 wraps to a huge bit.
      if (C10_UNLIKELY(bit > static_cast<uint64_t>(bound))) {
        bad = true;
        continue;
      }
      bits[bit >> 6] |= uint64_t{1} << (bit & 63);
    }
    if (bad) out_of_range.store(true, std::memory_order_relaxed);
  });
  if (out_of_range.load()) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t key = static_cast<int64_t>(keys[i]);
      SK_CHECK(key >= -1 && key < bound, "unique_bounded: keys must lie in [-1, bound) = [-1, ", bound, "), got ",
               key, " at position ", i);
    }
  }

  // B: the merged bitmap and each block's count of set bits.
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t set = 0;
      for (int64_t w = b * kWordGrain, e = std::min(num_words, (b + 1) * kWordGrain); w < e; ++w) {
        uint64_t word = bitmaps[w];
        for (int64_t k = 1; k < workers; ++k) word |= bitmaps[k * num_words + w];
        merged[w] = word;
        set += popcount64(word);
      }
      block_first[b + 1] = set;
    }
  });
  for (int64_t b = 0; b < num_blocks; ++b) block_first[b + 1] += block_first[b];
  const int64_t num_unique = block_first[num_blocks];

  // C: the rank of every word and the distinct keys, ascending.
  unique_keys = empty({num_unique}, unique_keys.scalar_type(), unique_keys.device());
  key_t* out_keys = unique_keys.mutable_data_ptr<key_t>();
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      int64_t rank = block_first[b];
      for (int64_t w = b * kWordGrain, e = std::min(num_words, (b + 1) * kWordGrain); w < e; ++w) {
        ranks[w] = rank;
        for (uint64_t word = merged[w]; word != 0; word &= word - 1) {
          out_keys[rank++] = static_cast<key_t>(w * 64 + __builtin_ctzll(word) - 1);
        }
      }
    }
  });

  // D: every key's rank.
  int64_t* inv = inverse.mutable_data_ptr<int64_t>();
  parallel_chunks(n, kKeyGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t bit = static_cast<uint64_t>(static_cast<int64_t>(keys[i]) + 1);
      const uint64_t below = merged[bit >> 6] & ((uint64_t{1} << (bit & 63)) - 1);
      inv[i] = ranks[bit >> 6] + popcount64(below);
    }
  });
  if (group) group_by_key(inv, n, num_unique, workers, offsets, order);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> unique_bounded_cpu(const Tensor& keys_in, int64_t bound, bool group) {
  check_key_tensor(keys_in, "unique_bounded", "keys");
  SK_CHECK(keys_in.device().is_cpu(), "unique_bounded: expected a CPU tensor, got ", keys_in.device());
  // The bitmaps take bound / 8 bytes per worker: a bound far above the key count is the
  // caller's mistake (sparsekit.ops picks the hash-based unique then).
  SK_CHECK(bound >= 0 && bound < (int64_t{1} << 40), "unique_bounded: bound must lie in [0, 2^40), got ", bound);
  const Tensor keys = as_contiguous(keys_in);
  Tensor unique_keys = empty({0}, keys.scalar_type(), keys.device());
  Tensor inverse = empty(keys.sizes(), kLong, keys.device());
  Tensor offsets = empty({group ? 1 : 0}, kLong, keys.device());
  Tensor order = empty({0}, kLong, keys.device());
  const int64_t n = keys.numel();
  if (n == 0) {
    if (group) offsets.mutable_data_ptr<int64_t>()[0] = 0;
    return {unique_keys, inverse, offsets, order};
  }
  SK_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_bounded_cpu", [&] {
    unique_bounded_kernel<index_t>(keys.const_data_ptr<index_t>(), n, bound, group, unique_keys, inverse, offsets,
                                   order);
  });
  return {unique_keys, inverse, offsets, order};
}

}  // namespace

RankedCodes rank_codes(const Tensor& codes, int64_t bound, const std::vector<int64_t>& segments) {
  const int64_t n = codes.numel();
  RankedCodes out;
  if (n == 0) {
    out.distinct = empty({0}, kLong, codes.device());
    out.rank = empty({0}, kLong, codes.device());
    return out;
  }
  const int64_t* keys = codes.const_data_ptr<int64_t>();
  // The bitmap while its bits cost less than hashing the codes (ops._bitmap_numbers' rule).
  if (bound <= kBitmapBitsPerKey * n + (int64_t{1} << 16)) {
    Tensor unique_codes = empty({0}, kLong, codes.device());
    Tensor inverse = empty({n}, kLong, codes.device());
    Tensor offsets = empty({0}, kLong, codes.device());
    Tensor order = empty({0}, kLong, codes.device());
    unique_bounded_kernel<int64_t>(keys, n, bound, false, unique_codes, inverse, offsets, order);
    // -1 (a skipped lookup) is bit 0, the first distinct code when present.
    const int64_t num_unique = unique_codes.size(0);
    const bool skipped = num_unique > 0 && unique_codes.const_data_ptr<int64_t>()[0] == -1;
    const int64_t shift = skipped ? 1 : 0;
    out.distinct = skipped ? slice0(unique_codes, 1, num_unique) : unique_codes;
    // The ranks are the inverse, shifted past the -1, in place (no second [n] buffer).
    int64_t* rank = inverse.mutable_data_ptr<int64_t>();
    parallel_chunks(n, kKeyGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) rank[i] = keys[i] < 0 ? -1 : rank[i] - shift;
    });
    out.rank = inverse;
    return out;
  }
  // Hashed in order of first occurrence, then the distinct codes sorted within each segment
  // of the code space (a table: every code of segment s lies in [segments[s], segments[s + 1])),
  // the segments in parallel.
  const auto outputs = call_op_outputs<3>("sparsekit::unique", "", codes);
  const Tensor& unique_codes = outputs[0];
  const int64_t num_unique = unique_codes.size(0);
  const int64_t* u = unique_codes.const_data_ptr<int64_t>();
  const size_t num_segments = segments.size() - 1;
  std::vector<int64_t> segment_of(static_cast<size_t>(num_unique));
  std::vector<int64_t> first(num_segments + 2, 0);  // [-1's segment, then each segment]
  for (int64_t g = 0; g < num_unique; ++g) {
    segment_of[g] = u[g] < 0 ? -1 : std::upper_bound(segments.begin(), segments.end(), u[g]) - segments.begin() - 1;
    ++first[segment_of[g] + 2];
  }
  for (size_t s = 0; s <= num_segments; ++s) first[s + 1] += first[s];
  std::vector<int64_t> by_code(static_cast<size_t>(num_unique));
  {
    std::vector<int64_t> cursor(first.begin(), first.end() - 1);
    for (int64_t g = 0; g < num_unique; ++g) by_code[cursor[segment_of[g] + 1]++] = g;
  }
  parallel_for(0, static_cast<int64_t>(num_segments), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      std::sort(by_code.begin() + first[s + 1], by_code.begin() + first[s + 2],
                [&](int64_t a, int64_t b) { return u[a] < u[b]; });
    }
  });
  const int64_t skipped = first[1];  // the -1, when present, sorts first
  out.distinct = empty({num_unique - skipped}, kLong, codes.device());
  int64_t* distinct = out.distinct.mutable_data_ptr<int64_t>();
  std::vector<int64_t> new_rank(static_cast<size_t>(num_unique), -1);
  for (int64_t i = skipped; i < num_unique; ++i) {
    distinct[i - skipped] = u[by_code[i]];
    new_rank[by_code[i]] = i - skipped;
  }
  const int64_t* inv = outputs[1].const_data_ptr<int64_t>();
  out.rank = empty({n}, kLong, codes.device());
  int64_t* rank = out.rank.mutable_data_ptr<int64_t>();
  parallel_chunks(n, kKeyGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rank[i] = new_rank[inv[i]];
  });
  return out;
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("unique_bounded", TORCH_BOX(&unique_bounded_cpu));
}

}  // namespace sparsekit
