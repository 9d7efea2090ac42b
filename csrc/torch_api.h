#pragma once
// sparsekit's one view of torch: the stable ABI (torch/csrc/stable, torch/headeronly) and
// nothing else, so one binary serves every torch from TORCH_TARGET_VERSION on (set by
// setup.py). What the stable ops lack is called by name through the dispatcher
// (call_op), itself part of the stable ABI. Every kernel file includes this header, never
// an ATen or c10 one; tests/test_build.py checks it.
#include <dlfcn.h>
#include <sys/sysinfo.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

namespace sparsekit {

using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using ScalarType = torch::headeronly::ScalarType;
using IntArrayRef = torch::headeronly::IntHeaderOnlyArrayRef;
using Half = c10::Half;
using BFloat16 = c10::BFloat16;

constexpr ScalarType kBool = ScalarType::Bool;
constexpr ScalarType kByte = ScalarType::Byte;
constexpr ScalarType kChar = ScalarType::Char;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;

// ---------------------------------------------------------------------------------------
// Errors: a std::runtime_error with exactly the message given (torch raises it in Python
// as a RuntimeError), built from any streamable values, devices, shapes and dtypes.

/// How an error names its call: the op, and for one table of a multi-table op the table
/// ("lazy_adam_tables_: table 3"). Printed only when an error is raised, so a check that
/// takes one costs nothing when it passes (a per-table message built up front would be
/// formatted on every call). A plain op name converts to it.
struct OpName {
  const char* op;
  int64_t table = -1;
  OpName(const char* op_) : op(op_) {}  // NOLINT(google-explicit-constructor): every op name is one
  OpName(const char* op_, int64_t table_) : op(op_), table(table_) {}
};

namespace detail {
inline void append(std::ostringstream& out, const OpName& name) {
  out << name.op;
  if (name.table >= 0) out << ": table " << name.table;
}
inline void append(std::ostringstream& out, const Device& device) {
  out << (device.is_cuda() ? "cuda" : device.is_cpu() ? "cpu" : "device");
  if (device.is_cuda() && device.has_index()) out << ":" << static_cast<int>(device.index());
}
inline void append(std::ostringstream& out, IntArrayRef shape) {
  out << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "]";
}
inline void append(std::ostringstream& out, ScalarType dtype) { out << torch::headeronly::toString(dtype); }
template <typename T>
void append(std::ostringstream& out, const T& value) {
  out << value;
}
}  // namespace detail

/// @brief The concatenation of the values' printed forms.
template <typename... Args>
std::string message(const Args&... args) {
  std::ostringstream out;
  (detail::append(out, args), ...);
  return out.str();
}

/// @brief Raises a RuntimeError in Python with the message message(args...).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw std::runtime_error(message(args...));
}

#define SK_CHECK(cond, ...)                                     \
  do {                                                          \
    if (C10_UNLIKELY(!(cond))) ::sparsekit::fail(__VA_ARGS__);  \
  } while (0)

/// @brief make() (an allocation sized by an argument), its failure turned into an error that
/// names the argument: "op: what cannot be allocated (...)" instead of the allocator's own.
template <typename F>
auto allocate_or_fail(const char* op, const std::string& what, F&& make) -> decltype(make()) {
  try {
    return make();
  } catch (const std::exception& error) {
    fail(op, ": ", what, " cannot be allocated (", error.what(), "); choose a smaller value");
  }
}

/// @brief This machine's memory and swap in bytes (0 where unknown). A host allocation larger
/// can never be filled: where Linux overcommits (vm.overcommit_memory=1, as on many GPU
/// servers) malloc grants it anyway, and the first pass that writes it gets the process
/// killed instead of raising.
inline double host_memory_bytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return 0.0;
  return (static_cast<double>(info.totalram) + static_cast<double>(info.totalswap)) * info.mem_unit;
}

/// @brief The bytes of one element of `dtype` (the dtypes the ops produce; 1 for others).
inline int64_t element_size(ScalarType dtype) {
  if (dtype == kDouble || dtype == kLong) return 8;
  if (dtype == kFloat || dtype == kInt) return 4;
  if (dtype == kHalf || dtype == kBFloat16) return 2;
  return 1;
}

/// @brief "N bytes (X.Y GiB)" for an error message, N exact below 2^53.
inline std::string format_bytes(double bytes) {
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double size = bytes;
  int unit = -1;
  while (unit < 5 && (unit < 0 || size >= 1024)) {
    size /= 1024;
    ++unit;
  }
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(0);
  out << bytes << " bytes (";
  out.precision(1);
  out << size << " " << units[unit] << ")";
  return out.str();
}

