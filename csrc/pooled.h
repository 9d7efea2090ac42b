#pragma once
// The argument checks and the layout shared by the CPU and CUDA kernels of the collection's
// pooled read (pooled_read), its gradient grouped by row (pooled_read_backward) and the
// fused optimizer step that applies that gradient in place (pooled_read_update_).
// A call reads F features' bags, feature-major in one CSR `offsets` [F * B + 1] over
// `rows` [nnz] (each value's row in its feature's table, -1 for a missing key). Feature f
// reads table feature_tables[f] (-1: another call reads it) and writes its pooled bags to
// the columns [feature_columns[f], feature_columns[f] + D_t) of the [B, total_dim] output.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "embedding.h"

namespace sparsekit {

/// The optimizers of pooled_read_update_.
enum class FusedOptimizer : int { kSgd = 0, kLazyAdam = 1, kRowWiseAdagrad = 2, kAdagrad = 3 };

inline FusedOptimizer parse_fused_optimizer(const std::string& name) {
  if (name == "sgd") return FusedOptimizer::kSgd;
  if (name == "lazy_adam") return FusedOptimizer::kLazyAdam;
  if (name == "rowwise_adagrad") return FusedOptimizer::kRowWiseAdagrad;
  if (name == "adagrad") return FusedOptimizer::kAdagrad;
  fail("pooled_read_update_: optimizer must be \"sgd\", \"lazy_adam\", \"rowwise_adagrad\" or \"adagrad\", got \"",
       name, "\"");
}

/// The checked layout of one call.
struct PooledLayout {
  int64_t num_features = 0;
  int64_t batch = 0;  // B
  int64_t nnz = 0;
  int64_t total_dim = 0;
  ScalarType dtype = kFloat;  // the weights' (and the output's)
  std::vector<int64_t> table_dims;
  std::vector<int64_t> table_rows;
  std::vector<int64_t> feature_tables, feature_columns, feature_means;
};

/// @brief Checks what every op of the family takes and returns the call's layout. The
/// values of rows and offsets are checked by the kernels, which read them anyway.
inline PooledLayout check_pooled_args(const char* op, const std::vector<Tensor>& weights, const Tensor& rows,
                                      const Tensor& offsets, const std::optional<Tensor>& per_sample_weights,
                                      const std::vector<int64_t>& feature_tables,
                                      const std::vector<int64_t>& feature_columns,
                                      const std::vector<int64_t>& feature_means, int64_t total_dim) {
  PooledLayout layout;
  SK_CHECK(!weights.empty(), op, ": weights must hold at least one table");
  const Device device = weights[0].device();
  layout.dtype = weights[0].scalar_type();
  SK_CHECK(is_floating(layout.dtype), op, ": weights must be float32, float64, float16 or bfloat16, got ",
           layout.dtype);
  for (size_t t = 0; t < weights.size(); ++t) {
    const Tensor& w = weights[t];
    SK_CHECK(w.dim() == 2, op, ": weights[", t, "] must be 2-D [rows, dim], got shape ", w.sizes());
    SK_CHECK(w.scalar_type() == layout.dtype, op, ": every weight of one call has one dtype; weights[0] is ",
             layout.dtype, " but weights[", t, "] is ", w.scalar_type());
    SK_CHECK(w.device() == device, op, ": weights[", t, "] is on ", w.device(), " but weights[0] on ", device);
    SK_CHECK(w.size(1) <= 1 || w.stride(1) == 1, op, ": weights[", t, "] must have its rows dense in memory "
             "(stride 1 along dim 1)");
    layout.table_dims.push_back(w.size(1));
    layout.table_rows.push_back(w.size(0));
  }
  SK_CHECK(rows.scalar_type() == kLong && rows.dim() == 1, op, ": rows must be a 1-D int64 tensor [nnz], got a ",
           rows.scalar_type(), " tensor of shape ", rows.sizes());
  SK_CHECK(offsets.scalar_type() == kLong && offsets.dim() == 1 && offsets.size(0) >= 1, op,
           ": offsets must be a 1-D int64 tensor [features * B + 1], got a ", offsets.scalar_type(),
           " tensor of shape ", offsets.sizes());
  SK_CHECK(rows.device() == device && offsets.device() == device, op, ": rows (", rows.device(), ") and offsets (",
           offsets.device(), ") must be on the weights' device (", device, ")");
  layout.num_features = static_cast<int64_t>(feature_tables.size());
  SK_CHECK(layout.num_features >= 1 && feature_columns.size() == feature_tables.size() &&
               feature_means.size() == feature_tables.size(),
           op, ": feature_tables (", feature_tables.size(), "), feature_columns (", feature_columns.size(),
           ") and feature_means (", feature_means.size(), ") must hold one entry per feature, at least one");
  const int64_t bags = offsets.size(0) - 1;
  SK_CHECK(bags % layout.num_features == 0, op, ": offsets holds ", bags, " bags, which do not split into ",
           layout.num_features, " features of one batch size");
  layout.batch = bags / layout.num_features;
  layout.nnz = rows.size(0);
  SK_CHECK(total_dim >= 0, op, ": total_dim must be >= 0, got ", total_dim);
  layout.total_dim = total_dim;
  const int64_t num_tables = static_cast<int64_t>(weights.size());
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = feature_tables[f];
    SK_CHECK(t >= -1 && t < num_tables, op, ": feature_tables[", f, "] must lie in [-1, ", num_tables, "), got ", t);
    SK_CHECK(feature_means[f] == 0 || feature_means[f] == 1, op, ": feature_means[", f, "] must be 0 or 1, got ",
             feature_means[f]);
    if (t < 0) continue;
    const int64_t column = feature_columns[f];
    SK_CHECK(column >= 0 && column + layout.table_dims[t] <= total_dim, op, ": feature ", f, " writes columns [",
             column, ", ", column + layout.table_dims[t], ") outside [0, ", total_dim, ") (total_dim)");
  }
  if (per_sample_weights.has_value()) {
    const Tensor& psw = *per_sample_weights;
    SK_CHECK(psw.scalar_type() == kFloat && psw.dim() == 1 && psw.size(0) == layout.nnz, op,
             ": per_sample_weights must be a float32 tensor [nnz] = [", layout.nnz, "], got a ", psw.scalar_type(),
             " tensor of shape ", psw.sizes());
    SK_CHECK(psw.device() == device, op, ": per_sample_weights is on ", psw.device(), ", the weights on ", device);
  }
  layout.feature_tables = feature_tables;
  layout.feature_columns = feature_columns;
  layout.feature_means = feature_means;
  return layout;
}

