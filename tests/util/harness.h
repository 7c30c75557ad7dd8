// Test harness shared by every test file: host tensors with guard bytes, random fills, comparison
// against the float64 reference with the per-dtype tolerance table, and the list of built backends.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "core/tensor.h"
#include "memory/arena.h"
#include "io/safetensors.h"

namespace oomless::test {

// Host memory of one dtype surrounded by 64 guard bytes on each side that must survive every op.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType t, std::initializer_list<int64_t> shape);
  HostTensor(DType t, const std::vector<int64_t>& shape);
  // Copies are deep (the view is re-pointed at the copy's storage); moves keep the storage.
  HostTensor(const HostTensor& o);
  HostTensor& operator=(const HostTensor& o);
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;
  Tensor t() const { return view_; }
  operator Tensor() const { return view_; }
  DType dtype() const { return view_.dtype; }
  int64_t numel() const { return view_.numel(); }
  template <class T> T* ptr() const { return static_cast<T*>(view_.data); }
  bool guards_intact() const;

  // Random fills, rounded to the tensor's dtype (so both backends see identical values).
  void randn(std::mt19937_64& rng, double stddev = 1.0);
  void uniform(std::mt19937_64& rng, double lo, double hi);
  void randint(std::mt19937_64& rng, int32_t lo, int32_t hi_exclusive);  // i32 only
  void fill(double v);
  void set(int64_t i, double v);   // element i, rounded to dtype
  double get(int64_t i) const;     // element i as double
  std::vector<double> to_f64() const;
  // A copy converted to another float dtype (exact when widening).
  HostTensor as(DType t) const;
  HostTensor clone() const { return as(dtype()); }

 private:
  std::vector<uint8_t> storage_;
  std::vector<int64_t> shape_;
  Tensor view_;
};

// Relative L2 error ||got - ref|| / ||ref|| (absolute when ||ref|| == 0), in double.
double rel_l2(const HostTensor& got, const HostTensor& ref);
// The same over float64 vectors of one length (e.g. tensor_f64 of a Tensor against golden_f64).
double rel_l2(const std::vector<double>& got, const std::vector<double>& ref);
// A tensor's elements (any float dtype) as float64, read through the backend (engine memory may be Device
// memory, which test code, like any code above backend/, reads only through Ops: see the strict device mode).
std::vector<double> tensor_f64(const Tensor& t);
// An engine tensor's bytes handed to `read`, or host memory handed to `write` that becomes its bytes, through
// the CPU backend's read_host / write_host.
void read_tensor(const Tensor& t, const std::function<void(const void* host)>& read);
void write_tensor(const Tensor& t, const std::function<void(void* host)>& write);
// Its elements as T (T's size must be the dtype's).
template <class T>
std::vector<T> tensor_values(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  read_tensor(t, [&](const void* h) { std::memcpy(v.data(), h, v.size() * sizeof(T)); });
  return v;
}
// Host values as a tensor of `arena` (Device memory when it is the Device arena), for the engine calls that take
// their operands where the kernels run; the buffer is kept in `keep`. Written through write_tensor.
Tensor arena_copy(Arena& arena, std::vector<Buffer>& keep, const void* host, DType dt,
                  std::initializer_list<int64_t> shape);
template <class T>
Tensor arena_copy(Arena& arena, std::vector<Buffer>& keep, const std::vector<T>& host, DType dt,
                  std::initializer_list<int64_t> shape) {
  return arena_copy(arena, keep, static_cast<const void*>(host.data()), dt, shape);
}
// Tensor `name` of a golden file (any float dtype) as float64; throws when it is missing.
std::vector<double> golden_f64(const SafetensorsFile& f, const std::string& name);
// True when every element is finite.
bool all_finite(const HostTensor& t);

// Per-dtype relative tolerance for ops whose output is a few roundings of its inputs' dtype.
double tol_for(DType compute);
// Unit roundoff of a dtype (2^-24 for f32, 2^-8 for bf16, 2^-53 for f64).
double eps_of(DType t);

// EXPECT: finite, guards intact, rel_l2 <= tol. `what` names the op and tensor in the failure.
void expect_close(const HostTensor& got, const HostTensor& ref, double tol, const std::string& what);
// EXPECT elementwise |got - ref| <= c * eps * sqrt(K) * bound (+ tiny absolute floor) for
// matmul-like outputs, where bound = sum |a||b| from RefOps::matmul_magnitude.
void expect_within_bound(const HostTensor& got, const HostTensor& ref, const HostTensor& bound, double eps, int64_t K,
                         double c, const std::string& what);

// Backends to test against ref: "cpu", plus "cuda" when built and a device is present.
std::vector<std::string> backends_under_test();

// A path inside the source tree (goldens, corpus), found from this file's location, or from
// OOMLESS_SOURCE_DIR when set; tests run from the build directory.
std::string source_path(const std::string& rel);

// Whether two CPU paths of one product give the same bits in this build. GCC's build (the Release tree: what
// `make build` gives) fuses a multiply and an add wherever the source has them in sequence, as the kernels
// written with intrinsics do; clang 14 (the sanitizer tree) does not across basic blocks, and there a one-row
// product differs from the blocked kernels' in its last bits (GemmPaths, QuantGemm: measured). Under clang those
// tests compare within fp32 rounding (same_product); every path still runs under the sanitizers.
#if defined(__clang__)
inline constexpr bool kBitwiseAcrossPaths = false;
#else
inline constexpr bool kBitwiseAcrossPaths = true;
#endif

// a and b, n floats: the same bits where kBitwiseAcrossPaths, else each within 1e-5 (1 + |b|) of b.
inline bool same_product(const float* a, const float* b, size_t n) {
  if (kBitwiseAcrossPaths) return std::memcmp(a, b, n * sizeof(float)) == 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(a[i]) - b[i], m = 1e-5 * (1.0 + (b[i] < 0 ? -b[i] : b[i]));
    if (!(d <= m && -d <= m)) return false;
  }
  return true;
}

}  // namespace oomless::test
