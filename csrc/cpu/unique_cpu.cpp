// Hash-based unique on the CPU, in order of first occurrence. Each chunk of keys is deduped
// by a private table (no atomics), then the chunk tables merge in chunk order: (chunk, local
// id) order is global first-occurrence order, so the output does not depend on the threads.
// Tables are sized from a sampled distinct-count estimate, not the key count: a table sized
// for all-distinct keys is mostly empty and costs page faults and cache misses.
#include "cpu/parallel.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "common.h"
#include "parallel.h"
#include "scratch.h"
#include "unique_partitioned.h"

namespace sparsekit {
namespace {

// Below this many keys per thread, splitting costs more than it saves.
constexpr int64_t kMinChunk = 1 << 16;

// Keys ahead whose slot is prefetched: enough to cover a miss to L3/DRAM.
constexpr int64_t kPrefetchDistance = 64;
// 2^12 registers give a ~1.6% standard error, far inside the table's slack.
constexpr int kSketchBits = 12;
// Inputs shorter than this are sized by their length; the sketch would not pay.
constexpr int64_t kMinSketched = 1 << 14;
// Sampled blocks of consecutive keys: long enough to read whole cache lines and to hold
// any short period of the keys (a [batch, slots] layout, say).
constexpr int64_t kSampleBlock = 64;
// From this many keys, mostly distinct keys take the partitioned path (unique_partitioned.h):
// below it, the tables fit in the caches anyway.
constexpr int64_t kMinPartitioned = 1 << 18;
// Grain of the parallel passes (table walks, merge blocks, the inverse remap).
constexpr int64_t kScanGrain = 1 << 14;

/// @brief HyperLogLog sketch of the number of distinct hashes.
class DistinctSketch {
 public:
  void add(uint64_t hash) {
    const uint64_t index = hash >> (64 - kSketchBits);
    // The guard bit bounds the rank when the remaining bits are all zero.
    const uint64_t rest = (hash << kSketchBits) | (uint64_t{1} << (kSketchBits - 1));
    const uint8_t rank = static_cast<uint8_t>(__builtin_clzll(rest) + 1);
    // Rarely true: skipping the store keeps hot keys from chaining through memory.
    if (rank > registers_[index]) registers_[index] = rank;
  }

  void merge(const DistinctSketch& other) {
    for (size_t r = 0; r < registers_.size(); ++r) registers_[r] = std::max(registers_[r], other.registers_[r]);
  }

  double estimate() const {
    // 2^-rank by table: std::ldexp per register is a measurable share of the op.
    static const std::array<double, 66> kInversePowers = [] {
      std::array<double, 66> powers{};
      for (size_t r = 0; r < powers.size(); ++r) powers[r] = std::ldexp(1.0, -static_cast<int>(r));
      return powers;
    }();
    const double m = static_cast<double>(registers_.size());
    double harmonic = 0;
    int64_t zeros = 0;
    for (uint8_t r : registers_) {
      harmonic += kInversePowers[r];
      zeros += r == 0;
    }
    const double raw = 0.7213 / (1 + 1.079 / m) * m * m / harmonic;
    // Linear counting is the better estimate while many registers are still empty.
    if (raw <= 2.5 * m && zeros > 0) return m * std::log(m / static_cast<double>(zeros));
    return raw;
  }

 private:
  std::array<uint8_t, size_t{1} << kSketchBits> registers_{};
};

/// @brief Estimate of the distinct keys of a range, from a sample of it: blocks of
/// kSampleBlock keys, every 16th block in one sketch and every 64th in another; the distinct
/// count grows like a power of the sample size, so the range holds about d16 * (d16 / d64)^2.
/// A high estimate costs table memory only; a low one costs a table growth.
class SampledDistinct {
 public:
  template <typename key_t>
  void add(const key_t* keys, int64_t begin, int64_t end) {
    // Block numbers count from 0 so that the chunks of one input sample the same blocks.
    for (int64_t block = (begin + kSampleBlock * 16 - 1) / (kSampleBlock * 16) * 16; block * kSampleBlock < end;
         block += 16) {
      const bool both = block % 64 == 0;
      for (int64_t i = std::max(begin, block * kSampleBlock); i < std::min(end, (block + 1) * kSampleBlock); ++i) {
        const uint64_t hash = mix_key(keys[i]);
        every16_.add(hash);
        if (both) every64_.add(hash);
      }
    }
  }

