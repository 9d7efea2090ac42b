// CPU kernels of the collection's pooled read (pooled_read) and its gradient grouped by row
// (pooled_read_backward; the fused optimizer step is in pooled_update_cpu.cpp); the layout is
// described in pooled.h. Each distinct row sums its lookups' output gradients in position
// order, so the sums do not depend on the thread count.
// 32-byte vector arguments of the pooling loops' always_inline helpers never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <atomic>
#include <vector>

#include "cpu/pool_loops.h"
#include "cpu/pooled_rows.h"
#include "pooled.h"

namespace sparsekit {
namespace {

/// About this many accumulated elements per chunk of the read: far more work than taking a
/// chunk costs (embedding_bag's rule).
constexpr int64_t kChunkElements = int64_t{1} << 16;

/// @brief The call's output, zeroed where no feature of the call writes.
Tensor pooled_output(const PooledLayout& layout, const Device& device) {
  int64_t covered = 0;
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = layout.feature_tables[f];
    if (t >= 0) covered += layout.table_dims[t];
  }
  return covered == layout.total_dim ? empty({layout.batch, layout.total_dim}, layout.dtype, device)
                                     : zeros({layout.batch, layout.total_dim}, layout.dtype, device);
}

}  // namespace

Tensor pooled_read_cpu(const std::vector<Tensor>& weights_in, const Tensor& rows_in, const Tensor& offsets_in,
                       const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                       std::vector<int64_t> feature_columns, std::vector<int64_t> feature_means, int64_t total_dim,
                       const std::optional<Tensor>& errors) {
  const char* op = "pooled_read";
  const PooledLayout layout = check_pooled_args(op, weights_in, rows_in, offsets_in, per_sample_weights_in,
                                                feature_tables, feature_columns, feature_means, total_dim);
  std::vector<Tensor> weights;
  for (const Tensor& w : weights_in) weights.push_back(rows_stride_ready(w));
  const LookupInputs in(rows_in, offsets_in, per_sample_weights_in);
  Tensor out = pooled_output(layout, weights[0].device());
  const int64_t* offsets_ptr = in.offsets_ptr;
  const int64_t* rows_ptr = in.rows_ptr;
  const float* psw_ptr = in.psw_ptr;
  check_error_slots(op, errors, weights[0].device());
  if (layout.batch == 0) {
    check_no_bags(op, layout, offsets_ptr, errors);
    return out;
  }
  const int64_t bags = layout.num_features * layout.batch;
  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_cpu", [&] {
    std::vector<BagProblem<scalar_t, int64_t>> problems;
    struct Chunk {
      size_t problem;
      int64_t begin, end;
    };
    std::vector<Chunk> chunks;
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    for (int64_t f = 0; f < layout.num_features; ++f) {
      const int64_t t = layout.feature_tables[f];
      if (t < 0) continue;
      const int64_t dim = layout.table_dims[t];
      BagProblem<scalar_t, int64_t> p{weights[t].const_data_ptr<scalar_t>(),
                                      weights[t].stride(0),
                                      layout.table_rows[t],
                                      dim,
                                      rows_ptr,
                                      offsets_ptr,
                                      bags + 1,
                                      bags,
                                      layout.nnz,
                                      -1,
                                      nullptr,
                                      layout.feature_means[f] ? BagMode::kMeanOfLength : BagMode::kSum,
                                      out_ptr + layout.feature_columns[f],
                                      false,
                                      PrefetchPlan::kEveryLine,
                                      &first_bad_bag,
                                      &first_bad_position};
      p.out_stride = layout.total_dim;
      p.out_first_bag = f * layout.batch;
      p.per_sample_weights_f32 = psw_ptr;
      // The feature's lookups per bag, read from offsets that may still be bad: clamped,
      // they only size the chunks.
      const int64_t first = std::clamp<int64_t>(offsets_ptr[f * layout.batch], 0, layout.nnz);
      const int64_t last = std::clamp<int64_t>(offsets_ptr[(f + 1) * layout.batch], first, layout.nnz);
      const int64_t per_bag = ((last - first) / layout.batch + 1) * std::max<int64_t>(dim, 1);
      const int64_t chunk = std::max<int64_t>(1, kChunkElements / per_bag);
      problems.push_back(p);
      for (int64_t b = f * layout.batch; b < (f + 1) * layout.batch; b += chunk) {
        chunks.push_back({problems.size() - 1, b, std::min(b + chunk, (f + 1) * layout.batch)});
      }
    }
    parallel_chunks(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        pool_bag_range_dispatch(problems[chunks[c].problem], chunks[c].begin, chunks[c].end);
      }
    });
  });
  report_pooled_errors(op, first_bad_bag.load(), first_bad_position.load(), layout, offsets_ptr, rows_ptr, errors);
  return out;
}