/// @brief The layout of pooled_read_backward / pooled_read_update_, which take no columns:
/// check_pooled_args with every column 0 and the widest table's dim as the width.
inline PooledLayout check_pooled_backward_args(const char* op, const std::vector<Tensor>& weights, const Tensor& rows,
                                               const Tensor& offsets, const std::optional<Tensor>& per_sample_weights,
                                               const std::vector<int64_t>& feature_tables,
                                               const std::vector<int64_t>& feature_means) {
  int64_t widest = 0;
  for (const Tensor& w : weights) widest = std::max<int64_t>(widest, w.dim() == 2 ? w.size(1) : 0);
  return check_pooled_args(op, weights, rows, offsets, per_sample_weights, feature_tables,
                           std::vector<int64_t>(feature_tables.size(), 0), feature_means, widest);
}

/// @brief Checks the output gradients of pooled_read_backward / pooled_read_update_: one per
/// feature; a feature of this call's tables gets [B, D] of the weights' dtype with its
/// columns dense (any row stride: a column view of a wider block will do), the others any
/// tensor (not read).
inline void check_pooled_grads(const char* op, const std::vector<Tensor>& grads, const PooledLayout& layout,
                               const Device& device) {
  SK_CHECK(static_cast<int64_t>(grads.size()) == layout.num_features, op, ": grads must hold one tensor per feature (",
           layout.num_features, "), got ", grads.size());
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = layout.feature_tables[f];
    if (t < 0) continue;
    const Tensor& g = grads[f];
    const int64_t dim = layout.table_dims[t];
    SK_CHECK(g.dim() == 2 && g.size(0) == layout.batch && g.size(1) == dim && (dim <= 1 || layout.batch == 0 || g.stride(1) == 1), op,
             ": grads[", f, "] must be [B, D] = [", layout.batch, ", ", dim, "] with dense rows, got shape ",
             g.sizes());
    SK_CHECK(g.scalar_type() == layout.dtype && g.device() == device, op, ": grads[", f, "] is ", g.scalar_type(),
             " on ", g.device(), " but the weights are ", layout.dtype, " on ", device);
  }
}

