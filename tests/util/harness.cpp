#include "util/harness.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backend/cpu/gemm.h"

namespace oomless::test {

namespace {
// A run of the tests on one GEMM path (OOMLESS_ISA: the isa_* entries of CMakeLists.txt) that this CPU does
// not have is skipped as a whole: exit code 77, which ctest reports as skipped. So is one on the path the
// default run takes already (the best the CPU has) when OOMLESS_ISA_SKIP_BEST=1 (set by those entries).
const bool kIsaChecked = [] {
  const char* env = std::getenv("OOMLESS_ISA");
  if (!env || !*env) return true;
  GemmIsa isa;
  try {
    isa = parse_gemm_isa(env);
  } catch (const std::exception&) {
    return true;  // an unknown name: the first product reports it
  }
  if (!gemm_isa_supported(isa)) {
    std::fprintf(stderr, "OOMLESS_ISA=%s: this CPU has no such GEMM path; skipped\n", env);
    std::_Exit(77);
  }
  const char* skip_best = std::getenv("OOMLESS_ISA_SKIP_BEST");
  if (isa == supported_gemm_isas().back() && skip_best && std::strcmp(skip_best, "1") == 0) {
    std::fprintf(stderr, "OOMLESS_ISA=%s: the default run takes this path already (the best this CPU has); "
                 "skipped\n", env);
    std::_Exit(77);
  }
  return true;
}();

constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xA5;
}  // namespace

HostTensor::HostTensor(DType t, std::initializer_list<int64_t> shape)
    : HostTensor(t, std::vector<int64_t>(shape)) {}

HostTensor::HostTensor(DType t, const std::vector<int64_t>& shape) : shape_(shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  size_t bytes = static_cast<size_t>(dtype_bytes(t, n));
  storage_.assign(bytes + 2 * kGuard + 64, 0);
  // Align the payload to 64 bytes so vector kernels see what arenas give them.
  uintptr_t base = reinterpret_cast<uintptr_t>(storage_.data()) + kGuard;
  uintptr_t aligned = (base + 63) & ~uintptr_t(63);
  size_t off = aligned - reinterpret_cast<uintptr_t>(storage_.data());
  std::memset(storage_.data(), kGuardByte, off);
  std::memset(storage_.data() + off + bytes, kGuardByte, storage_.size() - off - bytes);
  view_.data = storage_.data() + off;
  view_.dtype = t;
  view_.ndim = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) view_.dims[i] = shape[i];
}

HostTensor::HostTensor(const HostTensor& o) : storage_(o.storage_), shape_(o.shape_), view_(o.view_) {
  if (!storage_.empty())
    view_.data = storage_.data() + (static_cast<const uint8_t*>(o.view_.data) - o.storage_.data());
}

HostTensor& HostTensor::operator=(const HostTensor& o) {
  if (this != &o) *this = HostTensor(o);
  return *this;
}

bool HostTensor::guards_intact() const {
  if (storage_.empty()) return true;
  size_t off = static_cast<const uint8_t*>(view_.data) - storage_.data();
  size_t bytes = static_cast<size_t>(view_.nbytes());
  for (size_t i = 0; i < off; ++i)
    if (storage_[i] != kGuardByte) return false;
  for (size_t i = off + bytes; i < storage_.size(); ++i)
    if (storage_[i] != kGuardByte) return false;
  return true;
}

void HostTensor::set(int64_t i, double v) {
  switch (dtype()) {
    case DType::i32: ptr<int32_t>()[i] = static_cast<int32_t>(v); return;
    case DType::f64: ptr<double>()[i] = v; return;
    default: {
      oomless::convert(static_cast<uint8_t*>(view_.data) + dtype_bytes(dtype(), i), dtype(), &v, DType::f64, 1);
    }
  }
}

double HostTensor::get(int64_t i) const {
  switch (dtype()) {
    case DType::i32: return ptr<int32_t>()[i];
    case DType::f64: return ptr<double>()[i];
    default: {
      float f;
      oomless::convert(&f, DType::f32, static_cast<const uint8_t*>(view_.data) + dtype_bytes(dtype(), i), dtype(), 1);
      return f;
    }
  }
}

void HostTensor::randn(std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> d(0.0, stddev);
  for (int64_t i = 0; i < numel(); ++i) set(i, d(rng));
}

void HostTensor::uniform(std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (int64_t i = 0; i < numel(); ++i) set(i, d(rng));
}

void HostTensor::randint(std::mt19937_64& rng, int32_t lo, int32_t hi_exclusive) {
  std::uniform_int_distribution<int32_t> d(lo, hi_exclusive - 1);
  for (int64_t i = 0; i < numel(); ++i) ptr<int32_t>()[i] = d(rng);
}

