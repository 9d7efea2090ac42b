#pragma once
// Argument checks and helpers shared by the CPU and CUDA embedding_bag / embedding_gather
// kernels. Value checks that need the data (row range, offsets order) are done by the
// kernels themselves; the messages are built here so both devices say the same thing.
#include <string>

#include "common.h"

namespace sparsekit {

/// Pooling of embedding_bag.
enum class BagMode : int { kSum = 0, kMean = 1 };

inline BagMode parse_bag_mode(c10::string_view mode) {
  if (mode == "sum") return BagMode::kSum;
  if (mode == "mean") return BagMode::kMean;
  TORCH_CHECK(false, "embedding_bag: mode must be \"sum\" or \"mean\", got \"", std::string(mode), "\"");
}

inline void check_embedding_weight(const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [num_rows, dim], got shape ", weight.sizes());
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": weight must be float32, float64, float16 or bfloat16, got ", dtype);
}

inline void check_embedding_bag_args(const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& offsets,
                                     const c10::optional<at::Tensor>& per_sample_weights) {
  check_embedding_weight(weight, "embedding_bag");
  check_index_tensor(rows, "embedding_bag", "rows");
  check_index_tensor(offsets, "embedding_bag", "offsets");
  TORCH_CHECK(rows.dim() == 1, "embedding_bag: rows must be 1-D [nnz], got shape ", rows.sizes(),
              "; flatten it and describe the bags with offsets");
  TORCH_CHECK(offsets.dim() == 1 && offsets.size(0) >= 1,
              "embedding_bag: offsets must be 1-D [bags + 1] (CSR, offsets[0] == 0, offsets[-1] == nnz), got shape ",
              offsets.sizes(), "; append nnz to nn.EmbeddingBag-style offsets");
  TORCH_CHECK(rows.device() == weight.device() && offsets.device() == weight.device(), "embedding_bag: weight is on ",
              weight.device(), ", rows on ", rows.device(), " and offsets on ", offsets.device(),
              "; move them to the same device");
  if (per_sample_weights.has_value()) {
    const at::Tensor& psw = *per_sample_weights;
    TORCH_CHECK(psw.dim() == 1 && psw.size(0) == rows.size(0), "embedding_bag: per_sample_weights must be 1-D [nnz] ",
                "like rows (", rows.size(0), " entries), got shape ", psw.sizes());
    TORCH_CHECK(psw.scalar_type() == weight.scalar_type(), "embedding_bag: per_sample_weights is ", psw.scalar_type(),
                " but weight is ", weight.scalar_type(), "; cast per_sample_weights to weight's dtype");
    TORCH_CHECK(psw.device() == weight.device(), "embedding_bag: per_sample_weights is on ", psw.device(),
                " but weight is on ", weight.device(), "; move them to the same device");
  }
}

inline void check_embedding_gather_args(const at::Tensor& weight, const at::Tensor& rows) {
  check_embedding_weight(weight, "embedding_gather");
  check_index_tensor(rows, "embedding_gather", "rows");
  TORCH_CHECK(rows.device() == weight.device(), "embedding_gather: weight is on ", weight.device(), " but rows on ",
              rows.device(), "; move them to the same device");
}

/// Message of the error raised for a row index outside [-1, num_rows).
inline std::string embedding_row_range_message(const char* op, int64_t bad_row, int64_t num_rows) {
  return std::string(op) + ": rows holds " + std::to_string(bad_row) + " but weight has " + std::to_string(num_rows) +
         " rows; every row must lie in [0, " + std::to_string(num_rows) +
         ") or be -1 (a missing key, which contributes nothing)";
}

/// Message of the error raised for offsets that are not a CSR description of rows.
inline std::string embedding_offsets_message(int64_t nnz) {
  return "embedding_bag: offsets must be non-decreasing with offsets[0] == 0 and offsets[-1] == nnz == " +
         std::to_string(nnz) + " (CSR, bags + 1 entries); append nnz to nn.EmbeddingBag-style offsets";
}

/// @brief weight itself when its rows are dense in memory (a row-slice of a bigger table is
/// fine), else a contiguous copy: the kernels read each row as one run of D values.
inline at::Tensor rows_stride_ready(const at::Tensor& weight) {
  return weight.stride(1) == 1 || weight.size(1) <= 1 ? weight : weight.contiguous();
}

}  // namespace sparsekit
