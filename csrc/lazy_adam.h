#pragma once
// Argument checks and scalar set-up shared by the CPU and CUDA lazy_adam_ kernels.
#include <cmath>
#include <string>
#include <vector>

#include "common.h"

namespace sparsekit {

/// @brief The update reads rows and grad and writes weight and both moments row by row:
/// memory shared by a written tensor and any other (exp_avg passed as weight, grad a view of
/// weight) would be read after it was written, a silently wrong step; a row index
/// overwritten by the update would send the next update anywhere (out of bounds: a crash).
inline void check_lazy_adam_disjoint(const char* op, const Tensor& weight, const Tensor& exp_avg,
                                     const Tensor& exp_avg_sq, const Tensor& rows, const Tensor& grad) {
  const Tensor* named[] = {&weight, &exp_avg, &exp_avg_sq, &grad, &rows};
  const char* names[] = {"weight", "exp_avg", "exp_avg_sq", "grad", "rows"};
  for (int i = 0; i < 3; ++i) {  // each written tensor against every other tensor
    for (int j = i + 1; j < 5; ++j) {
      SK_CHECK(!memory_overlaps(*named[i], *named[j]), op, ": ", names[i], " and ", names[j],
               " share memory; each must be a tensor of its own (the update writes weight and the moments "
               "in place while it reads rows and grad)");
    }
  }
}

/// @brief Checks everything about a lazy_adam_ call that does not need to read rows.
/// @param op how errors name the call: lazy_adam_, or a table of lazy_adam_tables_.
inline void check_lazy_adam_args(const Tensor& weight, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                                 const Tensor& rows, const Tensor& grad, int64_t step, double lr,
                                 double beta1, double beta2, double eps, double weight_decay,
                                 OpName op = "lazy_adam_") {
  const auto dtype = weight.scalar_type();
  SK_CHECK(dtype == kFloat || dtype == kDouble || dtype == kHalf || dtype == kBFloat16,
              op, ": weight must be float32, float64, float16 or bfloat16, got ", dtype);
  SK_CHECK(weight.dim() >= 1, op, ": weight must have at least one dimension [R, ...], got a scalar");
  SK_CHECK(same_sizes(exp_avg.sizes(), weight.sizes()) && same_sizes(exp_avg_sq.sizes(), weight.sizes()),
              op, ": exp_avg ", exp_avg.sizes(), " and exp_avg_sq ", exp_avg_sq.sizes(),
              " must have the shape of weight ", weight.sizes());
  SK_CHECK(exp_avg.scalar_type() == dtype && exp_avg_sq.scalar_type() == dtype && grad.scalar_type() == dtype,
              op, ": exp_avg (", exp_avg.scalar_type(), "), exp_avg_sq (", exp_avg_sq.scalar_type(),
              ") and grad (", grad.scalar_type(), ") must have the dtype of weight (", dtype, ")");
  SK_CHECK(weight.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous(),
              op, ": weight, exp_avg and exp_avg_sq must be contiguous (they are updated in place, "
              "so a .contiguous() copy would not do); allocate the optimizer state with torch.zeros_like");
  check_index_tensor(rows, op, "rows");
  SK_CHECK(rows.dim() == 1, op, ": rows must be 1-D [u], got shape ", rows.sizes());
  if (!(grad.dim() == weight.dim() && grad.size(0) == rows.size(0) &&
        same_sizes(grad.sizes().slice(1), weight.sizes().slice(1)))) {
    std::vector<int64_t> expected = weight.sizes().vec();
    expected[0] = rows.size(0);
    fail(op, ": grad must have shape [u, ...] = ", IntArrayRef(expected),
         " (one row of gradient per entry of rows), got ", grad.sizes());
  }
  const auto device = weight.device();
  SK_CHECK(exp_avg.device() == device && exp_avg_sq.device() == device && rows.device() == device &&
                  grad.device() == device,
              op, ": weight, exp_avg, exp_avg_sq, rows and grad must be on one device (weight is on ", device,
              ")");
  SK_CHECK(step >= 1, op, ": step must be >= 1 (the first update is step 1), got ", step);
  SK_CHECK(lr >= 0.0, op, ": lr must be >= 0, got ", lr);
  SK_CHECK(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  SK_CHECK(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  SK_CHECK(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  SK_CHECK(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
}

/// @brief The bias-corrected step size lr * sqrt(1 - beta2^step) / (1 - beta1^step),
/// computed in double exactly as torch.optim.SparseAdam computes it in Python.
inline double lazy_adam_step_size(int64_t step, double lr, double beta1, double beta2) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return lr * std::sqrt(bias_correction2) / bias_correction1;
}

// Scalars in the compute type, converted once per call. For float and double the update
// is computed in the parameter dtype, operation by operation as torch.optim.SparseAdam
// does (m += (1 - beta1) * (g - m), ...), so results match it bit for bit; float16 and
// bfloat16 compute in float32 and round once per stored value.
template <typename opmath_t>
struct AdamScalars {
  opmath_t one_minus_beta1;
  opmath_t one_minus_beta2;
  opmath_t eps;
  opmath_t weight_decay;
  opmath_t neg_step_size;

  static AdamScalars make(double step_size, double beta1, double beta2, double eps, double weight_decay) {
    return {static_cast<opmath_t>(1.0 - beta1), static_cast<opmath_t>(1.0 - beta2), static_cast<opmath_t>(eps),
            static_cast<opmath_t>(weight_decay), static_cast<opmath_t>(-step_size)};
  }
};

/// Message of the error raised for a row outside [0, R).
inline std::string lazy_adam_row_range_message(int64_t bad_row, int64_t num_rows) {
  return "lazy_adam_: rows holds " + std::to_string(bad_row) + ", outside [0, " + std::to_string(num_rows) +
         ") (the rows of weight); nothing was updated. Pass row indices of weight, not keys";
}

/// Message of the error raised for a row that rows holds more than once.
inline std::string lazy_adam_repeated_row_message(int64_t row) {
  return "lazy_adam_: rows holds row " + std::to_string(row) +
         " more than once; rows must be distinct (sum the gradient rows of a row first, as sk.LazyAdam does); "
         "nothing was updated";
}

}  // namespace sparsekit
