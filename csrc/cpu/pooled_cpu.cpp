// CPU kernels of the collection's pooled read (pooled_read), its gradient grouped by row
// (pooled_read_backward) and the fused optimizer step that applies that gradient in place
// (pooled_read_update_); the layout is described in pooled.h.
//
// The read runs embedding_bag's pooling loops (pool_loops.h) once per feature, every
// feature's bags cut into chunks of one parallel region. The gradient and the update share
// one pass: every lookup's code (its table's base plus its row), the positions grouped by
// code (grouping.h), then per distinct row the sum of its lookups' output gradients in
// position order, so the sums, and the updates made of them, do not depend on the threads.
// 32-byte vector arguments of the pooling loops' always_inline helpers never cross a real call.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "cpu/adam_row.h"
#include "cpu/grouping.h"
#include "cpu/half_rows.h"
#include "cpu/pool_loops.h"
#include "pooled.h"

namespace sparsekit {
namespace {

/// About this many accumulated elements per chunk of the read: far more work than taking a
/// chunk costs (embedding_bag's rule).
constexpr int64_t kChunkElements = int64_t{1} << 16;
/// Lookups per piece of the indexing pass.
constexpr int64_t kBagGrain = int64_t{1} << 12;

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

/// @brief Reports the first bad bag and the first bad lookup a pass recorded: into `errors`
/// when the caller gives it (see pooled.h), else raised (the bag first).
void report_pooled_errors(const char* op, int64_t bad_bag, int64_t bad_position, const PooledLayout& layout,
                          const int64_t* offsets, const int64_t* rows, const std::optional<Tensor>& errors) {
  if (errors.has_value()) {
    int64_t* slots = errors->mutable_data_ptr<int64_t>();
    slots[0] = std::min(slots[0], bad_bag);
    slots[1] = std::min(slots[1], bad_position);
    return;
  }
  const int64_t bags = layout.num_features * layout.batch;
  if (bad_bag != kNoBadPosition) {
    const int64_t end = bad_bag + 1 <= bags ? offsets[bad_bag + 1] : layout.nnz;
    fail(pooled_offsets_message(op, bad_bag, offsets[bad_bag], end, layout.nnz));
  }
  if (bad_position != kNoBadPosition) {
    // The bag of the bad lookup names its table: the last bag starting at or before it.
    const int64_t* bag_end = std::upper_bound(offsets, offsets + bags + 1, bad_position);
    const int64_t bag = std::max<int64_t>(0, (bag_end - offsets) - 1);
    const int64_t t = layout.feature_tables[std::min(bag, bags - 1) / std::max<int64_t>(layout.batch, 1)];
    fail(pooled_row_message(op, bad_position, rows[bad_position], t, t >= 0 ? layout.table_rows[t] : 0));
  }
}

/// @brief With no bag, offsets must be [0] and there must be no lookup (else bag 0 is bad).
void check_no_bags(const char* op, const PooledLayout& layout, const int64_t* offsets,
                   const std::optional<Tensor>& errors) {
  if (errors.has_value()) {
    if (layout.nnz != 0 || offsets[0] != 0) report_pooled_errors(op, 0, kNoBadPosition, layout, offsets, nullptr, errors);
    return;
  }
  SK_CHECK(layout.nnz == 0 && offsets[0] == 0, op,
           ": a batch of no bags (B = 0) must have no values and offsets [0]; got nnz = ", layout.nnz);
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
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  Tensor out = pooled_output(layout, weights[0].device());
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const int64_t* rows_ptr = rows.const_data_ptr<int64_t>();
  check_pooled_errors_arg(op, errors, weights[0].device());
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

/// The lookups of a call, checked, and each one's bag and code (-1: skipped).
struct IndexedLookups {
  std::vector<int64_t> bag_of;
  Tensor codes;
  std::vector<int64_t> bases;  // code_bases(layout)
};

/// @brief Checks offsets and rows (raising for the first bad bag or lookup, before the
/// caller changes anything; with `errors`, recording them there and leaving them out) and
/// gives every lookup its bag and its code.
IndexedLookups index_lookups(const char* op, const PooledLayout& layout, const int64_t* offsets, const int64_t* rows,
                             const Device& device, const std::optional<Tensor>& errors) {
  IndexedLookups out;
  out.bases = code_bases(layout);
  const int64_t bags = layout.num_features * layout.batch;
  out.bag_of.assign(static_cast<size_t>(layout.nnz), 0);
  out.codes = empty({layout.nnz}, kLong, device);
  int64_t* codes = out.codes.mutable_data_ptr<int64_t>();
  // Bad offsets leave lookups in no bag: with errors recorded they stay out of every group.
  if (errors.has_value()) std::fill(codes, codes + layout.nnz, int64_t{-1});
  int64_t* bag_of = out.bag_of.data();
  std::atomic<int64_t> first_bad_bag{kNoBadPosition};
  std::atomic<int64_t> first_bad_position{kNoBadPosition};
  const int64_t per_bag = std::max<int64_t>(1, layout.nnz / std::max<int64_t>(bags, 1));
  parallel_chunks(bags, std::max<int64_t>(1, kBagGrain / per_bag), [&](int64_t begin, int64_t end) {
    for (int64_t bag = begin; bag < end; ++bag) {
      const int64_t first = offsets[bag], last = offsets[bag + 1];
      if (C10_UNLIKELY(bag_offsets_bad(bag, bags, first, last, layout.nnz))) {
        record_first_bad(&first_bad_bag, bag);
        continue;
      }
      const int64_t t = layout.feature_tables[bag / layout.batch];
      const int64_t num_rows = t >= 0 ? layout.table_rows[t] : 0;
      const int64_t base = t >= 0 ? out.bases[t] : 0;
      for (int64_t k = first; k < last; ++k) {
        bag_of[k] = bag;
        const int64_t row = rows[k];
        if (t < 0 || row == -1) {
          codes[k] = -1;
        } else if (C10_LIKELY(row_in_range(row, num_rows))) {
          codes[k] = base + row;
        } else {
          codes[k] = -1;
          record_first_bad(&first_bad_position, k);
        }
      }
    }
  });
  report_pooled_errors(op, first_bad_bag.load(), first_bad_position.load(), layout, offsets, rows, errors);
  return out;
}

/// Loads one element of the output gradient widened to the sums' type.
template <typename acc_t, typename grad_t>
inline acc_t widened(const grad_t* p) {
  return static_cast<acc_t>(*p);
}

/// @brief g[0, dim) = the summed output gradient of a group's lookups order[begin, end), in
/// position order: each lookup adds its bag's gradient columns, divided by the bag's length
/// for a mean feature, then times its per-sample weight (the backward of the forward's
/// weighted sum, then mean).
template <typename acc_t, typename grad_t>
void sum_group(acc_t* g, int64_t dim, const int64_t* order, int64_t begin, int64_t end, const int64_t* bag_of,
               const grad_t* grad, const PooledLayout& layout, const int64_t* offsets, const float* psw) {
  std::fill(g, g + dim, acc_t(0));
  for (int64_t i = begin; i < end; ++i) {
    const int64_t k = order[i];
    const int64_t bag = bag_of[k];
    const int64_t f = bag / layout.batch;
    const grad_t* src = grad + (bag - f * layout.batch) * layout.total_dim + layout.feature_columns[f];
    if (!layout.feature_means[f] && psw == nullptr) {
      for (int64_t j = 0; j < dim; ++j) g[j] += widened<acc_t>(src + j);
      continue;
    }
    const acc_t length = static_cast<acc_t>(offsets[bag + 1] - offsets[bag]);
    const bool mean = layout.feature_means[f] != 0;
    const acc_t w = psw != nullptr ? static_cast<acc_t>(psw[k]) : acc_t(1);
    for (int64_t j = 0; j < dim; ++j) {
      acc_t x = widened<acc_t>(src + j);
      if (mean) x = x / length;
      if (psw != nullptr) x = x * w;
      g[j] += x;
    }
  }
}

/// The groups of a call's lookups, with the table of each group and, in ascending code order,
/// the groups of each table one after the other.
struct RowGroups {
  CodeGroups groups;
  std::vector<int64_t> sorted;       // group ids in ascending code order
  std::vector<int64_t> table_first;  // [T + 1]: table t's groups are sorted[table_first[t] : table_first[t + 1]]
};

RowGroups group_rows(const IndexedLookups& lookups) {
  RowGroups out;
  out.groups = group_positions(lookups.codes, lookups.bases.back());
  const int64_t num_groups = out.groups.codes.size(0);
  const int64_t* codes = out.groups.codes.const_data_ptr<int64_t>();
  out.sorted.resize(static_cast<size_t>(num_groups));
  std::iota(out.sorted.begin(), out.sorted.end(), int64_t{0});
  if (!out.groups.sorted) {
    std::sort(out.sorted.begin(), out.sorted.end(), [&](int64_t a, int64_t b) { return codes[a] < codes[b]; });
  }
  const size_t num_tables = lookups.bases.size() - 1;
  out.table_first.assign(num_tables + 1, num_groups);
  for (size_t t = 0; t <= num_tables; ++t) {
    out.table_first[t] = std::lower_bound(out.sorted.begin(), out.sorted.end(), lookups.bases[t],
                                          [&](int64_t group, int64_t code) { return codes[group] < code; }) -
                         out.sorted.begin();
  }
  return out;
}

/// Groups per task of the gradient and update loops: about 64 KiB of rows.
int64_t group_grain(const PooledLayout& layout) {
  const int64_t widest = std::max<int64_t>(1, *std::max_element(layout.table_dims.begin(), layout.table_dims.end()));
  return std::max<int64_t>(1, 16384 / widest);
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> pooled_read_backward_cpu(
    const Tensor& grad_in, const std::vector<Tensor>& weights, const Tensor& rows_in, const Tensor& offsets_in,
    const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
    std::vector<int64_t> feature_columns, std::vector<int64_t> feature_means, const std::optional<Tensor>& errors) {
  const char* op = "pooled_read_backward";
  const PooledLayout layout =
      check_pooled_args(op, weights, rows_in, offsets_in, per_sample_weights_in, feature_tables, feature_columns,
                        feature_means, grad_in.dim() == 2 ? grad_in.size(1) : 0);
  const Device device = weights[0].device();
  check_pooled_grad(op, grad_in, layout, device);
  const Tensor grad = as_contiguous(grad_in);
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const size_t num_tables = weights.size();
  const ScalarType value_dtype = layout.dtype == kDouble ? kDouble : kFloat;
  check_pooled_errors_arg(op, errors, device);
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, rows.const_data_ptr<int64_t>(), device, errors);
  const RowGroups groups = group_rows(lookups);
  const int64_t num_groups = static_cast<int64_t>(groups.sorted.size());
  Tensor out_rows = empty({num_groups}, kLong, device);
  Tensor per_table = empty({static_cast<int64_t>(num_tables)}, kLong, device);
  std::vector<int64_t> value_start(num_tables + 1, 0);
  for (size_t t = 0; t < num_tables; ++t) {
    const int64_t count = groups.table_first[t + 1] - groups.table_first[t];
    per_table.mutable_data_ptr<int64_t>()[t] = count;
    value_start[t + 1] = value_start[t] + count * layout.table_dims[t];
  }
  Tensor values = empty({value_start[num_tables]}, value_dtype, device);
  const int64_t* codes = groups.groups.codes.const_data_ptr<int64_t>();
  const int64_t* group_offsets = groups.groups.offsets.const_data_ptr<int64_t>();
  const int64_t* order = groups.groups.order.const_data_ptr<int64_t>();
  int64_t* rows_out = out_rows.mutable_data_ptr<int64_t>();
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_backward_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* grad_ptr = grad.const_data_ptr<scalar_t>();
    acc_t* values_ptr = values.mutable_data_ptr<acc_t>();
    parallel_for(0, num_groups, group_grain(layout), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t group = groups.sorted[i];
        const int64_t t = std::upper_bound(groups.table_first.begin(), groups.table_first.end(), i) -
                          groups.table_first.begin() - 1;
        const int64_t dim = layout.table_dims[t];
        rows_out[i] = codes[group] - lookups.bases[t];
        sum_group(values_ptr + value_start[t] + (i - groups.table_first[t]) * dim, dim, order, group_offsets[group],
                  group_offsets[group + 1], lookups.bag_of.data(), grad_ptr, layout, offsets_ptr, psw_ptr);
      }
    });
  });
  return {out_rows, per_table, values};
}

