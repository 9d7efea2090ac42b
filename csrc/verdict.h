#pragma once
// record_verdict_: a collection step's verdict folded into a record on the device, for the
// error modes that read nothing back per step (sparsekit/step_errors.py). One thread does
// it (nine numbers); the CPU and CUDA kernels share this code.
#include "hashtable.h"

namespace sparsekit {

/// A verdict: the input's flags, lookup_rows' report (first key outside its direct table,
/// absent keys, bad bounds), the error word, that key's table and value, and nnz.
constexpr int64_t kVerdictWidth = 9;

/// @brief Whether a verdict (or a record) reports no error.
C10_HOST_DEVICE inline bool verdict_clean(const int64_t* v) {
  return v[0] == 0 && v[1] >= v[8] && v[3] == 0 && v[4] == kNoBadPosition && v[5] == kNoBadPosition;
}

struct VerdictInputs {
  const int64_t* flags;           // [1]
  const int64_t* report;          // [3]
  const int64_t* bounds;          // [num_features + 1], strided
  int64_t bounds_stride;
  int64_t num_features;
  const int64_t* keys;            // [nnz]
  int64_t nnz;
  const int64_t* feature_tables;  // [num_features]
};

/// @brief Folds this step's verdict into `record` (kept when the record is clean and the
/// verdict is not: the first error wins), empties the error word and returns whether the
/// record is clean afterwards.
C10_HOST_DEVICE inline bool fold_verdict(const VerdictInputs& in, int64_t* record, int64_t* errors) {
  int64_t v[kVerdictWidth] = {in.flags[0], in.report[0], in.report[1], in.report[2], errors[0], errors[1], 0, 0,
                              in.nnz};
  const int64_t at = v[1];
  if (at >= 0 && at < in.nnz && in.num_features > 0) {
    // The feature holding position `at`: the last f with bounds[f] <= at (lookup_rows
    // reports no such key for bounds that do not rise from 0 to nnz).
    int64_t lo = 0, hi = in.num_features - 1;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (in.bounds[mid * in.bounds_stride] <= at) lo = mid; else hi = mid - 1;
    }
    v[6] = in.feature_tables[lo];
    v[7] = in.keys[at];
  }
  if (verdict_clean(record) && !verdict_clean(v)) {
    for (int64_t i = 0; i < kVerdictWidth; ++i) record[i] = v[i];
  }
  errors[0] = errors[1] = kNoBadPosition;
  return verdict_clean(record);
}

/// @brief The checks both kernels make before folding.
inline void check_verdict_args(const char* op, const Tensor& record, const Tensor& errors, const Tensor& clean,
                               const Tensor& flags, const Tensor& report, const Tensor& bounds, const Tensor& keys,
                               const Tensor& feature_tables) {
  const Device device = record.device();
  SK_CHECK(record.scalar_type() == kLong && record.dim() == 1 && record.size(0) == kVerdictWidth &&
               record.is_contiguous(),
           op, ": record must be a contiguous int64 tensor [", kVerdictWidth, "], got ", record.scalar_type(),
           " of shape ", record.sizes());
  check_error_slots(op, errors, device);
  SK_CHECK(clean.scalar_type() == kBool && clean.numel() == 1 && clean.device() == device, op,
           ": clean must be one bool on ", device, ", got ", clean.scalar_type(), " of shape ", clean.sizes(), " on ",
           clean.device());
  SK_CHECK(flags.scalar_type() == kLong && flags.numel() == 1 && flags.device() == device, op,
           ": flags must be one int64 on ", device, ", got ", flags.scalar_type(), " of shape ", flags.sizes(), " on ",
           flags.device());
  SK_CHECK(report.scalar_type() == kLong && report.dim() == 1 && report.size(0) == 3 && report.is_contiguous() &&
               report.device() == device,
           op, ": report must be lookup_rows' contiguous int64 [3] on ", device, ", got ", report.scalar_type(),
           " of shape ", report.sizes(), " on ", report.device());
  SK_CHECK(feature_tables.scalar_type() == kLong && feature_tables.dim() == 1 && feature_tables.device() == device,
           op, ": feature_tables must be a 1-D int64 tensor on ", device, ", got ", feature_tables.scalar_type(),
           " of shape ", feature_tables.sizes(), " on ", feature_tables.device());
  check_segment_bounds_arg(op, bounds, static_cast<size_t>(feature_tables.size(0)), device);
  SK_CHECK(keys.scalar_type() == kLong && keys.dim() == 1 && keys.device() == device, op,
           ": keys must be a 1-D int64 tensor on ", device, ", got ", keys.scalar_type(), " of shape ", keys.sizes(),
           " on ", keys.device());
}

}  // namespace sparsekit