  void merge(const SampledDistinct& other) {
    every16_.merge(other.every16_);
    every64_.merge(other.every64_);
  }

  double estimate() const {
    const double growth = growth_per_4x();
    return every16_.estimate() * growth * growth;
  }

  /// e in "distinct keys ~ length^e" (0: a few keys repeated, 1: all distinct).
  double exponent() const { return std::log(growth_per_4x()) / std::log(4.0); }


 private:
  // How much the distinct count grows when the sample grows 4x, within [1, 4].
  double growth_per_4x() const {
    const double d16 = every16_.estimate(), d64 = every64_.estimate();
    return d64 < 1 ? 4.0 : std::min(4.0, std::max(1.0, d16 / d64));
  }

  DistinctSketch every16_, every64_;
};

template <typename key_t, typename id_t>
struct Slot {
  key_t key;
  id_t id;
  id_t count;  // 0 marks a free slot: every key value is valid, so the key cannot
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

/// @brief Open-addressing table (linear probing) with the count of each key in its
/// slot, which the probe has in cache anyway. Keys get ids 0, 1, ... in order of first
/// insertion; keys() lists them in that order.
///
/// add() is for one thread. add_if_present() and insert_absent() may run on many threads
/// at once (the merge), each on keys no other thread touches: they read the counts that
/// other threads write atomically, and claim free slots with a compare-and-swap.
template <typename key_t, typename id_t>
class LocalTable {
 public:
  using slot_t = Slot<key_t, id_t>;
  static constexpr id_t kAbsent = -1;

  explicit LocalTable(int64_t expected_keys) {
    allocate(slots_for(expected_keys));
    keys_.reserve(expected_keys);
  }

  static uint64_t hash_key(key_t key) { return mix_key(static_cast<int64_t>(key)); }
  uint64_t slot_of(uint64_t hash) const { return hash & mask_; }
  void prefetch_slot(uint64_t slot) const { __builtin_prefetch(&slots_[slot], 1); }

  /// Adds `occurrences` to the count of key, whose hash is `hash`; a new key is appended
  /// with the next id. Returns its id. May grow the table: callers hold hashes, never
  /// slots, across calls, since a slot is only valid under the mask it was taken with.
  id_t add(key_t key, uint64_t hash, id_t occurrences) {
    uint64_t slot = slot_of(hash);
    while (slots_[slot].count != 0) {
      if (slots_[slot].key == key) {
        slots_[slot].count += occurrences;
        return slots_[slot].id;
      }
      slot = (slot + 1) & mask_;
    }
    if (!fits(size() + 1)) {
      // Only when the distinct-count estimate was far off: grow and probe again.
      rehash(2 * num_slots_);
      return add(key, hash, occurrences);
    }
    const id_t id = static_cast<id_t>(size());
    slots_[slot] = slot_t{key, id, occurrences};
    keys_.push_back(key);
    return id;
  }

  /// Adds `occurrences` to the count of key and returns its id, or kAbsent.
  id_t add_if_present(key_t key, uint64_t hash, id_t occurrences) {
    uint64_t slot = slot_of(hash);
    while (__atomic_load_n(&slots_[slot].count, __ATOMIC_RELAXED) != 0) {
      if (slots_[slot].key == key) {
        __atomic_fetch_add(&slots_[slot].count, occurrences, __ATOMIC_RELAXED);
        return slots_[slot].id;
      }
      slot = (slot + 1) & mask_;
    }
    return kAbsent;
  }

