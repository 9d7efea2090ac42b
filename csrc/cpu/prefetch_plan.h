#pragma once
// Which prefetch plan a large pooling call takes ("every line" or "first line"), chosen by
// timing both: which one wins depends on how contended the memory is, which nothing the
// process can read tells. Both sum the same rows in the same order, so the choice changes a
// call's time, never its result. SPARSEKIT_POOL_PREFETCH=every|first forces one (tests).
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
/// rows read) in the calls of one kind: alternates until both have kWarmupSamples costs, then
/// takes the cheaper, probing the other every `interval` calls (doubled while it keeps
/// losing by kProbeMargin). Thread-safe (one mutex; the call itself runs outside it).
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