namespace {

/// The numbers of one table's update.
struct TableUpdate {
  AdamScalars<float> adam;
  AdamScalars<double> adam64;
  bool read;  // a feature of the call reads the table: its step counts
};

template <typename acc_t>
const AdamScalars<acc_t>& adam_scalars_of(const TableUpdate& table);
template <>
const AdamScalars<float>& adam_scalars_of<float>(const TableUpdate& table) {
  return table.adam;
}
template <>
const AdamScalars<double>& adam_scalars_of<double>(const TableUpdate& table) {
  return table.adam64;
}

/// @brief Applies the optimizer to one row: `w` (dim values, updated in place; float32 or
/// float64 arithmetic in acc_t), its state s1 / s2 (per optimizer), the summed gradient g.
template <typename acc_t>
void update_row(FusedOptimizer optimizer, acc_t* w, acc_t* s1, acc_t* s2, acc_t* g, int64_t dim,
                const FusedScalars& h, const AdamScalars<acc_t>& adam) {
  switch (optimizer) {
    case FusedOptimizer::kSgd: {
      const acc_t lr = static_cast<acc_t>(h.lr), decay = static_cast<acc_t>(h.weight_decay);
      for (int64_t j = 0; j < dim; ++j) w[j] = w[j] - lr * (decay != acc_t(0) ? g[j] + decay * w[j] : g[j]);
      return;
    }
    case FusedOptimizer::kLazyAdam:
      adam_row<acc_t, acc_t>(w, s1, s2, g, dim, adam, h.weight_decay != 0.0);
      return;
    case FusedOptimizer::kRowWiseAdagrad: {
      // FBGEMM's exact row-wise Adagrad: one accumulator per row, of the row's mean squared
      // gradient (with the L2 decay added to the gradient first).
      const acc_t decay = static_cast<acc_t>(h.weight_decay);
      acc_t squares = 0;
      for (int64_t j = 0; j < dim; ++j) {
        if (decay != acc_t(0)) g[j] += decay * w[j];
        squares += g[j] * g[j];
      }
      *s1 += squares / static_cast<acc_t>(std::max<int64_t>(dim, 1));
      const acc_t step = static_cast<acc_t>(h.lr) / (std::sqrt(*s1) + static_cast<acc_t>(h.eps));
      for (int64_t j = 0; j < dim; ++j) w[j] -= step * g[j];
      return;
    }
  }
}

/// @brief update_row on a weight row of any dtype: a float32 / float64 row in place, a
/// float16 / bfloat16 one widened into `wide`, updated in float32 and rounded to nearest.
template <typename weight_t, typename acc_t>
void update_weight_row(FusedOptimizer optimizer, weight_t* w, acc_t* s1, acc_t* s2, acc_t* g, int64_t dim,
                       const FusedScalars& h, const AdamScalars<acc_t>& adam, std::vector<acc_t>& wide) {
  if constexpr (std::is_same_v<weight_t, acc_t>) {
    update_row(optimizer, w, s1, s2, g, dim, h, adam);
  } else {
    wide.resize(static_cast<size_t>(dim));
    if constexpr (std::is_same_v<weight_t, Half>) {
      widen_half(w, wide.data(), dim);
    } else {
      for (int64_t j = 0; j < dim; ++j) wide[j] = static_cast<acc_t>(w[j]);
    }
    update_row(optimizer, wide.data(), s1, s2, g, dim, h, adam);
    if constexpr (std::is_same_v<weight_t, Half>) {
      narrow_half(wide.data(), w, dim);
    } else {
      for (int64_t j = 0; j < dim; ++j) w[j] = static_cast<weight_t>(wide[j]);
    }
  }
}

}  // namespace

