// The CPU kernel of the fused optimizer step (pooled_read_update_): the pooled read's
// gradient, summed per distinct row in position order, applied to the rows in place (SGD,
// LazyAdam, row-wise Adagrad, Adagrad) with no gradient written; the layout is in pooled.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/adam_row.h"
#include "cpu/half_rows.h"
#include "cpu/pooled_rows.h"
#include "cpu/parallel.h"
#include "pooled.h"

namespace sparsekit {
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

/// @brief Row-wise Adagrad (FBGEMM's exact one: one accumulator per row, of the row's mean
/// squared gradient), first part: adds the L2 decay to g and returns mean(g^2). Eight partial
/// sums in a fixed order, not one chain of dim dependent adds: the sum vectorises and is the
/// same whatever the threads (bench_torchrec's training cells).
template <typename acc_t>
inline acc_t rowwise_mean_square(const acc_t* w, acc_t* g, int64_t dim, const FusedScalars& h) {
  const acc_t decay = static_cast<acc_t>(h.weight_decay);
  if (decay != acc_t(0)) {
    for (int64_t j = 0; j < dim; ++j) g[j] += decay * w[j];
  }
  constexpr int64_t kLanes = 8;
  acc_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += g[j + l] * g[j + l];
  }
  for (int64_t l = 0; j < dim; ++j, ++l) lanes[l] += g[j] * g[j];
  const acc_t squares = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  return squares / static_cast<acc_t>(std::max<int64_t>(dim, 1));
}

/// Row-wise Adagrad's step size for an accumulator that already holds this step's square.
template <typename acc_t>
inline acc_t rowwise_step(acc_t sum, const FusedScalars& h) {
  return static_cast<acc_t>(h.lr) / (std::sqrt(sum) + static_cast<acc_t>(h.eps));
}