/// @brief Refuses host memory of `bytes` (a double: the product of sizes an argument gave may
/// not fit in 64 bits) that is more than the machine's memory and swap, naming `what`.
inline void check_host_fits(const char* op, const std::string& what, double bytes) {
  const double limit = host_memory_bytes();
  if (limit > 0 && bytes > limit) {
    fail(op, ": ", what, " cannot be allocated (", format_bytes(bytes), ", more than this machine's ",
         format_bytes(limit), " of memory and swap); choose a smaller value");
  }
}

/// @brief allocate_or_fail for a host allocation of `bytes`: one larger than the machine's
/// memory and swap is refused before it is tried (check_host_fits).
template <typename F>
auto allocate_host_or_fail(const char* op, const std::string& what, double bytes, F&& make) -> decltype(make()) {
  check_host_fits(op, what, bytes);
  return allocate_or_fail(op, what, std::forward<F>(make));
}

// ---------------------------------------------------------------------------------------
// Dtype dispatch: runs the lambda with index_t (int32/int64) or scalar_t (float, double,
// Half, BFloat16) bound to the tensor's element type and returns what it returns.

#define SK_DISPATCH_CASE(ENUM, TYPE, ALIAS, ...) \
  case ENUM: {                                   \
    using ALIAS = TYPE;                          \
    return __VA_ARGS__();                        \
  }

#define SK_DISPATCH_INDEX_TYPES(TYPE, NAME, ...)                                         \
  [&] {                                                                                  \
    const ::sparsekit::ScalarType sk_dispatch_type = (TYPE);                             \
    switch (sk_dispatch_type) {                                                          \
      SK_DISPATCH_CASE(::sparsekit::kInt, int32_t, index_t, __VA_ARGS__)                 \
      SK_DISPATCH_CASE(::sparsekit::kLong, int64_t, index_t, __VA_ARGS__)                \
      default:                                                                           \
        ::sparsekit::fail(NAME, ": expected an int32 or int64 tensor, got ", sk_dispatch_type); \
    }                                                                                    \
  }()

#define SK_DISPATCH_FLOATING_TYPES(TYPE, NAME, ...)                                            \
  [&] {                                                                                        \
    const ::sparsekit::ScalarType sk_dispatch_type = (TYPE);                                   \
    switch (sk_dispatch_type) {                                                                \
      SK_DISPATCH_CASE(::sparsekit::kFloat, float, scalar_t, __VA_ARGS__)                      \
      SK_DISPATCH_CASE(::sparsekit::kDouble, double, scalar_t, __VA_ARGS__)                    \
      SK_DISPATCH_CASE(::sparsekit::kHalf, ::sparsekit::Half, scalar_t, __VA_ARGS__)           \
      SK_DISPATCH_CASE(::sparsekit::kBFloat16, ::sparsekit::BFloat16, scalar_t, __VA_ARGS__)   \
      default:                                                                                 \
        ::sparsekit::fail(NAME, ": expected a float32, float64, float16 or bfloat16 tensor, got ", \
                          sk_dispatch_type);                                                   \
    }                                                                                          \
  }()

/// The type arithmetic on T runs in: float for the 16-bit floats, T otherwise.
template <typename T>
struct AccumulateTypeOf {
  using type = T;
};
template <>
struct AccumulateTypeOf<Half> {
  using type = float;
};
template <>
struct AccumulateTypeOf<BFloat16> {
  using type = float;
};
template <typename T>
using acc_type = typename AccumulateTypeOf<T>::type;

/// The ScalarType of a C++ element type.
template <typename T>
constexpr ScalarType scalar_type_of() {
  if constexpr (std::is_same_v<T, float>) return kFloat;
  else if constexpr (std::is_same_v<T, double>) return kDouble;
  else if constexpr (std::is_same_v<T, Half>) return kHalf;
  else if constexpr (std::is_same_v<T, BFloat16>) return kBFloat16;
  else if constexpr (std::is_same_v<T, int64_t>) return kLong;
  else if constexpr (std::is_same_v<T, int32_t>) return kInt;
  else if constexpr (std::is_same_v<T, int8_t>) return kChar;
  else if constexpr (std::is_same_v<T, uint8_t>) return kByte;
  else if constexpr (std::is_same_v<T, bool>) return kBool;
  else static_assert(!std::is_same_v<T, T>, "scalar_type_of: unsupported element type");
}