namespace {

/// @brief The summed gradient of every distinct row, in RowGroups' layout (float32, float64
/// for float64 weights), each row written once, in rank order.
Tensor row_gradients(const RowGroups& groups, const IndexedLookups& lookups, const PooledLayout& layout,
                     const float* psw, const Device& device) {
  const ScalarType value_dtype = layout.dtype == kDouble ? kDouble : kFloat;
  Tensor values = empty({groups.value_start.back()}, value_dtype, device);
  const int64_t num_distinct = groups.distinct.size(0);
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_row_gradients", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    acc_t* values_ptr = values.mutable_data_ptr<acc_t>();
    parallel_for(0, num_distinct, row_grain(layout), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t t = table_of_rank(groups, r);
        const int64_t dim = layout.table_dims[t];
        sum_row<acc_t, scalar_t>(values_ptr + groups.value_start[t] + (r - groups.table_first[t]) * dim, dim, groups,
                                 r, lookups, psw);
      }
    });
  });
  return values;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> pooled_read_backward_cpu(
    const std::vector<Tensor>& grads_in, const std::vector<Tensor>& weights, const Tensor& rows_in,
    const Tensor& offsets_in, const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
    std::vector<int64_t> feature_means, const std::optional<Tensor>& errors, std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_backward";
  const PooledLayout layout = check_pooled_backward_args(op, weights, rows_in, offsets_in, per_sample_weights_in,
                                                         feature_tables, feature_means);
  const Device device = weights[0].device();
  const std::vector<Tensor> grads = feature_grad_views(op, grads_in, grad_columns, layout);
  check_pooled_grads(op, grads, layout, device);
  const LookupInputs in(rows_in, offsets_in, per_sample_weights_in);
  const int64_t* offsets_ptr = in.offsets_ptr;
  const float* psw_ptr = in.psw_ptr;
  const size_t num_tables = weights.size();
  check_error_slots(op, errors, device);
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, in.rows_ptr, grads, device, errors);
  const RowGroups groups = group_rows(op, lookups, layout, lookups_scaled(layout, psw_ptr));
  Tensor values = row_gradients(groups, lookups, layout, psw_ptr, device);
  const int64_t num_distinct = groups.distinct.size(0);
  Tensor out_rows = empty({num_distinct}, kLong, device);
  Tensor per_table = empty({static_cast<int64_t>(num_tables)}, kLong, device);
  const int64_t* distinct = groups.distinct.const_data_ptr<int64_t>();
  int64_t* rows_out = out_rows.mutable_data_ptr<int64_t>();
  for (size_t t = 0; t < num_tables; ++t) {
    per_table.mutable_data_ptr<int64_t>()[t] = groups.table_first[t + 1] - groups.table_first[t];
    for (int64_t r = groups.table_first[t]; r < groups.table_first[t + 1]; ++r) rows_out[r] = distinct[r] - lookups.bases[t];
  }
  return {out_rows, per_table, values};
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("pooled_read", TORCH_BOX(&pooled_read_cpu));
  m.impl("pooled_read_backward", TORCH_BOX(&pooled_read_backward_cpu));
}

}  // namespace sparsekit