template <typename acc_t>
inline void apply_rowwise_step(acc_t* w, const acc_t* g, int64_t dim, acc_t step) {
  for (int64_t j = 0; j < dim; ++j) w[j] -= step * g[j];
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
    case FusedOptimizer::kRowWiseAdagrad:
      *s1 += rowwise_mean_square(w, g, dim, h);
      apply_rowwise_step(w, g, dim, rowwise_step(*s1, h));
      return;
    case FusedOptimizer::kAdagrad: {
      // FBGEMM's exact Adagrad (torch.optim.Adagrad without lr decay): a sum of squares per
      // element; the L2 decay added to the gradient first.
      const acc_t lr = static_cast<acc_t>(h.lr), eps = static_cast<acc_t>(h.eps);
      const acc_t decay = static_cast<acc_t>(h.weight_decay);
      for (int64_t j = 0; j < dim; ++j) {
        const acc_t gj = decay != acc_t(0) ? g[j] + decay * w[j] : g[j];
        s1[j] += gj * gj;
        w[j] -= lr * gj / (std::sqrt(s1[j]) + eps);
      }
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

/// The tables' rows and state, and each row's update once its summed gradient is at hand.
template <typename scalar_t, typename acc_t>
struct RowUpdater {
  // Row-wise Adagrad on float32 / float64 rows goes a block of rows at a time: a row's step
  // size is a chain of a division, a square root and a division, and the independent
  // chains of a block overlap where one row's would stall (bench_torchrec's training cells).
  static constexpr int64_t kBlock = 8;

  FusedOptimizer optimizer;
  FusedScalars h;
  const std::vector<TableUpdate>& tables;
  const std::vector<int64_t>& dims;
  std::vector<scalar_t*> weight_of;  // each table's pointers, taken once: through the
  std::vector<acc_t*> first_of;      // stable ABI every data pointer is a call
  std::vector<acc_t*> second_of;

  /// Fetches a row's weights and state ahead of its update: the rows are scattered over
  /// tables far larger than the caches (as lazy_adam_'s, adam_row.h). Always inlined, as
  /// prefetch_row is: else GCC deletes the call.
  SPARSEKIT_ALWAYS_INLINE void prefetch(int64_t t, int64_t row) const {
    const int64_t dim = dims[t];
    const int64_t state_row = optimizer == FusedOptimizer::kRowWiseAdagrad ? row : row * dim;
    const void* weight_row = weight_of[t] + row * dim;
    prefetch_row(weight_row, first_of[t] != nullptr ? static_cast<const void*>(first_of[t] + state_row) : weight_row,
                 second_of[t] != nullptr ? static_cast<const void*>(second_of[t] + row * dim) : weight_row,
                 dim * static_cast<int64_t>(sizeof(acc_t)));
  }

  /// @brief Updates n <= kBlock distinct rows: table t_of[i]'s row row_of[i] by its summed
  /// gradient g_of[i] (which the update may change).
  void apply(int64_t n, const int64_t* t_of, const int64_t* row_of, acc_t* const* g_of, std::vector<acc_t>& wide) const {
    if constexpr (std::is_same_v<scalar_t, acc_t>) {
      if (optimizer == FusedOptimizer::kRowWiseAdagrad) {
        acc_t* w[kBlock];
        acc_t step[kBlock];
        for (int64_t i = 0; i < n; ++i) {
          const int64_t dim = dims[t_of[i]];
          w[i] = weight_of[t_of[i]] + row_of[i] * dim;
          step[i] = rowwise_mean_square(w[i], g_of[i], dim, h);
        }
        for (int64_t i = 0; i < n; ++i) {
          acc_t& sum = first_of[t_of[i]][row_of[i]];
          sum += step[i];
          step[i] = rowwise_step(sum, h);
        }
        for (int64_t i = 0; i < n; ++i) apply_rowwise_step(w[i], g_of[i], dims[t_of[i]], step[i]);
        return;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = t_of[i], row = row_of[i], dim = dims[t];
      acc_t* s1 = nullptr;
      acc_t* s2 = nullptr;
      if (optimizer == FusedOptimizer::kLazyAdam) {
        s1 = first_of[t] + row * dim;
        s2 = second_of[t] + row * dim;
      } else if (optimizer == FusedOptimizer::kRowWiseAdagrad) {
        s1 = first_of[t] + row;
      } else if (optimizer == FusedOptimizer::kAdagrad) {
        s1 = first_of[t] + row * dim;
      }
      update_weight_row(optimizer, weight_of[t] + row * dim, s1, s2, g_of[i], dim, h,
                        adam_scalars_of<acc_t>(tables[t]), wide);
    }
  }
};

}  // namespace

void pooled_read_update_cpu(const std::vector<Tensor>& weights, const std::vector<Tensor>& state1,
                            const std::vector<Tensor>& state2, const std::vector<Tensor>& steps,
                            const std::vector<Tensor>& grads_in, const Tensor& rows_in, const Tensor& offsets_in,
                            const std::optional<Tensor>& per_sample_weights_in, std::vector<int64_t> feature_tables,
                            std::vector<int64_t> feature_means,
                            StrArg optimizer_name, std::vector<double> hyper, const std::optional<Tensor>& lr,
                            const std::optional<Tensor>& errors,
                            std::vector<int64_t> grad_columns) {
  const char* op = "pooled_read_update_";
  const FusedUpdateArgs args =
      check_fused_update_args(op, weights, state1, state2, steps, grads_in, rows_in, offsets_in, per_sample_weights_in,
                              feature_tables, feature_means, optimizer_name.value, hyper, lr, errors, grad_columns);
  const FusedOptimizer optimizer = args.optimizer;
  const PooledLayout& layout = args.layout;
  const std::vector<Tensor>& grads = args.grads;
  const Device device = weights[0].device();
  FusedScalars h = args.h;
  if (lr.has_value()) {
    h.lr = lr->scalar_type() == kFloat ? static_cast<double>(*lr->const_data_ptr<float>())
                                       : *lr->const_data_ptr<double>();
    SK_CHECK(h.lr >= 0.0, op, ": lr must be >= 0, got ", h.lr);
  }
  const LookupInputs in(rows_in, offsets_in, per_sample_weights_in);
  const int64_t* offsets_ptr = in.offsets_ptr;
  const float* psw_ptr = in.psw_ptr;
  const size_t num_tables = weights.size();
  if (layout.batch == 0) check_no_bags(op, layout, offsets_ptr, errors);
  // Everything that can fail comes before the first write: the lookups' checks, then the
  // grouping's memory.
  const IndexedLookups lookups =
      index_lookups(op, layout, offsets_ptr, in.rows_ptr, grads, device, errors);
  const RowGroups groups = group_rows(op, lookups, layout, lookups_scaled(layout, psw_ptr));
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
  SK_DISPATCH_FLOATING_TYPES(layout.dtype, "pooled_read_update_cpu", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    using Updater = RowUpdater<scalar_t, acc_t>;
    constexpr int64_t kBlock = Updater::kBlock;
    Updater updater{optimizer, h, tables, layout.table_dims, std::vector<scalar_t*>(num_tables),
                    std::vector<acc_t*>(num_tables, nullptr), std::vector<acc_t*>(num_tables, nullptr)};
    for (size_t t = 0; t < num_tables; ++t) {
      updater.weight_of[t] = weights[t].mutable_data_ptr<scalar_t>();
      if (!state1.empty()) updater.first_of[t] = state1[t].mutable_data_ptr<acc_t>();
      if (!state2.empty()) updater.second_of[t] = state2[t].mutable_data_ptr<acc_t>();
    }
    const int64_t widest = std::max<int64_t>(1, *std::max_element(layout.table_dims.begin(), layout.table_dims.end()));
    const int64_t ahead = prefetch_rows_ahead(widest * static_cast<int64_t>(sizeof(acc_t)));
    const int64_t num_distinct = groups.distinct.size(0);
    const int64_t* distinct = groups.distinct.const_data_ptr<int64_t>();
    parallel_for(0, num_distinct, row_grain(layout), [&](int64_t begin, int64_t end) {
      // Each row's gradient summed right before its update: its lookups' output gradients
      // are few and cached, and no gradient block is written.
      std::vector<acc_t> wide, gradient(static_cast<size_t>(widest * kBlock));
      int64_t t_of[kBlock], row_of[kBlock];
      acc_t* g_of[kBlock];
      for (int64_t first = begin; first < end; first += kBlock) {
        const int64_t n = std::min(kBlock, end - first);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t r = first + j;
          if (r + ahead < end) {
            const int64_t ahead_table = table_of_rank(groups, r + ahead);
            updater.prefetch(ahead_table, distinct[r + ahead] - lookups.bases[ahead_table]);
          }
          const int64_t t = table_of_rank(groups, r);
          t_of[j] = t;
          row_of[j] = distinct[r] - lookups.bases[t];
          g_of[j] = gradient.data() + j * widest;
          sum_row<acc_t, scalar_t>(g_of[j], layout.table_dims[t], groups, r, lookups, psw_ptr);
        }
        updater.apply(n, t_of, row_of, g_of, wide);
      }
    });
  });
  if (optimizer == FusedOptimizer::kLazyAdam) {
    for (size_t t = 0; t < num_tables; ++t) *steps[t].mutable_data_ptr<int64_t>() += tables[t].read ? 1 : 0;
  }
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("pooled_read_update_", TORCH_BOX(&pooled_read_update_cpu));
}

}  // namespace sparsekit