  /// Stores a key known to be absent under `id`, in the first free slot of its probe.
  void insert_absent(key_t key, uint64_t hash, id_t id, id_t occurrences) {
    uint64_t slot = slot_of(hash);
    while (true) {
      id_t free = 0;
      if (__atomic_compare_exchange_n(&slots_[slot].count, &free, occurrences, /*weak=*/false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        slots_[slot].key = key;
        slots_[slot].id = id;
        return;
      }
      slot = (slot + 1) & mask_;
    }
  }

  /// Makes room for `count` more keys (ids size() .. size() + count - 1), to be stored by
  /// insert_absent; returns where their keys go.
  key_t* extend(int64_t count) {
    if (!fits(size() + count)) {
      int64_t num_slots = num_slots_;
      while (!fits(size() + count, num_slots)) num_slots <<= 1;
      rehash(num_slots);
    }
    keys_.resize(keys_.size() + count);
    return keys_.data() + keys_.size() - count;
  }

  int64_t size() const { return static_cast<int64_t>(keys_.size()); }
  const std::vector<key_t>& keys() const { return keys_; }
  std::vector<key_t> take_keys() { return std::move(keys_); }
  int64_t num_slots() const { return num_slots_; }

  /// Writes counts[id] for the keys in slots [begin, end) (a share of a parallel walk).
  template <typename count_t>
  void write_counts(int64_t begin, int64_t end, count_t* counts) const {
    for (int64_t s = begin; s < end; ++s) {
      if (slots_[s].count != 0) counts[slots_[s].id] = slots_[s].count;
    }
  }

 private:
  // Linear probing stays short up to 3/4 full.
  bool fits(int64_t keys, int64_t num_slots) const { return 4 * keys <= 3 * num_slots; }
  bool fits(int64_t keys) const { return fits(keys, num_slots_); }

  // Power of two with the expected keys filling at most 60% of it.
  static int64_t slots_for(int64_t expected_keys) {
    int64_t num_slots = 16;
    while (3 * num_slots < 5 * expected_keys) num_slots <<= 1;
    return num_slots;
  }

  void allocate(int64_t num_slots) {
    // calloc: zeroed (all free) pages straight from the OS, no fill pass.
    slots_.reset(static_cast<slot_t*>(std::calloc(num_slots, sizeof(slot_t))));
    SK_CHECK(slots_ != nullptr, "unique: out of memory for a table of ", num_slots, " slots");
    num_slots_ = num_slots;
    mask_ = static_cast<uint64_t>(num_slots) - 1;
  }

  void rehash(int64_t num_slots) {
    std::unique_ptr<slot_t[], FreeDeleter> old = std::move(slots_);
    const int64_t old_slots = num_slots_;
    allocate(num_slots);
    for (int64_t o = 0; o < old_slots; ++o) {
      if (old[o].count == 0) continue;
      uint64_t s = slot_of(hash_key(old[o].key));
      while (slots_[s].count != 0) s = (s + 1) & mask_;
      slots_[s] = old[o];
    }
  }

  std::unique_ptr<slot_t[], FreeDeleter> slots_;
  int64_t num_slots_ = 0;
  uint64_t mask_ = 0;
  std::vector<key_t> keys_;
};

/// @brief Calls visit(i, hash) for i in [0, num_keys) in order, with the hash of keys[i].
/// Hashes are computed once, kPrefetchDistance keys ahead, and the key's home slot
/// prefetched, so it is in cache (or on its way) when the key is probed. The hash, not
/// the slot, is handed on: visit may grow the table, and a slot taken under the old mask
/// would start the probe in the wrong place (the key would be missed and added twice).
template <typename table_t, typename key_t, typename visit_fn>
void probe_each(const table_t& table, const key_t* keys, int64_t num_keys, const visit_fn& visit) {
  uint64_t ahead[kPrefetchDistance];
  for (int64_t i = 0; i < std::min(num_keys, kPrefetchDistance); ++i) {
    ahead[i] = table_t::hash_key(keys[i]);
    table.prefetch_slot(table.slot_of(ahead[i]));
  }
  for (int64_t i = 0; i < num_keys; ++i) {
    const uint64_t hash = ahead[i % kPrefetchDistance];
    if (i + kPrefetchDistance < num_keys) {
      const uint64_t next = table_t::hash_key(keys[i + kPrefetchDistance]);
      ahead[i % kPrefetchDistance] = next;
      table.prefetch_slot(table.slot_of(next));
    }
    visit(i, hash);
  }
}

/// @brief Merges a later chunk's table into the global one. Its keys, in its id order,
/// take their global id when the global table has them already and the next new global
/// ids otherwise, so that global ids stay in order of first occurrence. Returns the
/// global id of each of its ids.
template <typename key_t, typename id_t>
std::vector<id_t> merge_into(LocalTable<key_t, id_t>& global, std::unique_ptr<LocalTable<key_t, id_t>> chunk) {
  const int64_t num_keys = chunk->size();
  std::vector<id_t> counts(num_keys);
  parallel_chunks(chunk->num_slots(), kScanGrain, [&](int64_t begin, int64_t end) {
    chunk->write_counts(begin, end, counts.data());
  });
  const std::vector<key_t> keys = chunk->take_keys();
  chunk.reset();

  // Keys the global table has: their global id. The others are new: count them per block.
  std::vector<id_t> ids(num_keys);
  const int64_t num_blocks = (num_keys + kScanGrain - 1) / kScanGrain;
  std::vector<int64_t> new_before(num_blocks + 1, 0);
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kScanGrain, length = std::min(kScanGrain, num_keys - begin);
      probe_each(global, keys.data() + begin, length, [&](int64_t i, uint64_t hash) {
        ids[begin + i] = global.add_if_present(keys[begin + i], hash, counts[begin + i]);
        new_before[b + 1] += ids[begin + i] == global.kAbsent;
      });
    }
  });
  for (int64_t b = 0; b < num_blocks; ++b) new_before[b + 1] += new_before[b];

