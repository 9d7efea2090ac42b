// CPU kernel of lazy_adam_: Adam on the rows of a sparse gradient only.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/half_rows.h"
#include "cpu/parallel.h"

#include "cpu/adam_row.h"
#include "lazy_adam.h"

namespace sparsekit {
namespace {

// Rows of weight per row given up to which distinctness is checked with a bitmap of
// weight's rows (zeroing a word costs less than sorting a row); above, a sorted copy.
constexpr int64_t kBitmapRowsPerUpdate = 128;

/// @brief The first row found twice among rows[0, n) (all in [0, num_rows)), or -1.
template <typename index_t>
int64_t repeated_row(const index_t* rows, int64_t n, int64_t num_rows) {
  if (n < 2) return -1;
  // Strictly ascending rows are distinct: a coalesced gradient's are, and one compare per
  // row costs less than the bitmap's zeroing and its atomic or per row.
  bool ascending = true;
  for (int64_t i = 1; i < n; ++i) ascending &= rows[i - 1] < rows[i];
  if (ascending) return -1;
  if (num_rows <= kBitmapRowsPerUpdate * n + (int64_t{1} << 16)) {
    std::vector<uint64_t> seen((num_rows + 63) / 64, 0);
    std::atomic<int64_t> found{-1};
    parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = static_cast<int64_t>(rows[i]);
        const uint64_t bit = uint64_t{1} << (row & 63);
        if (__atomic_fetch_or(&seen[row >> 6], bit, __ATOMIC_RELAXED) & bit) {
          found.store(row, std::memory_order_relaxed);
          return;
        }
      }
    });
    return found.load();
  }
  std::vector<int64_t> sorted(rows, rows + n);
  std::sort(sorted.begin(), sorted.end());
  const auto at = std::adjacent_find(sorted.begin(), sorted.end());
  return at != sorted.end() ? *at : -1;
}

