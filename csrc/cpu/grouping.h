#pragma once
// Positions grouped by an int64 code (a table's row, offset per table): what a gradient
// needs to sum each row's lookups once, in a fixed order. Defined in unique_bounded_cpu.cpp.
#include <cstdint>

#include "torch_api.h"

namespace sparsekit {

/// The groups of positions [0, n) by code, codes of -1 left out.
struct CodeGroups {
  Tensor codes;    // int64 [U]: each group's code; ascending when `sorted`
  Tensor offsets;  // int64 [U + 1]: group g's positions are order[offsets[g] : offsets[g + 1]]
  Tensor order;    // int64: the positions, group after group, ascending within a group
  bool sorted;
};

/// @brief Groups the positions of `codes` (int64 [n], each in [-1, bound)) by code, skipping
/// -1. A bitmap of the codes when `bound` is within a small multiple of n (the groups then
/// come in ascending code order), sparsekit's hash unique otherwise (in order of first
/// occurrence). The result does not depend on the thread count.
CodeGroups group_positions(const Tensor& codes, int64_t bound);

}  // namespace sparsekit