  // New keys: ids in block order, then in order within the block.
  const int64_t first_new = global.size();
  key_t* new_keys = global.extend(new_before[num_blocks]);
  parallel_chunks(num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kScanGrain, length = std::min(kScanGrain, num_keys - begin);
      int64_t next = new_before[b];
      probe_each(global, keys.data() + begin, length, [&](int64_t i, uint64_t hash) {
        if (ids[begin + i] != global.kAbsent) return;
        ids[begin + i] = static_cast<id_t>(first_new + next);
        new_keys[next++] = keys[begin + i];
        global.insert_absent(keys[begin + i], hash, ids[begin + i], counts[begin + i]);
      });
    }
  });
  return ids;
}

/// @brief The contiguous ranges of keys that the threads dedup, one table per range.
/// Each thread starts on a range of its own (1/threads of the keys) and takes its keys a
/// block at a time; a thread that runs out takes the back half of the range with the most
/// keys left, as a new range with a table of its own. A thread slowed down by another
/// process on its core then holds up the call by a fraction of a block, while on an idle
/// machine the split stays close to one range per thread (few tables to merge). The
/// output does not depend on the split: ranges are merged in key order.
class KeyRanges {
 public:
  struct Range {
    int64_t begin, next, end;  // next: the first key no thread has taken yet
  };

  KeyRanges(int64_t n, int64_t initial) : initial_(initial) {
    // Every split leaves both halves at least kMinSplit / 2 keys long.
    ranges_.reserve(initial + 2 * n / kMinSplit + 1);
    for (int64_t r = 0; r < initial; ++r) ranges_.push_back({n * r / initial, n * r / initial, n * (r + 1) / initial});
  }

  /// Splits are only worth it when the keys repeat a lot: a split-off range's distinct
  /// keys cost two probes of the (large, uncached) global table when it is merged, where
  /// leaving them to the range's thread costs one probe of its table each.
  void allow_splits(bool allow) { splits_ = allow; }