/// @brief Raises unless every row lies in [0, num_rows) and no row appears twice (a
/// repeated row would be updated twice, by racing threads). Reads rows only.
template <typename index_t>
void check_rows(const index_t* rows, int64_t num_rows_given, int64_t num_rows) {
  std::atomic<bool> bad{false};
  std::atomic<int64_t> bad_row{0};
  parallel_for(0, num_rows_given, 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = static_cast<int64_t>(rows[i]);
      if (row < 0 || row >= num_rows) {
        bad_row.store(row, std::memory_order_relaxed);
        bad.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  SK_CHECK(!bad.load(), lazy_adam_row_range_message(bad_row.load(), num_rows));
  const int64_t repeated = repeated_row(rows, num_rows_given, num_rows);
  SK_CHECK(repeated < 0, lazy_adam_repeated_row_message(repeated));
}

/// @brief Raises when one table's update would write what another table reads or writes
/// (each table's own tensors were checked by check_lazy_adam_disjoint, with their names).
/// Tables may share what is only read: one rows or gradient tensor for several tables.
void check_tables_disjoint(const char* op, const std::vector<Tensor>& weights, const std::vector<Tensor>& exp_avgs,
                           const std::vector<Tensor>& exp_avg_sqs, const std::vector<Tensor>& rows,
                           const std::vector<Tensor>& grads) {
  std::vector<TensorUse> uses;
  for (size_t t = 0; t < weights.size(); ++t) {
    uses.push_back({&weights[t], "weights", t, true});
    uses.push_back({&exp_avgs[t], "exp_avgs", t, true});
    uses.push_back({&exp_avg_sqs[t], "exp_avg_sqs", t, true});
    uses.push_back({&rows[t], "rows", t, false});
    uses.push_back({&grads[t], "grads", t, false});
  }
  check_no_shared_writes(op, uses);
}

}  // namespace

/// @brief In-place lazy Adam: updates weight, exp_avg and exp_avg_sq at `rows` only.
/// @param weight [R, ...] parameter, contiguous, updated in place.
/// @param exp_avg, exp_avg_sq [R, ...] moments with weight's dtype and shape, updated in place.
/// @param rows int64 or int32 [u], distinct row indices in [0, R) (both checked first).
/// @param grad [u, ...] gradient rows with weight's dtype.
/// @param step the step number after incrementing (>= 1), for the bias correction.
void lazy_adam_cpu(Tensor& weight, Tensor& exp_avg, Tensor& exp_avg_sq, const Tensor& rows,
                   const Tensor& grad, int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay) {
  check_lazy_adam_args(weight, exp_avg, exp_avg_sq, rows, grad, step, lr, beta1, beta2, eps, weight_decay);
  check_lazy_adam_disjoint("lazy_adam_", weight, exp_avg, exp_avg_sq, rows, grad);
  const int64_t num_updates = rows.size(0);
  const int64_t num_rows = weight.size(0);
  const int64_t dim = num_rows == 0 ? 0 : weight.numel() / num_rows;
  const Tensor rows_c = as_contiguous(rows);
  SK_DISPATCH_INDEX_TYPES(rows_c.scalar_type(), "lazy_adam_cpu_check", [&] {
    check_rows(rows_c.mutable_data_ptr<index_t>(), num_updates, num_rows);
  });
  if (num_updates == 0 || dim == 0) return;
  const Tensor grad_c = as_contiguous(grad);
  const double step_size = lazy_adam_step_size(step, lr, beta1, beta2);
  const bool use_weight_decay = weight_decay != 0.0;
  const int64_t row_bytes = dim * static_cast<int64_t>(weight.element_size());
  // About 64 KiB of each state tensor per task.
  const int64_t grain = std::max<int64_t>(1, 16384 / dim);
  SK_DISPATCH_FLOATING_TYPES(weight.scalar_type(), "lazy_adam_cpu", [&] {
    using opmath_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const auto scalars = AdamScalars<opmath_t>::make(step_size, beta1, beta2, eps, weight_decay);
    scalar_t* weight_ptr = weight.mutable_data_ptr<scalar_t>();
    scalar_t* exp_avg_ptr = exp_avg.mutable_data_ptr<scalar_t>();
    scalar_t* exp_avg_sq_ptr = exp_avg_sq.mutable_data_ptr<scalar_t>();
    const scalar_t* grad_ptr = grad_c.mutable_data_ptr<scalar_t>();
    SK_DISPATCH_INDEX_TYPES(rows_c.scalar_type(), "lazy_adam_cpu_rows", [&] {
      const index_t* rows_ptr = rows_c.mutable_data_ptr<index_t>();
      const int64_t distance = prefetch_rows_ahead(row_bytes);
      parallel_for(0, num_updates, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          if (i + distance < end) {
            const int64_t ahead = static_cast<int64_t>(rows_ptr[i + distance]) * dim;
            prefetch_row(weight_ptr + ahead, exp_avg_ptr + ahead, exp_avg_sq_ptr + ahead, row_bytes);
          }
          const int64_t offset = static_cast<int64_t>(rows_ptr[i]) * dim;
          adam_row<scalar_t, opmath_t>(weight_ptr + offset, exp_avg_ptr + offset, exp_avg_sq_ptr + offset,
                                       grad_ptr + i * dim, dim, scalars, use_weight_decay);
        }
      });
    });
  });
}

/// @brief Updates rows [begin, end) of one table of lazy_adam_tables_ (local positions).
/// A float32 weight is updated in place; a float16 / bfloat16 one (float32 moments and
/// gradient) is widened row by row into `scratch`, updated there with the same float32
/// arithmetic and rounded back to nearest: what LazyAdam does for such a shard with
/// index_select, lazy_adam_ on float32 copies and index_copy_, bit for bit.
template <typename weight_t>
void adam_table_rows(weight_t* weight, float* exp_avg, float* exp_avg_sq, const float* grad, const int64_t* rows,
                     int64_t dim, int64_t begin, int64_t end, const AdamScalars<float>& scalars, bool use_weight_decay,
                     std::vector<float>& scratch) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(float));
  const int64_t distance = prefetch_rows_ahead(row_bytes);
  for (int64_t i = begin; i < end; ++i) {
    if (i + distance < end) {
      const int64_t ahead = rows[i + distance] * dim;
      prefetch_row(weight + ahead, exp_avg + ahead, exp_avg_sq + ahead, row_bytes);
    }
    const int64_t offset = rows[i] * dim;
    if constexpr (std::is_same_v<weight_t, float>) {
      adam_row<float, float>(weight + offset, exp_avg + offset, exp_avg_sq + offset, grad + i * dim, dim, scalars,
                             use_weight_decay);
    } else {
      scratch.resize(dim);
      if constexpr (std::is_same_v<weight_t, Half>) {
        widen_half(weight + offset, scratch.data(), dim);
      } else {
        for (int64_t j = 0; j < dim; ++j) scratch[j] = static_cast<float>(weight[offset + j]);
      }
      adam_row<float, float>(scratch.data(), exp_avg + offset, exp_avg_sq + offset, grad + i * dim, dim, scalars,
                             use_weight_decay);
      if constexpr (std::is_same_v<weight_t, Half>) {
        narrow_half(scratch.data(), weight + offset, dim);
      } else {
        for (int64_t j = 0; j < dim; ++j) weight[offset + j] = static_cast<weight_t>(scratch[j]);
      }
    }
  }
}

