// record_verdict_ on CUDA (csrc/verdict.h): one thread on the current stream, nothing read
// back, so a step in error_mode="late" stays free of host syncs and can be captured.
#include "cuda/cuda_api.h"

#include "verdict.h"

namespace sparsekit {
namespace {

__global__ void record_verdict_kernel(VerdictInputs in, int64_t* record, int64_t* errors, bool* clean) {
  *clean = fold_verdict(in, record, errors);
}

void record_verdict_cuda(Tensor& record, Tensor& errors, Tensor& clean, const Tensor& flags, const Tensor& report,
                           const Tensor& bounds, const Tensor& keys, const Tensor& feature_tables) {
  const char* op = "record_verdict_";
  check_verdict_args(op, record, errors, clean, flags, report, bounds, keys, feature_tables);
  const DeviceGuard device_guard(record.get_device_index());
  const Tensor keys_c = as_contiguous(keys);
  const Tensor tables_c = as_contiguous(feature_tables);
  const VerdictInputs in{flags.const_data_ptr<int64_t>(), report.const_data_ptr<int64_t>(),
                         bounds.const_data_ptr<int64_t>(), bounds.stride(0), tables_c.numel(),
                         keys_c.const_data_ptr<int64_t>(), keys_c.numel(), tables_c.const_data_ptr<int64_t>()};
  record_verdict_kernel<<<1, 1, 0, current_stream(record)>>>(in, record.mutable_data_ptr<int64_t>(),
                                                             errors.mutable_data_ptr<int64_t>(),
                                                             clean.mutable_data_ptr<bool>());
  SK_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CUDA, m) { m.impl("record_verdict_", TORCH_BOX(&record_verdict_cuda)); }

}  // namespace sparsekit