  /// The next range to work on (an initial one nobody has started, else a split), or -1.
  int64_t take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (started_ < initial_) return started_++;
    if (!splits_) return -1;
    int64_t fullest = -1;
    for (int64_t r = 0; r < static_cast<int64_t>(ranges_.size()); ++r) {
      const Range& range = ranges_[r];
      if (range.end - range.next >= kMinSplit &&
          (fullest < 0 || range.end - range.next > ranges_[fullest].end - ranges_[fullest].next)) {
        fullest = r;
      }
    }
    if (fullest < 0 || static_cast<int64_t>(ranges_.size()) == static_cast<int64_t>(ranges_.capacity())) return -1;
    Range& victim = ranges_[fullest];
    const int64_t middle = victim.next + (victim.end - victim.next) / 2;
    ranges_.push_back({middle, middle, victim.end});
    ranges_[fullest].end = middle;
    return static_cast<int64_t>(ranges_.size()) - 1;
  }

  /// Claims the next block of range r as [begin, end); false once the range is used up.
  bool claim(int64_t r, int64_t& begin, int64_t& end) {
    std::lock_guard<std::mutex> lock(mutex_);
    Range& range = ranges_[r];
    if (range.next >= range.end) return false;
    begin = range.next;
    end = std::min(range.end, range.next + kClaimBlock);
    range.next = end;
    return true;
  }

  Range range(int64_t r) {
    std::lock_guard<std::mutex> lock(mutex_);
    return ranges_[r];
  }
  /// Call when no thread works any more.
  const std::vector<Range>& ranges() const { return ranges_; }
  int64_t max_ranges() const { return static_cast<int64_t>(ranges_.capacity()); }

  // Keys taken at a time: enough that the lock is taken rarely, few enough that a thread
  // descheduled mid-block holds up little.
  static constexpr int64_t kClaimBlock = 1 << 13;
  // Ranges shorter than this are not split: the new table and its merge would cost more.
  static constexpr int64_t kMinSplit = 1 << 16;

 private:
  std::mutex mutex_;
  std::vector<Range> ranges_;
  const int64_t initial_;
  int64_t started_ = 0;
  bool splits_ = false;
};

