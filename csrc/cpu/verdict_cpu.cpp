// record_verdict_ on the CPU (csrc/verdict.h).
#include "verdict.h"

namespace sparsekit {
namespace {

void record_verdict_cpu(Tensor& record, Tensor& errors, Tensor& clean, const Tensor& flags, const Tensor& report,
                          const Tensor& bounds, const Tensor& keys, const Tensor& feature_tables) {
  const char* op = "record_verdict_";
  check_verdict_args(op, record, errors, clean, flags, report, bounds, keys, feature_tables);
  const Tensor keys_c = as_contiguous(keys);
  const Tensor tables_c = as_contiguous(feature_tables);
  const VerdictInputs in{flags.const_data_ptr<int64_t>(), report.const_data_ptr<int64_t>(),
                         bounds.const_data_ptr<int64_t>(), bounds.stride(0), tables_c.numel(),
                         keys_c.const_data_ptr<int64_t>(), keys_c.numel(), tables_c.const_data_ptr<int64_t>()};
  *clean.mutable_data_ptr<bool>() =
      fold_verdict(in, record.mutable_data_ptr<int64_t>(), errors.mutable_data_ptr<int64_t>());
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) { m.impl("record_verdict_", TORCH_BOX(&record_verdict_cpu)); }

}  // namespace sparsekit