void HostTensor::fill(double v) {
  for (int64_t i = 0; i < numel(); ++i) set(i, v);
}

std::vector<double> HostTensor::to_f64() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

HostTensor HostTensor::as(DType t) const {
  HostTensor out(t, shape_);
  for (int64_t i = 0; i < numel(); ++i) out.set(i, get(i));
  if (t == DType::f64 && dtype() != DType::i32) {
    // widen exactly
    for (int64_t i = 0; i < numel(); ++i) out.ptr<double>()[i] = get(i);
  }
  return out;
}

double rel_l2(const HostTensor& got, const HostTensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double g = got.get(i), r = ref.get(i);
    num += (g - r) * (g - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

namespace {
Ops& host_io() {
  static const std::unique_ptr<Ops> ops = make_ops("cpu");
  return *ops;
}
}  // namespace

void read_tensor(const Tensor& t, const std::function<void(const void*)>& read) { host_io().read_host(t, read); }
void write_tensor(const Tensor& t, const std::function<void(void*)>& write) { host_io().write_host(t, write); }

Tensor arena_copy(Arena& arena, std::vector<Buffer>& keep, const void* host, DType dt,
                  std::initializer_list<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  keep.push_back(arena.alloc(static_cast<size_t>(std::max<int64_t>(1, dtype_bytes(dt, n))), Category::workspace,
                             "test data"));
  Tensor t(keep.back().data(), dt, shape, keep.back().tier());
  if (host) write_tensor(t, [&](void* h) { std::memcpy(h, host, static_cast<size_t>(dtype_bytes(dt, n))); });
  return t;
}

std::vector<double> tensor_f64(const Tensor& t) {
  std::vector<double> v(static_cast<size_t>(t.numel()));
  read_tensor(t, [&](const void* h) { convert(v.data(), DType::f64, h, t.dtype, t.numel()); });
  return v;
}

std::vector<double> golden_f64(const SafetensorsFile& f, const std::string& name) {
  const StTensor* t = f.find(name);
  OOM_CHECK(t && t->dtype, "golden tensor ", name, " missing");
  std::vector<double> v(static_cast<size_t>(t->numel()));
  convert(v.data(), DType::f64, t->data, *t->dtype, t->numel());
  return v;
}

bool all_finite(const HostTensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(t.get(i))) return false;
  return true;
}

double eps_of(DType t) {
  switch (t) {
    case DType::f64: return std::ldexp(1.0, -53);
    case DType::f32: return std::ldexp(1.0, -24);
    case DType::bf16: return std::ldexp(1.0, -8);
    case DType::f16: return std::ldexp(1.0, -11);
    default: return std::ldexp(1.0, -3);
  }
}

double tol_for(DType compute) {
  switch (compute) {
    case DType::f64: return 1e-12;
    case DType::f32: return 2e-5;
    case DType::bf16: return 2e-2;
    case DType::f16: return 4e-3;
    default: return 0.2;
  }
}

void expect_close(const HostTensor& got, const HostTensor& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  EXPECT_TRUE(all_finite(got)) << what << ": non-finite output";
  EXPECT_TRUE(got.guards_intact()) << what << ": wrote outside its buffer";
  double e = rel_l2(got, ref);
  EXPECT_LE(e, tol) << what << ": relative L2 error " << e << " > " << tol;
}

void expect_within_bound(const HostTensor& got, const HostTensor& ref, const HostTensor& bound, double eps, int64_t K,
                         double c, const std::string& what) {
  ASSERT_EQ(got.numel(), ref.numel()) << what;
  EXPECT_TRUE(got.guards_intact()) << what << ": wrote outside its buffer";
  double lim_scale = c * eps * std::sqrt(static_cast<double>(K > 0 ? K : 1));
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double g = got.get(i), r = ref.get(i);
    double lim = lim_scale * bound.get(i) + 1e-30;
    if (!(std::fabs(g - r) <= lim)) {
      if (first < 0) first = i;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements past c*eps*sqrt(K)*sum|a||b|; first at " << first
                    << " got " << (first >= 0 ? got.get(first) : 0) << " ref " << (first >= 0 ? ref.get(first) : 0);
}

std::vector<std::string> backends_under_test() { return {"cpu"}; }

std::string source_path(const std::string& rel) {
  if (const char* env = std::getenv("OOMLESS_SOURCE_DIR")) return std::string(env) + "/" + rel;
  const std::string here = __FILE__;  // SOURCE/tests/util/harness.cpp (relative when compiled so)
  const std::string self = "tests/util/harness.cpp";
  std::string root = here.size() >= self.size() ? here.substr(0, here.size() - self.size()) : "";
  return (root.empty() ? "./" : root) + rel;
}

}  // namespace oomless::test