void pooled_read_update_cpu(const std::vector<Tensor>& weights, const std::vector<Tensor>& state1,
                            const std::vector<Tensor>& state2, const std::vector<Tensor>& steps,
                            const Tensor& grad_in,
                            const Tensor& rows_in, const Tensor& offsets_in,
                            const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                            std::vector<int64_t> feature_columns, std::vector<int64_t> feature_means,
                            StrArg optimizer_name, std::vector<double> hyper, const std::optional<Tensor>& lr,
                            const std::optional<Tensor>& errors) {
  const char* op = "pooled_read_update_";
  const FusedOptimizer optimizer = parse_fused_optimizer(optimizer_name.value);
  const PooledLayout layout =
      check_pooled_args(op, weights, rows_in, offsets_in, per_sample_weights_in, feature_tables, feature_columns,
                        feature_means, grad_in.dim() == 2 ? grad_in.size(1) : 0);
  const Device device = weights[0].device();
  check_pooled_grad(op, grad_in, layout, device);
  FusedScalars h = check_fused_hyper(op, optimizer, hyper);
  check_fused_state(op, optimizer, weights, state1, state2, steps);
  if (lr.has_value()) {
    SK_CHECK(lr->numel() == 1 && (lr->scalar_type() == kFloat || lr->scalar_type() == kDouble) &&
                 lr->device().is_cpu(),
             op, ": lr must be a float32 or float64 tensor of one element on the CPU, got ", lr->scalar_type(),
             " of shape ", lr->sizes(), " on ", lr->device());
    h.lr = lr->scalar_type() == kFloat ? static_cast<double>(*lr->const_data_ptr<float>())
                                       : *lr->const_data_ptr<double>();
    SK_CHECK(h.lr >= 0.0, op, ": lr must be >= 0, got ", h.lr);
  }
  std::vector<TensorUse> uses;
  for (size_t t = 0; t < weights.size(); ++t) uses.push_back({&weights[t], "weights", t, true});
  for (size_t t = 0; t < state1.size(); ++t) uses.push_back({&state1[t], "state1", t, true});
  for (size_t t = 0; t < state2.size(); ++t) uses.push_back({&state2[t], "state2", t, true});
  for (size_t t = 0; t < steps.size(); ++t) uses.push_back({&steps[t], "steps", t, true});
  uses.push_back({&grad_in, "grad", 0, false});
  uses.push_back({&rows_in, "rows", 0, false});
  uses.push_back({&offsets_in, "offsets", 0, false});
  if (per_sample_weights_in.has_value()) uses.push_back({&*per_sample_weights_in, "per_sample_weights", 0, false});
  check_pooled_errors_arg(op, errors, device);
  if (errors.has_value()) uses.push_back({&*errors, "errors", 0, true});
  check_no_shared_writes(op, uses);
  const Tensor grad = as_contiguous(grad_in);
  const Tensor rows = as_contiguous(rows_in);
  const Tensor offsets = as_contiguous(offsets_in);
  const Tensor psw = per_sample_weights_in.has_value() ? as_contiguous(*per_sample_weights_in) : Tensor();
  const float* psw_ptr = per_sample_weights_in.has_value() ? psw.const_data_ptr<float>() : nullptr;
  const int64_t* offsets_ptr = offsets.const_data_ptr<int64_t>();
  const size_t num_tables = weights.size();
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  // Everything that can fail comes before the first write: the lookups' checks, then the
  // grouping's memory.
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, rows.const_data_ptr<int64_t>(), device, errors);
  const RowGroups groups = group_rows(lookups);
  std::vector<TableUpdate> tables(num_tables);
  for (int64_t f = 0; f < layout.num_features; ++f) {
    if (layout.feature_tables[f] >= 0) tables[layout.feature_tables[f]].read = true;
  }
  for (size_t t = 0; t < num_tables; ++t) {
    if (optimizer != FusedOptimizer::kLazyAdam || !tables[t].read) continue;
    const int64_t step = *steps[t].const_data_ptr<int64_t>();
    SK_CHECK(step >= 0 && step < INT64_MAX, op, ": steps[", t, "] must lie in [0, 2^63 - 1), got ", step);
    const double size = lazy_adam_step_size(step + 1, h.lr, h.beta1, h.beta2);
    tables[t].adam = AdamScalars<float>::make(size, h.beta1, h.beta2, h.eps, h.weight_decay);
    tables[t].adam64 = AdamScalars<double>::make(size, h.beta1, h.beta2, h.eps, h.weight_decay);
  }
  const int64_t num_groups = static_cast<int64_t>(groups.sorted.size());
  const int64_t* codes = groups.groups.codes.const_data_ptr<int64_t>();
  const int64_t* group_offsets = groups.groups.offsets.const_data_ptr<int64_t>();
  const int64_t* order = groups.groups.order.const_data_ptr<int64_t>();
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_update_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* grad_ptr = grad.const_data_ptr<scalar_t>();
    // Each table's pointers, taken once: through the stable ABI every data pointer is a call.
    std::vector<scalar_t*> weight_of(num_tables);
    std::vector<acc_t*> first_of(num_tables, nullptr), second_of(num_tables, nullptr);
    for (size_t t = 0; t < num_tables; ++t) {
      weight_of[t] = weights[t].mutable_data_ptr<scalar_t>();
      if (!state1.empty()) first_of[t] = state1[t].mutable_data_ptr<acc_t>();
      if (!state2.empty()) second_of[t] = state2[t].mutable_data_ptr<acc_t>();
    }
    const auto table_of = [&](int64_t i) {
      return std::upper_bound(groups.table_first.begin(), groups.table_first.end(), i) - groups.table_first.begin() -
             1;
    };
    const int64_t widest = *std::max_element(layout.table_dims.begin(), layout.table_dims.end());
    // The rows are scattered over tables far larger than the caches: their weight and state
    // rows are fetched ahead, as lazy_adam_'s are (adam_row.h).
    const int64_t ahead = prefetch_rows_ahead(std::max<int64_t>(widest, 1) * static_cast<int64_t>(sizeof(acc_t)));
    parallel_for(0, num_groups, group_grain(layout), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> g, wide;
      for (int64_t i = begin; i < end; ++i) {
        if (i + ahead < end) {
          const int64_t t = table_of(i + ahead);
          const int64_t dim = layout.table_dims[t];
          const int64_t row = codes[groups.sorted[i + ahead]] - lookups.bases[t];
          const int64_t bytes = dim * static_cast<int64_t>(sizeof(acc_t));
          const int64_t state_row = optimizer == FusedOptimizer::kRowWiseAdagrad ? row : row * dim;
          const void* weight_row = weight_of[t] + row * dim;
          prefetch_row(weight_row, first_of[t] != nullptr ? static_cast<const void*>(first_of[t] + state_row) : weight_row,
                       second_of[t] != nullptr ? static_cast<const void*>(second_of[t] + row * dim) : weight_row, bytes);
        }
        const int64_t group = groups.sorted[i];
        const int64_t t = table_of(i);
        const int64_t dim = layout.table_dims[t];
        const int64_t row = codes[group] - lookups.bases[t];
        g.resize(static_cast<size_t>(dim));
        sum_group(g.data(), dim, order, group_offsets[group], group_offsets[group + 1], lookups.bag_of.data(),
                  grad_ptr, layout, offsets_ptr, psw_ptr);
        acc_t* s1 = nullptr;
        acc_t* s2 = nullptr;
        if (optimizer == FusedOptimizer::kLazyAdam) {
          s1 = first_of[t] + row * dim;
          s2 = second_of[t] + row * dim;
        } else if (optimizer == FusedOptimizer::kRowWiseAdagrad) {
          s1 = first_of[t] + row;
        }
        update_weight_row(optimizer, weight_of[t] + row * dim, s1, s2, g.data(), dim, h,
                          adam_scalars_of<acc_t>(tables[t]), wide);
      }
    });
  });
  if (optimizer == FusedOptimizer::kLazyAdam) {
    for (size_t t = 0; t < num_tables; ++t) *steps[t].mutable_data_ptr<int64_t>() += tables[t].read ? 1 : 0;
  }
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("pooled_read", TORCH_BOX(&pooled_read_cpu));
  m.impl("pooled_read_backward", TORCH_BOX(&pooled_read_backward_cpu));
  m.impl("pooled_read_update_", TORCH_BOX(&pooled_read_update_cpu));
}

}  // namespace sparsekit