inline bool is_floating(ScalarType dtype) {
  return dtype == kFloat || dtype == kDouble || dtype == kHalf || dtype == kBFloat16;
}

// ---------------------------------------------------------------------------------------
// Tensors: creation, and the few ATen ops the kernels use, on the stable ABI. The stable
// ops themselves (torch::stable::clone, view, narrow, copy_, fill_, zero_,
// sum, to, new_empty, new_zeros) are found unqualified through the Tensor argument.

/// @brief The message of the last error torch's C shim turned into an error code on this
/// thread, or `fallback`. torch 2.13 added the query
/// (torch_exception_get_what_without_backtrace); the library targets 2.10, so it is looked
/// up when the library runs and used where the running torch has it.
inline std::string last_torch_error(const char* fallback) {
  using Query = const char* (*)();
  static const Query query =
      reinterpret_cast<Query>(dlsym(RTLD_DEFAULT, "torch_exception_get_what_without_backtrace"));
  const char* what = query ? query() : nullptr;
  return what && *what ? std::string(what) : std::string(fallback);
}

/// @brief Any ATen op by name through the dispatcher; returns its first (Tensor) output.
template <typename... Args>
Tensor call_op(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, std::max<size_t>(sizeof...(Args), 1)> stack{torch::stable::detail::from(args)...};
  if (torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION) != TORCH_SUCCESS) {
    fail(name, " failed: ", last_torch_error("(this torch does not say why)"));
  }
  return torch::stable::detail::to<Tensor>(stack[0]);
}

/// @brief Any ATen (or sparsekit) op by name through the dispatcher; returns its first N
/// (Tensor) outputs.
template <size_t N, typename... Args>
std::array<Tensor, N> call_op_outputs(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, std::max<size_t>(std::max(sizeof...(Args), N), 1)> stack{
      torch::stable::detail::from(args)...};
  if (torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION) != TORCH_SUCCESS) {
    fail(name, " failed: ", last_torch_error("(this torch does not say why)"));
  }
  std::array<Tensor, N> out;
  for (size_t i = 0; i < N; ++i) out[i] = torch::stable::detail::to<Tensor>(stack[i]);
  return out;
}

/// @brief An uninitialised tensor; a failed allocation raises with torch's reason (its
/// allocator's "can't allocate memory" / "out of memory", which sparsekit/_checks.py turns
/// into an error naming the argument that sized the tensor).
/// Allocation goes straight to the C shim's aoti_torch_empty_strided, not through the
/// dispatcher by name (torch::stable::empty), a cost the layers pay dozens of times a step.
inline Tensor empty(IntArrayRef sizes, ScalarType dtype, const Device& device) {
  const size_t ndim = sizes.size();
  std::array<int64_t, 8> small_strides{};
  std::vector<int64_t> large_strides(ndim > small_strides.size() ? ndim : 0);
  int64_t* strides = ndim > small_strides.size() ? large_strides.data() : small_strides.data();
  int64_t stride = 1;
  for (size_t d = ndim; d-- > 0;) {
    strides[d] = stride;
    stride *= std::max<int64_t>(sizes[d], 1);
  }
  const int32_t shim_dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(dtype));
  const int32_t shim_device = torch::stable::detail::to<int32_t>(torch::stable::detail::from(device.type()));
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided(static_cast<int64_t>(ndim), sizes.data(), strides, shim_dtype, shim_device,
                               device.has_index() ? device.index() : 0, &handle) != AOTI_TORCH_SUCCESS) {
    fail("cannot allocate a ", sizes, " ", dtype, " tensor on ", device, ": ",
         last_torch_error("out of memory (this torch does not say why)"));
  }
  return Tensor(handle);
}

inline Tensor zeros(IntArrayRef sizes, ScalarType dtype, const Device& device) {
  Tensor out = empty(sizes, dtype, device);
  if (out.is_cpu()) {
    std::memset(out.mutable_data_ptr(), 0, static_cast<size_t>(out.numel()) * out.element_size());
  } else {
    torch::stable::zero_(out);
  }
  return out;
}

