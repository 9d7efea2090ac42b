#pragma once
// Which prefetch plan a large pooling call takes, chosen by measuring both.
//
// embedding_bag's pooling loops prefetch every line of a row some lookups ahead (the
// "every line" plan, embedding_cpu.cpp). On the 2-core VM of the benchmarks that plan is
// the faster one for rows of 1-4 lines, for skewed rows and on one thread, by 1.2-2x. But
// the VM spends minutes at a time in a state where two threads reading rows of 8 lines
// (D = 128 float32) at random get no more from the memory than one: then prefetching only a
// row's first line and leaving the rest to the hardware's prefetchers (the "first line"
// plan) moves the same uniform rows 1.2-1.3x faster on two threads (nn.EmbeddingBag 4.1-4.3
// ms, every line 4.3-4.6 ms, first line 3.4-3.5 ms), while it stays 1.2-1.3x slower in the
// other state and 1.3-1.5x slower for Zipf rows in both. Nothing the process can read tells
// the two states apart, so a call that reads enough memory for its time to say which plan
// is faster times itself, and the calls like it take the faster plan, trying the other
// now and then. The plans sum the same rows in the same order: the choice changes the
// time of a call, never its result.
//
// The environment variable SPARSEKIT_POOL_PREFETCH ("every" or "first", read per call)
// forces one plan on every call whose rows have enough lines for the plans to differ, so
// that the tests run both and a benchmark can compare them; any other value, or none,
// leaves the choice to the measurements.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

namespace sparsekit {

enum class PrefetchPlan : int { kEveryLine = 0, kFirstLine = 1 };

/// @brief Picks between the two prefetch plans by their measured cost (seconds per byte of
/// rows read) in the calls of one kind.
///
/// The first calls alternate until each plan has kWarmupSamples costs. Then a call takes the
/// plan of lower cost, except that a probe of the other plan is due every `interval` calls:
/// the interval starts at kMinProbeInterval, doubles (up to kMaxProbeInterval) each time the
/// probed plan costs more than kProbeMargin times the best, and falls back to the minimum
/// when it wins or comes close. The chosen plan's cost is a moving average of its calls
/// (weight kAverageWeight for the newest); a probe's cost replaces the old figure of its
/// plan, which is stale by then. Thread-safe (one mutex; the call itself runs outside it).
class PlanChooser {
 public:
  static constexpr int kWarmupSamples = 2;
  static constexpr int64_t kMinProbeInterval = 16;
  static constexpr int64_t kMaxProbeInterval = 256;
  static constexpr double kProbeMargin = 1.1;
  static constexpr double kAverageWeight = 0.25;

  /// @brief The plan the next call takes.
  PrefetchPlan pick() {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++calls_;
    if (samples_[0] < kWarmupSamples || samples_[1] < kWarmupSamples) {
      return samples_[1] < samples_[0] ? PrefetchPlan::kFirstLine : PrefetchPlan::kEveryLine;
    }
    const PrefetchPlan best = best_locked();
    if (calls_ < next_probe_) return best;
    next_probe_ = calls_ + interval_;
    return other(best);
  }

  /// @brief Records that a call with `plan` cost `cost` (any positive measure, the same for
  /// every call of this chooser).
  void record(PrefetchPlan plan, double cost) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const int p = static_cast<int>(plan);
    if (samples_[0] < kWarmupSamples || samples_[1] < kWarmupSamples) {
      cost_[p] = samples_[p] == 0 ? cost : cost_[p] + kAverageWeight * (cost - cost_[p]);
      ++samples_[p];
      if (samples_[0] >= kWarmupSamples && samples_[1] >= kWarmupSamples) next_probe_ = calls_ + interval_;
      return;
    }
    ++samples_[p];
    if (plan == best_locked()) {
      cost_[p] += kAverageWeight * (cost - cost_[p]);
      return;
    }
    const double best_cost = cost_[1 - p];
    cost_[p] = cost;
    interval_ = cost > kProbeMargin * best_cost ? std::min(2 * interval_, kMaxProbeInterval) : kMinProbeInterval;
  }

  /// @brief The plan of lower cost so far (every line until both have been measured).
  PrefetchPlan best() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return samples_[0] < kWarmupSamples || samples_[1] < kWarmupSamples ? PrefetchPlan::kEveryLine : best_locked();
  }

  /// @brief Calls between two probes of the other plan, as things stand.
  int64_t probe_interval() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return interval_;
  }

 private:
  static PrefetchPlan other(PrefetchPlan plan) {
    return plan == PrefetchPlan::kEveryLine ? PrefetchPlan::kFirstLine : PrefetchPlan::kEveryLine;
  }
  PrefetchPlan best_locked() const {
    return cost_[1] < cost_[0] ? PrefetchPlan::kFirstLine : PrefetchPlan::kEveryLine;
  }

  std::mutex mutex_;
  std::array<double, 2> cost_{0.0, 0.0};
  std::array<int64_t, 2> samples_{0, 0};
  int64_t calls_ = 0;
  int64_t next_probe_ = 0;
  int64_t interval_ = kMinProbeInterval;
};

/// @brief The plan SPARSEKIT_POOL_PREFETCH forces, if it names one.
inline std::optional<PrefetchPlan> forced_prefetch_plan() {
  const char* value = std::getenv("SPARSEKIT_POOL_PREFETCH");
  if (value == nullptr) return std::nullopt;
  if (std::strcmp(value, "every") == 0) return PrefetchPlan::kEveryLine;
  if (std::strcmp(value, "first") == 0) return PrefetchPlan::kFirstLine;
  return std::nullopt;
}

}  // namespace sparsekit