template <typename key_t, typename id_t>
void unique_kernel(const key_t* keys, int64_t n, Tensor& unique_keys, int64_t* inverse, Tensor& counts) {
  using table_t = LocalTable<key_t, id_t>;
  const InlineWhileContended contended(n, kScanGrain);  // its block passes count blocks
  const int64_t threads = in_parallel_region() ? 1 : num_threads();
  const int64_t num_initial = std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinChunk));
  KeyRanges work(n, num_initial);

  // Size every initial range's table from an estimate of its distinct keys; range 0's
  // table becomes the global one, so it is sized for all of them. A range split off
  // later is sized from the whole input's estimate (its distinct keys grow like a power
  // of its length; the power comes from the sample too).
  std::vector<int64_t> expected(num_initial);
  std::vector<SampledDistinct> sketches(num_initial);
  parallel_chunks(num_initial, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const KeyRanges::Range range = work.range(c);
      const int64_t length = range.end - range.begin;
      if (n < kMinSketched) {
        expected[c] = length;
        continue;
      }
      sketches[c].add(keys, range.begin, range.end);
      expected[c] = std::min<int64_t>(length, static_cast<int64_t>(sketches[c].estimate() * 1.05) + 16);
    }
  });
  if (num_initial > 1 && n >= kMinSketched) {
    for (int64_t c = 1; c < num_initial; ++c) sketches[0].merge(sketches[c]);
    expected[0] = std::min<int64_t>(n, static_cast<int64_t>(sketches[0].estimate() * 1.05) + 16);
  }
  // Mostly distinct keys: tables per thread would outgrow the caches, and merging them
  // would probe every distinct key twice more.
  if (n >= kMinPartitioned && n < (int64_t{1} << 31) && 4 * expected[0] > n) {
    partitioned::unique_partitioned(keys, n, expected[0], unique_keys, inverse, counts);
    return;
  }
  const double exponent = n >= kMinSketched ? sketches[0].exponent() : 1.0;
  // Keys that repeat at least 4x on average: the merge of a split-off piece is cheap.
  work.allow_splits(n >= kMinSketched && 4 * expected[0] <= n);
  auto expected_for = [&](int64_t r, int64_t length) -> int64_t {
    if (r < num_initial) return expected[r];
    const double share = static_cast<double>(length) / static_cast<double>(n);
    return std::min<int64_t>(length, static_cast<int64_t>(expected[0] * std::pow(share, exponent) * 1.05) + 16);
  };

  // Each range: local ids in order of first occurrence within the range.
  std::vector<std::unique_ptr<table_t>> tables(work.max_ranges());
  if (num_initial == 1) {
    tables[0] = std::make_unique<table_t>(expected[0]);
    table_t& table = *tables[0];
    probe_each(table, keys, n, [&](int64_t i, uint64_t hash) { inverse[i] = table.add(keys[i], hash, 1); });
  } else {
    parallel_for(0, num_initial, 1, [&](int64_t, int64_t) {
      for (int64_t r = work.take(); r >= 0; r = work.take()) {
        const KeyRanges::Range range = work.range(r);
        tables[r] = std::make_unique<table_t>(expected_for(r, range.end - range.begin));
        table_t& table = *tables[r];
        for (int64_t begin, end; work.claim(r, begin, end);) {
          // One thread per range, its blocks in order: local ids follow first occurrence.
          probe_each(table, keys + begin, end - begin, [&](int64_t i, uint64_t hash) {
            inverse[begin + i] = table.add(keys[begin + i], hash, 1);
          });
        }
      }
    });
  }

  // Merge the ranges' tables into range 0's, in key order.
  const std::vector<KeyRanges::Range>& ranges = work.ranges();
  std::vector<int64_t> order(ranges.size());
  for (size_t r = 0; r < ranges.size(); ++r) order[r] = static_cast<int64_t>(r);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ranges[a].begin < ranges[b].begin; });
  table_t& global = *tables[0];
  std::vector<std::vector<id_t>> global_ids(ranges.size());
  for (size_t o = 1; o < order.size(); ++o) {
    if (ranges[order[o]].begin == ranges[order[o]].end) continue;
    global_ids[order[o]] = merge_into(global, std::move(tables[order[o]]));
  }

  const int64_t num_unique = global.size();
  unique_keys = empty({num_unique}, unique_keys.scalar_type(), unique_keys.device());
  counts = empty({num_unique}, counts.scalar_type(), counts.device());
  std::memcpy(unique_keys.mutable_data_ptr<key_t>(), global.keys().data(), num_unique * sizeof(key_t));
  int64_t* out_counts = counts.mutable_data_ptr<int64_t>();
  parallel_chunks(global.num_slots(), kScanGrain, [&](int64_t begin, int64_t end) {
    global.write_counts(begin, end, out_counts);
  });
  if (order.size() > 1) {
    const int64_t first = ranges[order[1]].begin;
    parallel_chunks(n - first, kScanGrain, [&](int64_t begin, int64_t end) {
      begin += first;
      end += first;
      for (size_t o = 1; o < order.size(); ++o) {
        const KeyRanges::Range& range = ranges[order[o]];
        const id_t* ids = global_ids[order[o]].data();
        for (int64_t i = std::max(begin, range.begin), e = std::min(end, range.end); i < e; ++i) {
          inverse[i] = ids[inverse[i]];
        }
      }
    });
  }
}