/// @brief A contiguous copy of t as dtype. One that cannot be allocated raises "a
/// contiguous copy of an input: cannot allocate a [shape] dtype tensor on device: <torch's
/// reason>" (torch::stable::contiguous / to say only "API call failed at ops.h");
/// sparsekit/_checks.py passes it on as it is, since no argument of the op's sized it.
inline Tensor contiguous_copy(const Tensor& t, ScalarType dtype) {
  Tensor out = [&] {
    try {
      return empty(t.sizes(), dtype, t.device());
    } catch (const std::exception& error) {
      fail("a contiguous copy of an input: ", error.what());
    }
  }();
  call_op("aten::copy_", "", out, t, false);
  return out;
}

/// @brief t itself when contiguous (no dispatcher round trip), else a contiguous copy.
inline Tensor as_contiguous(const Tensor& t) { return t.is_contiguous() ? t : contiguous_copy(t, t.scalar_type()); }

inline Tensor to_dtype(const Tensor& t, ScalarType dtype) {
  return t.scalar_type() == dtype ? t : contiguous_copy(t, dtype);
}

inline Tensor cpu(const Tensor& t) {
  return t.is_cpu() ? t : torch::stable::to(t, Device(torch::headeronly::DeviceType::CPU));
}

/// @brief t[start:end] along dim 0 (a view).
inline Tensor slice0(const Tensor& t, int64_t start, int64_t end) {
  return torch::stable::narrow(const_cast<Tensor&>(t), 0, start, end - start);
}

inline Tensor cumsum(const Tensor& t, int64_t dim, std::optional<ScalarType> dtype = std::nullopt) {
  return call_op("aten::cumsum", "", t, dim, dtype);
}

inline Tensor nonzero_1d(const Tensor& t) { return torch::stable::view(call_op("aten::nonzero", "", t), {-1}); }

/// @brief The sum of an integer or boolean tensor, on the host (a sync on CUDA).
inline int64_t sum_to_host(const Tensor& t) {
  const Tensor total = cpu(torch::stable::sum(t, std::nullopt, false, kLong));
  return *total.const_data_ptr<int64_t>();
}

/// @brief The element i of an integer tensor in flat order, as int64 on the host (a sync
/// on CUDA).
inline int64_t item_at(const Tensor& t, int64_t i) {
  const Tensor flat = t.dim() == 1 ? t : torch::stable::reshape(t, {-1});
  return *to_dtype(cpu(slice0(flat, i, i + 1)), kLong).const_data_ptr<int64_t>();
}

/// @brief 0, 1, ..., n-1 as int64 on the CPU (csrc/cuda/cuda_api.h has the CUDA twin).
inline Tensor arange_cpu(int64_t n) {
  Tensor out = empty({n}, kLong, Device(torch::headeronly::DeviceType::CPU));
  int64_t* ptr = out.mutable_data_ptr<int64_t>();
  torch::stable::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ptr[i] = i;
  });
  return out;
}

inline bool same_shape(const Tensor& a, const Tensor& b) { return a.sizes().equals(b.sizes()); }

/// @brief Whether two shapes are equal (torch 2.10's IntHeaderOnlyArrayRef has no operator==).
inline bool same_sizes(IntArrayRef a, IntArrayRef b) { return a.equals(b); }

/// @brief A `str` argument of a kernel registered with TORCH_BOX (embedding_bag's mode).
/// torch's own unboxing to std::string leaks a `new std::string` per call
/// (pytorch/pytorch#191340), which can pin glibc's heap top so that large outputs are never
/// reused. This type's conversion (below) copies the string and frees torch's.
struct StrArg {
  std::string value;
};

}  // namespace sparsekit

// torch 2.10 and 2.11's headers name the shim's error check TORCH_ERROR_CODE_CHECK; newer
// ones STABLE_TORCH_ERROR_CODE_CHECK (the library builds against any torch from 2.10).
#ifndef STABLE_TORCH_ERROR_CODE_CHECK
#define STABLE_TORCH_ERROR_CODE_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

namespace torch::stable::detail {
template <>
struct ToImpl<sparsekit::StrArg> {
  static sparsekit::StrArg call(StableIValue val, [[maybe_unused]] uint64_t extension_build_version,
                                [[maybe_unused]] bool is_internal) {
    StringHandle handle = to<StringHandle>(val);
    size_t length = 0;
    const char* data = nullptr;
    STABLE_TORCH_ERROR_CODE_CHECK(torch_string_length(handle, &length));
    STABLE_TORCH_ERROR_CODE_CHECK(torch_string_c_str(handle, &data));
    sparsekit::StrArg arg{std::string(data, length)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_delete_string(handle));
    return arg;
  }
};
}  // namespace torch::stable::detail
