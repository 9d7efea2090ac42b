// Hash-based unique on the CPU, in order of first occurrence.
//
// The keys are cut into one contiguous chunk per thread. Each thread dedups its chunk
// with a private open-addressing table (no atomics, no sharing), numbering the keys in
// order of first occurrence within the chunk and writing these local ids straight into
// `inverse`. The chunk tables are then merged in chunk order into chunk 0's table, which
// becomes the global one: each later chunk's keys, in their local order, take the id the
// global table has for them or else the next new ids. Appending in (chunk, local id)
// order is exactly global first-occurrence order, so the output is the same whatever the
// thread count. Each merge runs on all threads (lookups first, then the new keys, whose
// ids follow from a prefix count), and a last parallel pass turns the local ids of
// chunks 1.. in `inverse` into global ids.
//
// Why this shape: every key costs one probe of a table that is private and, for the hot
// keys, cached; the merge touches each chunk's distinct keys only. Tables are sized from
// an estimate of the distinct count taken on a sample of the keys, not from the number
// of keys: a table sized for every key to be distinct would be mostly empty, and each
// page of it costs a page fault and each probe a likelier cache miss.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "common.h"

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
    const double m = static_cast<double>(registers_.size());
    double harmonic = 0;
    int64_t zeros = 0;
    for (uint8_t r : registers_) {
      harmonic += std::ldexp(1.0, -r);
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
/// kSampleBlock keys, every 16th block in one sketch and every 64th in another. For the
/// key distributions met in practice (all distinct, Zipf, hot keys over a long tail,
/// sorted) the distinct count grows like a power of the sample size, so the whole range
/// holds about d16 * (d16 / d64)^2. Reading 1/16 of the keys instead of all of them saves
/// most of the cost of a full sketch (a sixth of the op). Keys drawn again and again from
/// a small range come out up to ~4x high, which costs table memory only; an estimate
/// that comes out low costs a table growth.
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
    const double d16 = every16_.estimate(), d64 = every64_.estimate();
    const double growth = d64 < 1 ? 4.0 : std::min(4.0, std::max(1.0, d16 / d64));
    return d16 * growth * growth;
  }

 private:
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
    TORCH_CHECK(slots_ != nullptr, "unique: out of memory for a table of ", num_slots, " slots");
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
  at::parallel_for(0, chunk->num_slots(), kScanGrain, [&](int64_t begin, int64_t end) {
    chunk->write_counts(begin, end, counts.data());
  });
  const std::vector<key_t> keys = chunk->take_keys();
  chunk.reset();

  // Keys the global table has: their global id. The others are new: count them per block.
  std::vector<id_t> ids(num_keys);
  const int64_t num_blocks = (num_keys + kScanGrain - 1) / kScanGrain;
  std::vector<int64_t> new_before(num_blocks + 1, 0);
  at::parallel_for(0, num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
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
  at::parallel_for(0, num_blocks, 1, [&](int64_t b_begin, int64_t b_end) {
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

template <typename key_t, typename id_t>
void unique_kernel(const key_t* keys, int64_t n, at::Tensor& unique_keys, int64_t* inverse, at::Tensor& counts) {
  using table_t = LocalTable<key_t, id_t>;
  const int64_t num_chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / kMinChunk));
  auto chunk_begin = [&](int64_t c) { return n * c / num_chunks; };

  // Size every chunk's table from an estimate of its distinct keys; chunk 0's table
  // becomes the global one, so it is sized for all of them.
  std::vector<int64_t> expected(num_chunks);
  std::vector<SampledDistinct> sketches(num_chunks);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const int64_t length = chunk_begin(c + 1) - chunk_begin(c);
      if (n < kMinSketched) {
        expected[c] = length;
        continue;
      }
      sketches[c].add(keys, chunk_begin(c), chunk_begin(c + 1));
      expected[c] = std::min<int64_t>(length, static_cast<int64_t>(sketches[c].estimate() * 1.05) + 16);
    }
  });
  if (num_chunks > 1 && n >= kMinSketched) {
    for (int64_t c = 1; c < num_chunks; ++c) sketches[0].merge(sketches[c]);
    expected[0] = std::min<int64_t>(n, static_cast<int64_t>(sketches[0].estimate() * 1.05) + 16);
  }

  // Each chunk: local ids in order of first occurrence within the chunk.
  std::vector<std::unique_ptr<table_t>> tables(num_chunks);
  at::parallel_for(0, num_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      tables[c] = std::make_unique<table_t>(expected[c]);
      table_t& table = *tables[c];
      const key_t* chunk_keys = keys + chunk_begin(c);
      int64_t* chunk_inverse = inverse + chunk_begin(c);
      probe_each(table, chunk_keys, chunk_begin(c + 1) - chunk_begin(c), [&](int64_t i, uint64_t hash) {
        chunk_inverse[i] = table.add(chunk_keys[i], hash, 1);
      });
    }
  });

  table_t& global = *tables[0];
  std::vector<std::vector<id_t>> global_ids(num_chunks);
  for (int64_t c = 1; c < num_chunks; ++c) global_ids[c] = merge_into(global, std::move(tables[c]));

  const int64_t num_unique = global.size();
  unique_keys = at::empty({num_unique}, unique_keys.options());
  counts = at::empty({num_unique}, counts.options());
  std::memcpy(unique_keys.data_ptr<key_t>(), global.keys().data(), num_unique * sizeof(key_t));
  int64_t* out_counts = counts.data_ptr<int64_t>();
  at::parallel_for(0, global.num_slots(), kScanGrain, [&](int64_t begin, int64_t end) {
    global.write_counts(begin, end, out_counts);
  });
  if (num_chunks > 1) {
    at::parallel_for(chunk_begin(1), n, kScanGrain, [&](int64_t begin, int64_t end) {
      for (int64_t c = 1; c < num_chunks; ++c) {
        const id_t* ids = global_ids[c].data();
        for (int64_t i = std::max(begin, chunk_begin(c)), e = std::min(end, chunk_begin(c + 1)); i < e; ++i) {
          inverse[i] = ids[inverse[i]];
        }
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> unique_cpu(const at::Tensor& keys_in) {
  check_key_tensor(keys_in, "unique", "keys");
  TORCH_CHECK(keys_in.device().is_cpu(), "unique: expected a CPU tensor, got ", keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const int64_t n = keys.numel();
  at::Tensor unique_keys = at::empty({0}, keys.options());
  at::Tensor inverse = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  at::Tensor counts = at::empty({0}, keys.options().dtype(at::kLong));
  if (n == 0) return {unique_keys, inverse, counts};
  int64_t* inv = inverse.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "unique_cpu", [&] {
    using key_t = index_t;
    // 32-bit ids and counts halve the slot; they hold any id and count below 2^31.
    if (n < (int64_t{1} << 31)) {
      unique_kernel<key_t, int32_t>(keys.data_ptr<key_t>(), n, unique_keys, inv, counts);
    } else {
      unique_kernel<key_t, int64_t>(keys.data_ptr<key_t>(), n, unique_keys, inv, counts);
    }
  });
  return {unique_keys, inverse, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("unique", &unique_cpu);
}

}  // namespace sparsekit