/// @brief The output gradients of pooled_read_backward / pooled_read_update_ as one tensor
/// per feature. Without grad_columns, grads already is. With them (one per feature), grads
/// is one [B, W] block (a keyed output's gradient) and feature f's gradient is its columns
/// [grad_columns[f], + D): views made here, so the caller dispatches no slice per feature.
inline std::vector<Tensor> feature_grad_views(const char* op, const std::vector<Tensor>& grads,
                                              const std::vector<int64_t>& grad_columns, const PooledLayout& layout) {
  if (grad_columns.empty()) return grads;
  SK_CHECK(grads.size() == 1, op, ": with grad_columns, grads must hold one [B, W] block, got ", grads.size(),
           " tensors");
  SK_CHECK(static_cast<int64_t>(grad_columns.size()) == layout.num_features, op,
           ": grad_columns must hold one column per feature (", layout.num_features, "), got ", grad_columns.size());
  Tensor block = grads[0];
  SK_CHECK(block.dim() == 2, op, ": grads[0] must be a [B, W] block with grad_columns, got shape ", block.sizes());
  std::vector<Tensor> views;
  views.reserve(grad_columns.size());
  for (int64_t f = 0; f < layout.num_features; ++f) {
    const int64_t t = layout.feature_tables[f];
    if (t < 0) {
      views.push_back(block);  // not read
      continue;
    }
    const int64_t column = grad_columns[f], dim = layout.table_dims[t];
    SK_CHECK(column >= 0 && column + dim <= block.size(1), op, ": grad_columns[", f, "] = ", column, " puts feature ",
             f, "'s ", dim, " columns outside the block's ", block.size(1));
    views.push_back(torch::stable::narrow(block, 1, column, dim));
  }
  return views;
}

/// Per table t, the first code of its rows in the call's code space (a row's code is its
/// table's base plus the row), then the total: table_rows summed.
inline std::vector<int64_t> code_bases(const PooledLayout& layout) {
  std::vector<int64_t> bases(layout.table_rows.size() + 1, 0);
  for (size_t t = 0; t < layout.table_rows.size(); ++t) bases[t + 1] = bases[t] + layout.table_rows[t];
  return bases;
}

/// Message of the error for a bad row: not -1 and not in its table.
inline std::string pooled_row_message(const char* op, int64_t position, int64_t row, int64_t table,
                                      int64_t num_rows) {
  return message(op, ": rows[", position, "] is ", row, " but its table (", table, ") has ", num_rows,
                 " rows; a row must lie in [0, rows) or be -1 (a missing key)");
}

/// Message of the error for offsets that are not CSR bounds of the values.
inline std::string pooled_offsets_message(const char* op, int64_t bag, int64_t begin, int64_t end, int64_t nnz) {
  return message(op, ": offsets must rise from 0 to nnz = ", nnz, " without decreasing; bag ", bag, " spans [",
                 begin, ", ", end, ")");
}

/// The scalars of one fused update of a table, in the precision of its arithmetic.
struct FusedScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
};

