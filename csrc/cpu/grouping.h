#pragma once
// Lookups numbered by an int64 code (a table's row, offset per table): what a gradient
// needs to sum each row's lookups once. Defined in unique_bounded_cpu.cpp.
#include <cstdint>
#include <vector>

#include "torch_api.h"

namespace sparsekit {

/// The distinct codes of a call, ascending, and each position's place among them.
struct RankedCodes {
  Tensor distinct;  // int64 [U]: the distinct codes but -1, ascending
  Tensor rank;      // int64 [n]: codes[i] == distinct[rank[i]], -1 where codes[i] == -1
};

/// @brief Numbers the codes (int64 [n], each in [-1, bound)): a bitmap of the code space when
/// `bound` is within a small multiple of n, sparsekit's hash unique otherwise (its distinct
/// codes then sorted segment by segment: `segments` [S + 1] bounds the code space's parts,
/// a table's rows each, sorted in parallel). The result does not depend on the thread count.
RankedCodes rank_codes(const Tensor& codes, int64_t bound, const std::vector<int64_t>& segments);

}  // namespace sparsekit
