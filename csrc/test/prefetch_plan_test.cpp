// C++ test of PlanChooser (csrc/cpu/prefetch_plan.h), the policy that picks embedding_bag's
// prefetch plan from measured costs, fed made-up costs. Run by ctest; exits non-zero on the
// first failure.
#include "cpu/prefetch_plan.h"

#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

namespace {

using sparsekit::PlanChooser;
using sparsekit::PrefetchPlan;

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

/// Runs `calls` calls in which every-line costs `every` and first-line `first`; returns the
/// plans taken.
std::vector<PrefetchPlan> run(PlanChooser& chooser, int calls, double every, double first) {
  std::vector<PrefetchPlan> taken;
  for (int i = 0; i < calls; ++i) {
    const PrefetchPlan plan = chooser.pick();
    chooser.record(plan, plan == PrefetchPlan::kEveryLine ? every : first);
    taken.push_back(plan);
  }
  return taken;
}

int64_t count(const std::vector<PrefetchPlan>& taken, PrefetchPlan plan, size_t from = 0) {
  int64_t n = 0;
  for (size_t i = from; i < taken.size(); ++i) n += taken[i] == plan;
  return n;
}

void test_warmup_alternates() {
  PlanChooser chooser;
  expect(chooser.best() == PrefetchPlan::kEveryLine, "every line before any measurement");
  const auto taken = run(chooser, 4, 1.0, 2.0);
  expect(taken == std::vector<PrefetchPlan>{PrefetchPlan::kEveryLine, PrefetchPlan::kFirstLine,
                                            PrefetchPlan::kEveryLine, PrefetchPlan::kFirstLine},
         "the first calls alternate until each plan has two costs");
  expect(chooser.best() == PrefetchPlan::kEveryLine, "then the cheaper plan is the best");
}

void test_exploits_and_backs_off() {
  PlanChooser chooser;
  const auto taken = run(chooser, 4 + 2000, 2.0, 1.0);  // first line twice as cheap
  expect(chooser.best() == PrefetchPlan::kFirstLine, "first line wins when it is cheaper");
  const int64_t probes = count(taken, PrefetchPlan::kEveryLine, 4);
  // Probes at calls 20, 36, 68, 132, 260, then every 256: 11 in 2004 calls.
  expect(probes == 11, "a losing plan is probed ever more rarely (" + std::to_string(probes) + ")");
  expect(chooser.probe_interval() == PlanChooser::kMaxProbeInterval, "the probe interval backs off to the maximum");
}

void test_close_costs_keep_probing() {
  PlanChooser chooser;
  run(chooser, 4 + 500, 1.0, 1.05);  // within the margin: probes stay frequent
  expect(chooser.probe_interval() == PlanChooser::kMinProbeInterval, "plans within 10% keep the shortest interval");
  expect(chooser.best() == PrefetchPlan::kEveryLine, "the cheaper of two close plans stays the best");
}

void test_follows_a_change_of_state() {
  PlanChooser chooser;
  run(chooser, 4 + 1000, 1.0, 1.5);  // every line cheaper: the interval backs off
  expect(chooser.best() == PrefetchPlan::kEveryLine, "every line wins in the first state");
  // The machine changes: every line now costs twice first line's cost. The next probe of
  // first line finds it cheaper and takes over within one probe interval.
  const auto taken = run(chooser, 2 * PlanChooser::kMaxProbeInterval + 8, 3.0, 1.5);
  expect(chooser.best() == PrefetchPlan::kFirstLine, "first line takes over after the change");
  expect(count(taken, PrefetchPlan::kFirstLine) >= PlanChooser::kMaxProbeInterval,
         "within one probe interval of the change");
  // And back again.
  run(chooser, 2 * PlanChooser::kMaxProbeInterval + 8, 1.0, 1.5);
  expect(chooser.best() == PrefetchPlan::kEveryLine, "every line takes back over when it is cheaper again");
}

void test_averages_the_chosen_plan() {
  PlanChooser chooser;
  run(chooser, 4, 1.0, 1.2);
  // One slow call of the chosen plan (noise) does not hand the choice over: its cost is
  // averaged with the earlier ones (1 + 0.25 * (1.6 - 1) = 1.15 < 1.2).
  chooser.record(PrefetchPlan::kEveryLine, 1.6);
  expect(chooser.best() == PrefetchPlan::kEveryLine, "one slow call of the best plan moves its average only");
  chooser.record(PrefetchPlan::kEveryLine, 3.0);
  expect(chooser.best() == PrefetchPlan::kFirstLine, "a lasting slowdown of the best plan hands the choice over");
}

}  // namespace

int main() {
  test_warmup_alternates();
  test_exploits_and_backs_off();
  test_close_costs_keep_probing();
  test_follows_a_change_of_state();
  test_averages_the_chosen_plan();
  if (failures) std::cout << failures << " failure(s)" << std::endl;
  return failures ? 1 : 0;
}