/// @brief lazy_adam_ over several tables in one call: table t updates weights[t],
/// exp_avgs[t], exp_avg_sqs[t] at rows[t] (int64, distinct) with grads[t], step steps[t]
/// and hyper[5t : 5t + 5] = (lr, beta1, beta2, eps, weight_decay). Moments and gradients
/// are float32; a weight is float32, or float16 / bfloat16 (a half shard: updated in
/// float32, rounded to nearest). Everything is checked before anything is written, so a
/// bad row in one table changes no table; the arithmetic is lazy_adam_'s, row for row.
void lazy_adam_tables_cpu(const std::vector<Tensor>& weights, const std::vector<Tensor>& exp_avgs,
                          const std::vector<Tensor>& exp_avg_sqs, const std::vector<Tensor>& rows,
                          const std::vector<Tensor>& grads, const std::vector<int64_t>& steps,
                          const std::vector<double>& hyper) {
  const char* op = "lazy_adam_tables_";
  const size_t num_tables = weights.size();
  SK_CHECK(exp_avgs.size() == num_tables && exp_avg_sqs.size() == num_tables && rows.size() == num_tables &&
               grads.size() == num_tables && steps.size() == num_tables && hyper.size() == 5 * num_tables,
           op, ": weights (", num_tables, "), exp_avgs (", exp_avgs.size(), "), exp_avg_sqs (", exp_avg_sqs.size(),
           "), rows (", rows.size(), "), grads (", grads.size(), ") and steps (", steps.size(),
           ") must hold one entry per table and hyper five (", hyper.size(), ")");
  std::vector<Tensor> grads_c;
  std::vector<int64_t> offsets(num_tables + 1, 0);
  int64_t max_dim = 1;
  for (size_t t = 0; t < num_tables; ++t) {
    const double* h = hyper.data() + 5 * t;
    const auto dtype = weights[t].scalar_type();
    SK_CHECK((dtype == kFloat || dtype == kHalf || dtype == kBFloat16) && weights[t].device().is_cpu(), op,
             ": weights[", t, "] must be a float32, float16 or bfloat16 CPU tensor, got ", dtype, " on ",
             weights[t].device());
    SK_CHECK(exp_avgs[t].scalar_type() == kFloat, op, ": exp_avgs[", t, "] must be float32 (a half weight keeps "
             "float32 moments), got ", exp_avgs[t].scalar_type());
    SK_CHECK(weights[t].is_contiguous() && same_sizes(weights[t].sizes(), exp_avgs[t].sizes()), op, ": weights[", t,
             "] ", weights[t].sizes(), " must be contiguous with the shape of exp_avgs[", t, "] ",
             exp_avgs[t].sizes());
    // The moments stand in for a half weight: the rest must match them.
    check_lazy_adam_args(dtype == kFloat ? weights[t] : exp_avgs[t], exp_avgs[t], exp_avg_sqs[t], rows[t], grads[t],
                         steps[t], h[0], h[1], h[2], h[3], h[4], OpName(op, static_cast<int64_t>(t)));
    check_lazy_adam_disjoint(op, weights[t], exp_avgs[t], exp_avg_sqs[t], rows[t], grads[t]);
    SK_CHECK(rows[t].scalar_type() == kLong && rows[t].is_contiguous(), op, ": rows[", t,
             "] must be a contiguous int64 tensor");
    grads_c.push_back(as_contiguous(grads[t]));
    offsets[t + 1] = offsets[t] + rows[t].size(0);
    const int64_t num_rows = weights[t].size(0);
    if (num_rows > 0) max_dim = std::max(max_dim, weights[t].numel() / num_rows);
  }
  const int64_t total = offsets[num_tables];
  // Every row of every table first: nothing is written unless all are in range.
  std::atomic<int64_t> bad_at{total};
  parallel_for(0, total, 1 << 14, [&](int64_t begin, int64_t end) {
    for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
      const int64_t* r = rows[t].const_data_ptr<int64_t>();
      const int64_t num_rows = weights[t].size(0);
      for (int64_t i = b - offsets[t]; i < e - offsets[t]; ++i) {
        if (r[i] < 0 || r[i] >= num_rows) {
          const int64_t at = offsets[t] + i;
          int64_t seen = bad_at.load(std::memory_order_relaxed);
          while (at < seen && !bad_at.compare_exchange_weak(seen, at, std::memory_order_relaxed)) {
          }
          return;
        }
      }
    });
  });
  if (bad_at.load() < total) {
    const int64_t i = bad_at.load();
    const int64_t t = std::upper_bound(offsets.begin(), offsets.end(), i) - offsets.begin() - 1;
    SK_CHECK(false, op, ": rows[", t, "] holds ", rows[t].const_data_ptr<int64_t>()[i - offsets[t]],
             ", outside [0, ", weights[t].size(0), ") (the rows of weights[", t, "]); nothing was updated");
  }
  // A row given twice would be updated twice (by racing threads): refused as lazy_adam_ does.
  for (size_t t = 0; t < num_tables; ++t) {
    const int64_t repeated = repeated_row(rows[t].const_data_ptr<int64_t>(), rows[t].size(0), weights[t].size(0));
    SK_CHECK(repeated < 0, op, ": rows[", t, "] holds row ", repeated, " more than once (a sparse gradient "
             "marked coalesced that is not?); nothing was updated");
  }
  check_tables_disjoint(op, weights, exp_avgs, exp_avg_sqs, rows, grads_c);
  struct Table {
    void* weight;
    ScalarType dtype;
    float *exp_avg, *exp_avg_sq;
    const float* grad;
    const int64_t* rows;
    int64_t dim;
    AdamScalars<float> scalars;
    bool use_weight_decay;
  };
  std::vector<Table> tables(num_tables);
  for (size_t t = 0; t < num_tables; ++t) {
    const double* h = hyper.data() + 5 * t;
    const int64_t num_rows = weights[t].size(0);
    const int64_t dim = num_rows == 0 ? 0 : weights[t].numel() / num_rows;
    tables[t] = Table{weights[t].mutable_data_ptr(), weights[t].scalar_type(), exp_avgs[t].mutable_data_ptr<float>(),
                      exp_avg_sqs[t].mutable_data_ptr<float>(), grads_c[t].const_data_ptr<float>(),
                      rows[t].const_data_ptr<int64_t>(), dim,
                      AdamScalars<float>::make(lazy_adam_step_size(steps[t], h[0], h[1], h[2]), h[1], h[2], h[3],
                                               h[4]),
                      h[4] != 0.0};
  }
  // About 64 KiB of each state tensor per task, as lazy_adam_.
  parallel_for(0, total, std::max<int64_t>(1, 16384 / max_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for_each_table_range(offsets, begin, end, [&](int64_t t, int64_t b, int64_t e) {
      const Table& table = tables[t];
      if (table.dim == 0) return;
      auto run = [&](auto* weight) {
        adam_table_rows(weight, table.exp_avg, table.exp_avg_sq, table.grad, table.rows, table.dim, b - offsets[t],
                        e - offsets[t], table.scalars, table.use_weight_decay, scratch);
      };
      if (table.dtype == kFloat) {
        run(static_cast<float*>(table.weight));
      } else if (table.dtype == kHalf) {
        run(static_cast<Half*>(table.weight));
      } else {
        run(static_cast<BFloat16*>(table.weight));
      }
    });
  });
}

STABLE_TORCH_LIBRARY_IMPL(sparsekit, CPU, m) {
  m.impl("lazy_adam_", TORCH_BOX(&lazy_adam_cpu));
  m.impl("lazy_adam_tables_", TORCH_BOX(&lazy_adam_tables_cpu));
}

}  // namespace sparsekit