std::tuple<Tensor, Tensor, Tensor> unique_cpu(const Tensor& keys_in) {
  check_key_tensor(keys_in, "unique", "keys");
  SK_CHECK(keys_in.device().is_cpu(), "unique: expected a CPU tensor, got ", keys_in.device());
  const Tensor keys = as_contiguous(keys_in);
  const int64_t n = keys.numel();
  Tensor unique_keys = empty({0}, keys.scalar_type(), keys.device());
  Tensor inverse = empty(keys.sizes(), kLong, keys.device());
  Tensor counts = empty({0}, kLong, keys.device());
  if (n == 0) return {unique_keys, inverse, counts};
  int64_t* inv = inverse.mutable_data_ptr<int64_t>();
  SK_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_cpu", [&] {
    using key_t = index_t;
    // 32-bit ids and counts halve the slot; they hold any id and count below 2^31.
    if (n < (int64_t{1} << 31)) {
      unique_kernel<key_t, int32_t>(keys.mutable_data_ptr<key_t>(), n, unique_keys, inv, counts);
    } else {
      unique_kernel<key_t, int64_t>(keys.mutable_data_ptr<key_t>(), n, unique_keys, inv, counts);
    }
  });
  return {unique_keys, inverse, counts};
}

/// @brief An open-addressing table of one dedup at a time in a thread's scratch memory,
/// sized for every key to be distinct (it never grows): unique_tables dedups many small
/// key sets, where a fresh calloc'd table each would cost its page faults every call.
template <typename key_t>
class ScratchTable {
 public:
  struct Slot {
    key_t key;
    int64_t id;  // local id + 1; 0 marks a free slot
  };

  ScratchTable(Scratch& scratch, int64_t max_keys) {
    int64_t num_slots = 16;
    while (3 * num_slots < 5 * max_keys) num_slots <<= 1;
    slots_ = static_cast<Slot*>(scratch.get(num_slots * sizeof(Slot)));
    std::memset(static_cast<void*>(slots_), 0, num_slots * sizeof(Slot));
    mask_ = static_cast<uint64_t>(num_slots) - 1;
  }

  static uint64_t hash_key(key_t key) { return mix_key(static_cast<int64_t>(key)); }
  uint64_t slot_of(uint64_t hash) const { return hash & mask_; }
  void prefetch_slot(uint64_t slot) const { __builtin_prefetch(&slots_[slot], 1); }

  /// The id of key; a new key takes the next id and is appended to `keys`.
  int64_t add(key_t key, uint64_t hash, std::vector<key_t>& keys) {
    uint64_t slot = slot_of(hash);
    while (slots_[slot].id != 0) {
      if (slots_[slot].key == key) return slots_[slot].id - 1;
      slot = (slot + 1) & mask_;
    }
    const int64_t id = static_cast<int64_t>(keys.size());
    slots_[slot] = Slot{key, id + 1};
    keys.push_back(key);
    return id;
  }

 private:
  Slot* slots_ = nullptr;
  uint64_t mask_ = 0;
};

