#pragma once
// Argument checks shared by the CPU and CUDA segment_sum kernels.
#include "common.h"

namespace sparsekit {

inline void check_segment_sum_args(const Tensor& data, const Tensor& segment_ids,
                                   int64_t num_segments) {
  SK_CHECK(data.dim() >= 1, "segment_sum: data must have at least one dimension [N, ...], got a scalar");
  SK_CHECK(is_floating(data.scalar_type()),
              "segment_sum: data must be float32, float64, float16 or bfloat16, got ", data.scalar_type());
  check_index_tensor(segment_ids, "segment_sum", "segment_ids");
  SK_CHECK(segment_ids.dim() == 1, "segment_sum: segment_ids must be 1-D [N], got shape ",
              segment_ids.sizes());
  SK_CHECK(segment_ids.size(0) == data.size(0), "segment_sum: segment_ids has ", segment_ids.size(0),
              " entries but data has ", data.size(0), " rows; they must match");
  SK_CHECK(num_segments >= 0, "segment_sum: num_segments must be >= 0, got ", num_segments);
  SK_CHECK(segment_ids.device() == data.device(), "segment_sum: segment_ids is on ", segment_ids.device(),
              " but data is on ", data.device(), "; move them to the same device");
}

/// Message of the error raised for a segment id that is >= num_segments.
inline std::string segment_id_range_message(int64_t bad_id, int64_t num_segments, const char* op = "segment_sum") {
  return std::string(op) + ": segment_ids holds " + std::to_string(bad_id) + " but num_segments is " +
         std::to_string(num_segments) + "; ids must be < num_segments (negative ids are dropped as padding)";
}

}  // namespace sparsekit
