#pragma once
// Argument checks and helpers shared by the CPU and CUDA embedding_bag / embedding_gather
// kernels. Value checks that need the data (row range, offsets order) are done by the
// kernels themselves; the messages are built here so both devices say the same thing.
#include <cstdint>
#include <string>

#include "common.h"

namespace sparsekit {

/// Pooling of embedding_bag.
// kMeanOfLength (the collection's "mean" combiner, not an embedding_bag mode): the sum
// divided by the bag's length, skipped rows included.
enum class BagMode : int { kSum = 0, kMean = 1, kMax = 2, kMeanOfLength = 3 };

inline BagMode parse_bag_mode(const std::string& mode) {
  if (mode == "sum") return BagMode::kSum;
  if (mode == "mean") return BagMode::kMean;
  if (mode == "max") return BagMode::kMax;
  SK_CHECK(false, "embedding_bag: mode must be \"sum\", \"mean\" or \"max\", got \"", std::string(mode), "\"");
}

inline void check_embedding_weight(const Tensor& weight, const char* op) {
  SK_CHECK(weight.dim() == 2, op, ": weight must be 2-D [num_rows, dim], got shape ", weight.sizes());
  const auto dtype = weight.scalar_type();
  SK_CHECK(dtype == kFloat || dtype == kDouble || dtype == kHalf || dtype == kBFloat16, op,
              ": weight must be float32, float64, float16 or bfloat16, got ", dtype);
}

/// @brief The row that padding_idx names, in [0, num_rows), or -1 for none. Like
/// nn.EmbeddingBag, a negative padding_idx counts from the end (-1 is the last row).
/// -1 doubles as "no padding row" for the kernels: rows == -1 are skipped anyway.
inline int64_t normalize_padding_idx(std::optional<int64_t> padding_idx, int64_t num_rows, const char* op) {
  if (!padding_idx.has_value()) return -1;
  const int64_t idx = *padding_idx;
  SK_CHECK(-num_rows <= idx && idx < num_rows, op, ": padding_idx must lie in [-num_rows, num_rows) = [",
              -num_rows, ", ", num_rows, "), got ", idx, "; pass None for no padding row");
  return idx < 0 ? idx + num_rows : idx;
}

inline void check_embedding_bag_args(const Tensor& weight, const Tensor& rows, const Tensor& offsets,
                                     const std::optional<Tensor>& per_sample_weights, BagMode mode,
                                     bool include_last_offset) {
  check_embedding_weight(weight, "embedding_bag");
  check_index_tensor(rows, "embedding_bag", "rows");
  check_index_tensor(offsets, "embedding_bag", "offsets");
  SK_CHECK(rows.dim() == 1, "embedding_bag: rows must be 1-D [nnz], got shape ", rows.sizes(),
              "; flatten it and describe the bags with offsets");
  if (include_last_offset) {
    SK_CHECK(offsets.dim() == 1 && offsets.size(0) >= 1,
                "embedding_bag: offsets must be 1-D [bags + 1] (CSR, offsets[0] == 0, offsets[-1] == nnz), got shape ",
                offsets.sizes(), "; for nn.EmbeddingBag-style [bags] offsets pass include_last_offset=False");
  } else {
    SK_CHECK(offsets.dim() == 1, "embedding_bag: offsets must be 1-D [bags] (include_last_offset=False: ",
                "nn.EmbeddingBag-style bag starts), got shape ", offsets.sizes());
  }
  SK_CHECK(rows.device() == weight.device() && offsets.device() == weight.device(), "embedding_bag: weight is on ",
              weight.device(), ", rows on ", rows.device(), " and offsets on ", offsets.device(),
              "; move them to the same device");
  if (per_sample_weights.has_value()) {
    SK_CHECK(mode != BagMode::kMax, "embedding_bag: per_sample_weights is only supported for mode=\"sum\" or ",
                "\"mean\", got mode=\"max\"; drop per_sample_weights or pool with sum/mean");
    const Tensor& psw = *per_sample_weights;
    SK_CHECK(psw.dim() == 1 && psw.size(0) == rows.size(0), "embedding_bag: per_sample_weights must be 1-D [nnz] ",
                "like rows (", rows.size(0), " entries), got shape ", psw.sizes());
    SK_CHECK(psw.scalar_type() == weight.scalar_type(), "embedding_bag: per_sample_weights is ", psw.scalar_type(),
                " but weight is ", weight.scalar_type(), "; cast per_sample_weights to weight's dtype");
    SK_CHECK(psw.device() == weight.device(), "embedding_bag: per_sample_weights is on ", psw.device(),
                " but weight is on ", weight.device(), "; move them to the same device");
  }
}

/// @brief Number of bags that offsets describes: bags + 1 CSR entries with
/// include_last_offset, nn.EmbeddingBag's [bags] bag starts without it.
inline int64_t embedding_bag_count(const Tensor& offsets, bool include_last_offset) {
  return include_last_offset ? offsets.size(0) - 1 : offsets.size(0);
}

inline void check_embedding_gather_args(const Tensor& weight, const Tensor& rows) {
  check_embedding_weight(weight, "embedding_gather");
  check_index_tensor(rows, "embedding_gather", "rows");
  SK_CHECK(rows.device() == weight.device(), "embedding_gather: weight is on ", weight.device(), " but rows on ",
              rows.device(), "; move them to the same device");
}

/// @brief True when bag `bag` of `bags`, spanning [begin, end), breaks the offsets contract.
/// Both devices test every bag with this predicate and report the smallest failing bag, so
/// they name the same one. With include_last_offset == false the last bag's end is nnz by
/// construction and passes the end test.
C10_HOST_DEVICE inline bool bag_offsets_bad(int64_t bag, int64_t bags, int64_t begin, int64_t end, int64_t nnz) {
  return !(0 <= begin && begin <= end && end <= nnz) || (bag == 0 && begin != 0) || (bag == bags - 1 && end != nnz);
}

/// Message of the error raised for a row index outside [-1, num_rows); `position` is the
/// first bad entry of the (flattened) rows.
inline std::string embedding_row_range_message(const char* op, int64_t bad_row, int64_t position, int64_t num_rows) {
  return std::string(op) + ": rows holds " + std::to_string(bad_row) + " but weight has " + std::to_string(num_rows) +
         " rows (at rows" + (std::string(op) == "embedding_gather" ? ".flatten()" : "") + "[" +
         std::to_string(position) + "], the first bad entry); every row must lie in [0, " + std::to_string(num_rows) +
         ") or be -1 (a missing key, which contributes nothing)";
}

/// Message of the error raised for offsets that are not a description of the bags of rows.
/// `bag` is the first bag that bag_offsets_bad rejects (-1: there is no bag, yet rows holds
/// lookups or offsets[0] != 0); `begin` and `end` are its bounds.
inline std::string embedding_offsets_message(int64_t nnz, bool include_last_offset, int64_t bags, int64_t bag,
                                             int64_t begin, int64_t end) {
  std::string message =
      include_last_offset
          ? "embedding_bag: offsets must be non-decreasing with offsets[0] == 0 and offsets[-1] == nnz == " +
                std::to_string(nnz) +
                " (CSR, bags + 1 entries); for nn.EmbeddingBag-style offsets ([bags] entries, no nnz at the end) "
                "pass include_last_offset=False"
          : "embedding_bag: offsets must be non-decreasing with offsets[0] == 0 and every offset <= nnz == " +
                std::to_string(nnz) +
                " (include_last_offset=False: nn.EmbeddingBag-style [bags] bag starts, the last bag ends at nnz)";
  if (bag < 0) {
    return message + "; got no bag (offsets " + (include_last_offset ? "== [" + std::to_string(begin) + "]" : "empty") +
           ") for " + std::to_string(nnz) + " rows";
  }
  const std::string b = std::to_string(bag);
  const std::string next = std::to_string(bag + 1);
  const bool end_is_nnz = !include_last_offset && bag == bags - 1;
  return message + "; bag " + b + " is offsets[" + b + "] == " + std::to_string(begin) + " to " +
         (end_is_nnz ? std::string("nnz == ") : "offsets[" + next + "] == ") + std::to_string(end) +
         " (the first bad bag)";
}

/// @brief With no bag to carry the check, offsets must be [0] (or empty without
/// include_last_offset) and rows empty. Reads offsets[0]: a host sync on CUDA, only when
/// there are no bags.
inline void check_offsets_without_bags(const Tensor& offsets, int64_t nnz, bool include_last_offset) {
  const int64_t first = include_last_offset ? item_at(offsets, 0) : 0;
  SK_CHECK(nnz == 0 && first == 0, embedding_offsets_message(nnz, include_last_offset, 0, -1, first, nnz));
}

/// @brief Raises the offsets error for the first bad bag, else the row error for the first
/// bad lookup (kNoBadPosition: none). Both devices call this with the same two positions,
/// so they raise the same text. Reads a few entries of offsets / rows: on CUDA that is a
/// host sync, on the error path only.
inline void raise_first_bag_error(int64_t first_bad_bag, int64_t first_bad_position, const Tensor& offsets,
                                  const Tensor& rows, int64_t bags, int64_t num_rows, bool include_last_offset) {
  const int64_t nnz = rows.size(0);
  if (first_bad_bag != kNoBadPosition) {
    const int64_t begin = item_at(offsets, first_bad_bag);
    const int64_t end = first_bad_bag + 1 < offsets.size(0) ? item_at(offsets, first_bad_bag + 1) : nnz;
    SK_CHECK(false, embedding_offsets_message(nnz, include_last_offset, bags, first_bad_bag, begin, end));
  }
  if (first_bad_position != kNoBadPosition) {
    SK_CHECK(false, embedding_row_range_message("embedding_bag", item_at(rows, first_bad_position),
                                                   first_bad_position, num_rows));
  }
}

/// @brief embedding_gather's counterpart of raise_first_bag_error.
inline void raise_first_gather_error(int64_t first_bad_position, const Tensor& rows, int64_t num_rows) {
  if (first_bad_position != kNoBadPosition) {
    SK_CHECK(false, embedding_row_range_message("embedding_gather",
                                                   item_at(rows, first_bad_position),
                                                   first_bad_position, num_rows));
  }
}

/// @brief weight itself when its rows are dense in memory (a row-slice of a bigger table is
/// fine), else a contiguous copy: the kernels read each row as one run of D values.
inline Tensor rows_stride_ready(const Tensor& weight) {
  return weight.stride(1) == 1 || weight.size(1) <= 1 ? weight : as_contiguous(weight);
}

/// @brief The checked inputs of an embedding_bag kernel, laid out as the kernels read them.
struct BagInputs {
  Tensor weight;              // rows dense in memory (rows_stride_ready)
  Tensor rows;                // contiguous
  Tensor offsets;             // contiguous int64: bags + 1 numbers, one copy is cheaper
                                  // than a second instantiation
  Tensor per_sample_weights;  // contiguous, or undefined
  int64_t padding_row;            // in [0, num_rows), or -1 for none
  int64_t nnz, bags, dim;
};

/// @brief Checks the arguments of embedding_bag (and its arg-max) and prepares them; the
/// CPU and CUDA kernels share it (a CUDA caller sets its device guard first).
inline BagInputs prepare_bag_inputs(const Tensor& weight_in, const Tensor& rows_in,
                                    const Tensor& offsets_in,
                                    const std::optional<Tensor>& per_sample_weights_in, BagMode mode,
                                    std::optional<int64_t> padding_idx, bool include_last_offset) {
  check_embedding_bag_args(weight_in, rows_in, offsets_in, per_sample_weights_in, mode, include_last_offset);
  BagInputs in;
  in.padding_row = normalize_padding_idx(padding_idx, weight_in.size(0), "embedding_bag");
  in.weight = rows_stride_ready(weight_in);
  in.rows = as_contiguous(rows_in);
  in.offsets = as_contiguous(to_dtype(offsets_in, kLong));
  if (per_sample_weights_in.has_value()) in.per_sample_weights = as_contiguous(*per_sample_weights_in);
  in.nnz = in.rows.size(0);
  in.bags = embedding_bag_count(in.offsets, include_last_offset);
  in.dim = in.weight.size(1);
  return in;
}

}  // namespace sparsekit
