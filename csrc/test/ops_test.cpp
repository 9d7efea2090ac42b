// C++ test of the registered ops, called through the dispatcher as any C++ user of
// sparsekit would (no Python involved). Run by ctest; exits non-zero on the first failure.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <iostream>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::cout << (ok ? "ok   " : "FAIL ") << what << std::endl;
  if (!ok) ++failures;
}

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

void test_unique() {
  const auto unique = op("sparsekit::unique").typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&)>();
  const int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  const at::Tensor keys = at::tensor(std::vector<int64_t>{hi, -1, lo, 0, -1, hi, 7, lo});
  auto [uniq, inverse, counts] = unique.call(keys);
  expect(at::equal(uniq, at::tensor(std::vector<int64_t>{hi, -1, lo, 0, 7})), "unique keys in first-occurrence order");
  expect(at::equal(uniq.index({inverse}), keys), "keys == unique_keys[inverse]");
  expect(at::equal(counts, at::tensor({2, 2, 2, 1, 1}, at::kLong)), "unique counts");
  auto [e_uniq, e_inverse, e_counts] = unique.call(at::empty({0}, at::kLong));
  expect(e_uniq.numel() == 0 && e_inverse.numel() == 0 && e_counts.numel() == 0, "unique of an empty tensor");
  bool raised = false;
  try {
    unique.call(at::ones({3}, at::kFloat));
  } catch (const std::exception& e) {  // the stable ABI raises std::runtime_error
    raised = std::string(e.what()).find("keys must be an int64 or int32") != std::string::npos;
  }
  expect(raised, "unique rejects float keys with a clear message");
}

void test_segment_sum() {
  const auto segment_sum =
      op("sparsekit::segment_sum").typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymInt, bool)>();
  const at::Tensor data = at::arange(12, at::kFloat).view({6, 2});
  const at::Tensor ids = at::tensor({0, -1, 2, 2, 0, -5}, at::kLong);
  const at::Tensor out = segment_sum.call(data, ids, 3, false);
  expect(at::equal(out, at::tensor({8.f, 10.f, 0.f, 0.f, 10.f, 12.f}).view({3, 2})), "segment_sum drops negative ids");
  bool raised = false;
  try {
    segment_sum.call(data, at::tensor({0, 1, 2, 3, 0, 0}, at::kLong), 3, false);
  } catch (const std::exception& e) {  // the stable ABI raises std::runtime_error
    raised = std::string(e.what()).find("segment_ids holds 3 but num_segments is 3") != std::string::npos;
  }
  expect(raised, "segment_sum rejects an id >= num_segments");
}

}  // namespace

int main() {
  test_unique();
  test_segment_sum();
  std::cout << (failures == 0 ? "all passed" : "FAILED") << std::endl;
  return failures == 0 ? 0 : 1;
}