inline FusedScalars check_fused_hyper(const char* op, FusedOptimizer optimizer, const std::vector<double>& hyper) {
  SK_CHECK(hyper.size() == 5, op, ": hyper must hold (lr, beta1, beta2, eps, weight_decay), got ", hyper.size(),
           " values");
  FusedScalars s{hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]};
  SK_CHECK(s.lr >= 0.0, op, ": lr must be >= 0, got ", s.lr);
  SK_CHECK(s.eps >= 0.0, op, ": eps must be >= 0, got ", s.eps);
  SK_CHECK(s.weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", s.weight_decay);
  if (optimizer == FusedOptimizer::kLazyAdam) {
    SK_CHECK(s.beta1 >= 0.0 && s.beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", s.beta1);
    SK_CHECK(s.beta2 >= 0.0 && s.beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", s.beta2);
  }
  return s;
}

/// @brief Checks the optimizer state of pooled_read_update_ against the weights: LazyAdam
/// keeps two moments of each weight's shape, Adagrad one sum of each weight's shape,
/// row-wise Adagrad one float per row, SGD none;
/// float32, or float64 for float64 weights; contiguous and on the weights' device.
inline void check_fused_state(const char* op, FusedOptimizer optimizer, const std::vector<Tensor>& weights,
                              const std::vector<Tensor>& state1, const std::vector<Tensor>& state2,
                              const std::vector<Tensor>& steps) {
  const size_t num_tables = weights.size();
  const size_t want1 = optimizer == FusedOptimizer::kSgd ? 0 : num_tables;
  const size_t want2 = optimizer == FusedOptimizer::kLazyAdam ? num_tables : 0;
  SK_CHECK(state1.size() == want1 && state2.size() == want2, op, ": this optimizer keeps ", want1, " and ", want2,
           " state tensors (one per table), got ", state1.size(), " and ", state2.size());
  const ScalarType state_dtype = weights[0].scalar_type() == kDouble ? kDouble : kFloat;
  for (size_t t = 0; t < num_tables; ++t) {
    SK_CHECK(weights[t].is_contiguous(), op, ": weights[", t, "] must be contiguous (it is updated in place)");
    for (const std::vector<Tensor>* states : {&state1, &state2}) {
      if (states->empty()) continue;
      const Tensor& s = (*states)[t];
      const bool per_row = optimizer == FusedOptimizer::kRowWiseAdagrad;
      const bool shape_ok = per_row ? (s.dim() == 1 && s.size(0) == weights[t].size(0))
                                    : s.sizes().equals(weights[t].sizes());
      SK_CHECK(shape_ok, op, ": the state of table ", t, " must be ", per_row ? "[rows]" : "[rows, dim]",
               " like its weight ", weights[t].sizes(), ", got ", s.sizes());
      SK_CHECK(s.scalar_type() == state_dtype && s.is_contiguous() && s.device() == weights[t].device(), op,
               ": the state of table ", t, " must be a contiguous ", state_dtype, " tensor on ", weights[t].device(),
               ", got ", s.scalar_type(), " on ", s.device());
    }
  }
  const size_t want_steps = optimizer == FusedOptimizer::kLazyAdam ? num_tables : 0;
  SK_CHECK(steps.size() == want_steps, op, ": this optimizer counts steps in ", want_steps,
           " tensors (one per table), got ", steps.size());
  for (size_t t = 0; t < steps.size(); ++t) {
    SK_CHECK(steps[t].scalar_type() == kLong && steps[t].numel() == 1 && steps[t].device() == weights[t].device(),
             op, ": steps[", t, "] must be an int64 tensor of one element on ", weights[t].device(), ", got ",
             steps[t].scalar_type(), " of shape ", steps[t].sizes(), " on ", steps[t].device());
  }
}

/// pooled_read_update_'s arguments once checked: the optimizer, the layout, each feature's
/// output gradient (a view of the block with grad_columns) and the scalars.
struct FusedUpdateArgs {
  FusedOptimizer optimizer;
  PooledLayout layout;
  std::vector<Tensor> grads;
  FusedScalars h;
};

/// @brief Every check of pooled_read_update_ that its CPU and CUDA kernels share, made before
/// either writes anything: the layout, the gradients, the scalars, the state, the error
/// slots, a tensor `lr` (one float32 / float64 element on the weights' device) and that no
/// tensor the update writes shares memory with another of the call.
inline FusedUpdateArgs check_fused_update_args(
    const char* op, const std::vector<Tensor>& weights, const std::vector<Tensor>& state1,
    const std::vector<Tensor>& state2, const std::vector<Tensor>& steps, const std::vector<Tensor>& grads_in,
    const Tensor& rows, const Tensor& offsets, const std::optional<Tensor>& per_sample_weights,
    const std::vector<int64_t>& feature_tables, const std::vector<int64_t>& feature_means,
    const std::string& optimizer_name, const std::vector<double>& hyper, const std::optional<Tensor>& lr,
    const std::optional<Tensor>& errors, const std::vector<int64_t>& grad_columns) {
  const FusedOptimizer optimizer = parse_fused_optimizer(optimizer_name);
  PooledLayout layout =
      check_pooled_backward_args(op, weights, rows, offsets, per_sample_weights, feature_tables, feature_means);
  const Device device = weights[0].device();
  std::vector<Tensor> grads = feature_grad_views(op, grads_in, grad_columns, layout);
  check_pooled_grads(op, grads, layout, device);
  const FusedScalars h = check_fused_hyper(op, optimizer, hyper);
  check_fused_state(op, optimizer, weights, state1, state2, steps);
  check_error_slots(op, errors, device);
  if (lr.has_value()) {
    SK_CHECK(lr->numel() == 1 && (lr->scalar_type() == kFloat || lr->scalar_type() == kDouble) &&
                 lr->device() == device,
             op, ": lr must be a float32 or float64 tensor of one element on ", device, ", got ", lr->scalar_type(),
             " of shape ", lr->sizes(), " on ", lr->device());
  }
  std::vector<TensorUse> uses;
  for (size_t t = 0; t < weights.size(); ++t) uses.push_back({&weights[t], "weights", t, true});
  for (size_t t = 0; t < state1.size(); ++t) uses.push_back({&state1[t], "state1", t, true});
  for (size_t t = 0; t < state2.size(); ++t) uses.push_back({&state2[t], "state2", t, true});
  for (size_t t = 0; t < steps.size(); ++t) uses.push_back({&steps[t], "steps", t, true});
  for (size_t f = 0; f < grads.size(); ++f) {
    if (layout.feature_tables[f] >= 0) uses.push_back({&grads[f], "grads", f, false});
  }
  uses.push_back({&rows, "rows", 0, false});
  uses.push_back({&offsets, "offsets", 0, false});
  if (per_sample_weights.has_value()) uses.push_back({&*per_sample_weights, "per_sample_weights", 0, false});
  if (errors.has_value()) uses.push_back({&*errors, "errors", 0, true});
  check_no_shared_writes(op, uses);
  return {optimizer, std::move(layout), std::move(grads), h};
}

}  // namespace sparsekit