/// @brief Distinct keys per table: segment s, keys[offsets[s] : offsets[s + 1]], belongs to
/// table tables[s]. Returns the distinct keys table after table (table 0 first), each
/// table's in order of first occurrence over its segments in segment order; inverse with
/// keys[i] == unique_keys[inverse[i]]; and each table's distinct count. Each table is deduped
/// by one thread (largest first), so many small tables cost one pass and no merge.
std::tuple<Tensor, Tensor, Tensor> unique_tables_cpu(const Tensor& keys_in, const std::vector<int64_t>& offsets,
                                                     const std::vector<int64_t>& tables, int64_t num_tables) {
  const char* op = "unique_tables";
  check_key_tensor(keys_in, op, "keys");
  SK_CHECK(keys_in.device().is_cpu(), op, ": expected a CPU tensor, got ", keys_in.device());
  SK_CHECK(keys_in.dim() == 1, op, ": keys must be 1-D, got shape ", keys_in.sizes());
  // Per-table bookkeeping is allocated for every table: 2^20 tables is far beyond any model.
  SK_CHECK(num_tables >= 0 && num_tables <= (int64_t{1} << 20), op, ": num_tables must lie in [0, 2^20], got ",
           num_tables);
  const int64_t n = keys_in.numel();
  const InlineWhileContended contended(n, kScanGrain);  // its tables are handed out one by one
  const int64_t num_segments = static_cast<int64_t>(tables.size());
  SK_CHECK(static_cast<int64_t>(offsets.size()) == num_segments + 1, op,
           ": offsets must hold one more entry than tables (", num_segments + 1, "), got ", offsets.size());
  SK_CHECK(offsets.front() == 0 && offsets.back() == n, op, ": offsets must run from 0 to ", n, ", got ",
           offsets.front(), " .. ", offsets.back());
  std::vector<std::vector<int64_t>> segments_of(num_tables);
  std::vector<int64_t> keys_of(num_tables, 0);
  for (int64_t s = 0; s < num_segments; ++s) {
    SK_CHECK(offsets[s] <= offsets[s + 1], op, ": offsets must never decrease, got offsets[", s, "] = ",
             offsets[s], " > offsets[", s + 1, "] = ", offsets[s + 1]);
    SK_CHECK(tables[s] >= 0 && tables[s] < num_tables, op, ": tables[", s, "] = ", tables[s],
             " is not a table in [0, ", num_tables, ")");
    if (offsets[s + 1] == offsets[s]) continue;
    segments_of[tables[s]].push_back(s);
    keys_of[tables[s]] += offsets[s + 1] - offsets[s];
  }
  const Tensor keys = as_contiguous(keys_in);
  Tensor inverse = empty({n}, kLong, keys.device());
  Tensor per_table = empty({num_tables}, kLong, keys.device());
  int64_t* inv = inverse.mutable_data_ptr<int64_t>();
  std::vector<int64_t> work;
  for (int64_t t = 0; t < num_tables; ++t) {
    if (keys_of[t] > 0) work.push_back(t);
  }
  // Largest first: the last tables handed out are the short ones.
  std::stable_sort(work.begin(), work.end(), [&](int64_t a, int64_t b) { return keys_of[a] > keys_of[b]; });
  Tensor unique_keys;
  SK_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_tables_cpu", [&] {
    using key_t = index_t;
    const key_t* k = keys.const_data_ptr<key_t>();
    std::vector<std::vector<key_t>> distinct(num_tables);
    parallel_chunks(static_cast<int64_t>(work.size()), 1, [&](int64_t w_begin, int64_t w_end) {
      thread_local Scratch scratch;
      const TrimOnExit trim_table{scratch};  // on an error too (a std::bad_alloc of `out`)
      for (int64_t w = w_begin; w < w_end; ++w) {
        const int64_t t = work[w];
        ScratchTable<key_t> table(scratch, keys_of[t]);
        std::vector<key_t>& out = distinct[t];
        for (const int64_t s : segments_of[t]) {
          const int64_t begin = offsets[s];
          probe_each(table, k + begin, offsets[s + 1] - begin, [&](int64_t i, uint64_t hash) {
            inv[begin + i] = table.add(k[begin + i], hash, out);
          });
        }
      }
    });
    // Table t's ids start after the distinct keys of tables 0 .. t-1.
    std::vector<int64_t> base(num_tables + 1, 0);
    int64_t* counts = per_table.mutable_data_ptr<int64_t>();
    for (int64_t t = 0; t < num_tables; ++t) {
      counts[t] = static_cast<int64_t>(distinct[t].size());
      base[t + 1] = base[t] + counts[t];
    }
    unique_keys = empty({base[num_tables]}, keys.scalar_type(), keys.device());
    key_t* u = unique_keys.mutable_data_ptr<key_t>();
    for (int64_t t = 0; t < num_tables; ++t) {
      std::copy(distinct[t].begin(), distinct[t].end(), u + base[t]);
    }
    std::vector<int64_t> segment_base(num_segments);
    for (int64_t s = 0; s < num_segments; ++s) segment_base[s] = base[tables[s]];
    parallel_chunks(n, kScanGrain, [&](int64_t begin, int64_t end) {
      for_each_table_range(offsets, begin, end, [&](int64_t s, int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) inv[i] += segment_base[s];
      });
    });
  });
  return {unique_keys, inverse, per_table};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("unique", TORCH_BOX(&unique_cpu));
  m.impl("unique_tables", TORCH_BOX(&unique_tables_cpu));
}

}  // namespace sparsekit
