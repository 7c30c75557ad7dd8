// Gemm::run (the blocked multi-threaded GEMM) against a float64 product computed here: every transpose
// pair, f32 and bf16 operands, accumulate on and off, sub-matrix views (leading dimensions past the
// packed ones, whose extra columns must not change), odd sizes and sizes that cross every block
// boundary (k slices, column panels, row blocks, 6 x 16 micro tiles). Then bitwise equality of the
// output for 1, 2 and 3 threads.
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>

#include "memory/allocator.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_kernel.h"
#include "memory/arena.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

struct Dims {
  int64_t M, N, K;
};

// (ta, tb, dtype of a and b, kernel path)
using Param = std::tuple<bool, bool, DType, GemmIsa>;

std::string param_name(const testing::TestParamInfo<Param>& info) {
  auto [ta, tb, t, isa] = info.param;
  return std::string(ta ? "t" : "n") + (tb ? "t" : "n") + "_" + dtype_name(t) + "_" + gemm_isa_name(isa);
}

// Runs a scope on one kernel path, then restores the one before.
struct IsaScope {
  explicit IsaScope(GemmIsa isa) : saved(gemm_isa()) { set_gemm_isa(isa); }
  ~IsaScope() { set_gemm_isa(saved); }
  GemmIsa saved;
};

// Runs a scope with the avx512 path's bf16 products in vdpbf16ps pairs or widened (gemm.h), then restores.
struct PairsScope {
  explicit PairsScope(bool pairs) : saved(gemm_bf16_pairs()) { set_gemm_bf16_pairs(pairs); }
  ~PairsScope() { set_gemm_bf16_pairs(saved); }
  bool saved;
};
// The bf16 choices of the avx512 path this CPU can run: both where it has AVX512-BF16, else widened.
std::vector<bool> pair_choices() {
  return bf16_pair_speed() > 0 ? std::vector<bool>{false, true} : std::vector<bool>{false};
}

class GemmRun : public testing::TestWithParam<Param> {
 protected:
  GemmRun() : mem(size_t(1) << 30), gemm(mem.device) {}
  void SetUp() override {
    const GemmIsa isa = std::get<3>(GetParam());
    if (!gemm_isa_supported(isa)) GTEST_SKIP() << "this CPU has no " << gemm_isa_name(isa) << " path";
    scope = std::make_unique<IsaScope>(isa);
  }
  void TearDown() override { scope.reset(); }
  std::unique_ptr<IsaScope> scope;

  // Storage for a rows x cols matrix with leading dimension ld >= cols.
  static HostTensor matrix(DType t, int64_t rows, int64_t ld) { return HostTensor(t, {std::max<int64_t>(rows, 1), ld}); }

  // One product checked against float64; `pad` widens every leading dimension.
  void check(Dims d, bool acc, int64_t pad) {
    auto [ta, tb, t, isa] = GetParam();
    const int64_t M = d.M, N = d.N, K = d.K;
    const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K, b_rows = tb ? N : K, b_cols = tb ? K : N;
    GemmShape s;
    s.M = M, s.N = N, s.K = K, s.ta = ta, s.tb = tb, s.ab = t, s.accumulate = acc;
    s.lda = a_cols + pad, s.ldb = b_cols + pad, s.ldc = N + pad;
    HostTensor a = matrix(t, a_rows, s.lda), b = matrix(t, b_rows, s.ldb), c = matrix(DType::f32, M, s.ldc);
    a.randn(rng);
    b.randn(rng);
    c.randn(rng);
    const HostTensor c_old = c.clone();
    gemm.run(s, a.ptr<void>(), b.ptr<void>(), c.ptr<float>());

    // op(a) as (M, K) and op(b) as (N, K) rows in float64, so the reference loop runs over contiguous k.
    const std::vector<double> a64 = a.to_f64(), b64 = b.to_f64();
    std::vector<double> ar(static_cast<size_t>(M * K)), br(static_cast<size_t>(N * K));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < K; ++k) ar[i * K + k] = a64[ta ? k * s.lda + i : i * s.lda + k];
    for (int64_t j = 0; j < N; ++j)
      for (int64_t k = 0; k < K; ++k) br[j * K + k] = b64[tb ? j * s.ldb + k : k * s.ldb + j];
    HostTensor got(DType::f32, {M, N}), ref(DType::f64, {M, N}), bound(DType::f64, {M, N});
    int64_t pad_changed = 0;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double sum = 0, mag = 0;
        const double* x = &ar[i * K];
        const double* y = &br[j * K];
        for (int64_t k = 0; k < K; ++k) {
          sum += x[k] * y[k];
          mag += std::fabs(x[k] * y[k]);
        }
        const double old = c_old.get(i * s.ldc + j);
        ref.ptr<double>()[i * N + j] = acc ? old + sum : sum;
        bound.ptr<double>()[i * N + j] = acc ? mag + std::fabs(old) : mag;
        got.ptr<float>()[i * N + j] = c.ptr<float>()[i * s.ldc + j];
      }
      for (int64_t j = N; j < s.ldc; ++j) pad_changed += c.get(i * s.ldc + j) != c_old.get(i * s.ldc + j);
    }
    const std::string what = "M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
                             (acc ? " accumulate" : "") + " pad=" + std::to_string(pad);
    EXPECT_TRUE(c.guards_intact()) << what << ": wrote outside c";
    EXPECT_EQ(pad_changed, 0) << what << ": wrote between N and ldc";
    expect_within_bound(got, ref, bound, eps_of(DType::f32), K, 2.0, what);
  }

  DeviceAccess inside;  // the GEMM driven directly, as the backend drives it: Device memory open (strict mode)
  CpuMemory mem;
  Gemm gemm;
  std::mt19937_64 rng{20240611};
};

TEST_P(GemmRun, SmallOddShapes) {
  const int64_t sizes[] = {1, 5, 6, 7, 16, 17, 33};
  for (int64_t M : sizes)
    for (int64_t N : sizes)
      for (int64_t K : {int64_t(1), int64_t(7), int64_t(33)}) {
        check({M, N, K}, false, 0);
        check({M, N, K}, true, 3);
      }
}

// Past the block sizes: K > the k slice (384; 1024 on amx), N > the column panel (4096; 2048 on amx), M over
// many row blocks.
TEST_P(GemmRun, BlockBoundaries) {
  for (Dims d : {Dims{257, 300, 33}, Dims{300, 257, 300}, Dims{33, 17, 600}, Dims{31, 4100, 300}, Dims{1, 4113, 257},
                 Dims{1300, 23, 270}, Dims{70, 50, 2101}}) {
    check(d, false, 0);
    check(d, true, 5);
  }
}

INSTANTIATE_TEST_SUITE_P(Gemm, GemmRun,
                         testing::Combine(testing::Bool(), testing::Bool(), testing::Values(DType::f32, DType::bf16),
                                          testing::Values(GemmIsa::generic, GemmIsa::avx2, GemmIsa::avx512,
                                                          GemmIsa::amx)),
                         param_name);

// The eight-lane f32 -> bf16 rounding of the packing equals the scalar conversion bit for bit: ties to
// even, carries into the exponent, overflow to infinity, infinities, subnormals and NaNs (kept quiet).
__attribute__((target("avx2,fma"))) void round8(const float* in, float* out) {
  _mm256_storeu_ps(out, gemm_detail::load8(reinterpret_cast<const gemm_detail::F32AsBf16*>(in)));
}

TEST(GemmF32AsBf16, PackingRoundsLikeTheScalarConversion) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "no AVX2";
  std::vector<uint32_t> bits = {0x00000000, 0x80000000, 0x3f808000, 0x3f818000, 0x3f80ffff, 0x3f7fffff, 0x7f7fffff,
                                0xff7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0x7f800001, 0xffa01234, 0x00000001,
                                0x00008000, 0x00018000, 0x807fffff, 0x3f7f8000, 0x477fe000, 0x4b7fffff};
  std::mt19937_64 rng(3);
  while (bits.size() % 8 || bits.size() < 4096) bits.push_back(static_cast<uint32_t>(rng()));
  int64_t differ = 0;
  for (size_t i = 0; i < bits.size(); i += 8) {
    float in[8], out[8];
    for (int j = 0; j < 8; ++j) in[j] = bits_f32(bits[i + j]);
    round8(in, out);
    for (int j = 0; j < 8; ++j) {
      const uint32_t want = f32_bits(round_to_bf16(in[j]));
      if (f32_bits(out[j]) != want && ++differ <= 5)
        ADD_FAILURE() << std::hex << "0x" << bits[i + j] << " -> 0x" << f32_bits(out[j]) << ", want 0x" << want;
    }
  }
  EXPECT_EQ(differ, 0);
}

// The same product with 1, 2 and 3 threads gives the same bits (one row too: run_row), on every path (avx512's
// bf16 in pairs and widened).
TEST(GemmDeterminism, SameBitsForAnyThreadCount) {
  DeviceAccess inside;  // the GEMM driven directly
  CpuMemory mem(size_t(1) << 30);
  Gemm gemm(mem.device);
  std::mt19937_64 rng(7);
  const int saved = omp_get_max_threads();
  for (GemmIsa isa : supported_gemm_isas())
  for (bool pairs : pair_choices())
  for (DType t : {DType::f32, DType::bf16})
    for (Dims d : {Dims{50, 4100, 300}, Dims{5, 1000, 777}, Dims{1300, 40, 300}, Dims{1, 2001, 1029}})
      for (int tr = 0; tr < 4; ++tr) {
        const bool ta = tr & 1, tb = tr & 2;
        GemmShape s;
        s.M = d.M, s.N = d.N, s.K = d.K, s.ta = ta, s.tb = tb, s.ab = t, s.accumulate = true;
        HostTensor a(t, {d.M * d.K}), b(t, {d.K * d.N}), c0(DType::f32, {d.M * d.N});
        a.randn(rng);
        b.randn(rng);
        c0.randn(rng);
        std::vector<HostTensor> out;
        IsaScope on(isa);
        PairsScope with(pairs);
        for (int threads : {1, 2, 3}) {
          omp_set_num_threads(threads);
          HostTensor c = c0.clone();
          gemm.run(s, a.ptr<void>(), b.ptr<void>(), c.ptr<float>());
          out.push_back(std::move(c));
        }
        omp_set_num_threads(saved);
        for (size_t i = 1; i < out.size(); ++i)
          EXPECT_EQ(std::memcmp(out[0].ptr<float>(), out[i].ptr<float>(), sizeof(float) * d.M * d.N), 0)
              << gemm_isa_name(isa) << (pairs ? " pairs " : " ") << dtype_name(t) << " M=" << d.M << " N=" << d.N << " K=" << d.K << " ta=" << ta << " tb=" << tb
              << ": " << (i + 1) << " threads differ from 1";
      }
}

// Every path gives the avx2 path's bits: f32 (each output one FMA chain in ascending k), and bf16 operands,
// which avx512 multiplies in k pairs (vdpbf16ps) or widens as avx2 does (both choices run here where the CPU
// has AVX512-BF16, whichever it takes by default): the same sums, on normal values, on this CPU's
// implementation of the instruction. Blocked, skinny and one-row shapes, every transpose pair, a b
// read as bf16, and Gemm::tile (f32).
TEST(GemmPaths, EveryPathGivesTheAvx2Bits) {
  DeviceAccess inside;  // the GEMM driven directly
  if (!gemm_isa_supported(GemmIsa::avx2)) GTEST_SKIP() << "no AVX2";
  CpuMemory mem(size_t(1) << 30);
  Gemm gemm(mem.device);
  std::mt19937_64 rng(11);
  int compared = 0;
  for (GemmIsa isa : supported_gemm_isas())
  for (bool pairs : pair_choices()) {
    if (isa == GemmIsa::avx2 || isa == GemmIsa::generic) continue;  // generic sums unfused (GemmRun checks it)
    for (int mode = 0; mode < 3; ++mode)  // f32, bf16, bf16 a with an f32 b read as bf16
      // {41, 1000, 300}: the skinny nest with column ranges of three panels and more (B's rows read in place).
      for (Dims d : {Dims{50, 300, 301}, Dims{5, 100, 777}, Dims{130, 40, 64}, Dims{1, 33, 17}, Dims{300, 70, 900},
                     Dims{7, 90, 300}, Dims{1, 1000, 70}, Dims{41, 1000, 300}})
        for (int tr = 0; tr < 4; ++tr) {
          const DType t = mode == 0 ? DType::f32 : DType::bf16;
          GemmShape s;
          s.M = d.M, s.N = d.N, s.K = d.K, s.ta = tr & 1, s.tb = tr & 2, s.ab = t, s.accumulate = tr == 3;
          s.b_as_bf16 = mode == 2;
          HostTensor a(t, {d.M * d.K}), b(mode == 2 ? DType::f32 : t, {d.K * d.N}), c0(DType::f32, {d.M * d.N});
          a.randn(rng);
          b.randn(rng);
          c0.randn(rng);
          HostTensor want = c0.clone(), got = c0.clone();
          {
            IsaScope on(GemmIsa::avx2);
            gemm.run(s, a.ptr<void>(), b.ptr<void>(), want.ptr<float>());
          }
          {
            IsaScope on(isa);
            PairsScope with(pairs);
            gemm.run(s, a.ptr<void>(), b.ptr<void>(), got.ptr<float>());
          }
          ++compared;
          const std::string what = std::string(gemm_isa_name(isa)) + (pairs ? " pairs" : "") + " mode " +
                                   std::to_string(mode) +
                                   " M=" + std::to_string(d.M) + " N=" + std::to_string(d.N) +
                                   " K=" + std::to_string(d.K) + " ta=" + std::to_string(s.ta) +
                                   " tb=" + std::to_string(s.tb);
          if (isa == GemmIsa::amx && mode != 0 && d.M >= 2) {
            // bf16 on AMX tiles: the tile instruction's own sum order, so within the rounding of an fp32
            // sum of K products (|c| + sum |a b| bounds it), not the same bits.
            const std::vector<double> a64 = a.to_f64(), b64 = b.to_f64();
            int64_t far = 0;
            for (int64_t i = 0; i < d.M; ++i)
              for (int64_t j = 0; j < d.N; ++j) {
                double mag = std::fabs(c0.get(i * d.N + j)) * s.accumulate;
                for (int64_t k = 0; k < d.K; ++k)
                  mag += std::fabs(a64[s.ta ? k * d.M + i : i * d.K + k] *
                                   round_to_bf16(static_cast<float>(b64[s.tb ? j * d.K + k : k * d.N + j])));
                const double diff = std::fabs(double(want.get(i * d.N + j)) - got.get(i * d.N + j));
                far += diff > 2.0 * d.K * eps_of(DType::f32) * mag;
              }
            EXPECT_EQ(far, 0) << what << ": outputs further from the avx2 path's than fp32 rounding allows";
            continue;
          }
          EXPECT_TRUE(test::same_product(got.ptr<float>(), want.ptr<float>(), static_cast<size_t>(d.M * d.N))) << what;
          if (mode == 0) {
            HostTensor tw = c0.clone(), tg = c0.clone();
            {
              IsaScope on(GemmIsa::avx2);
              Gemm::tile(s, a.ptr<float>(), b.ptr<float>(), tw.ptr<float>());
            }
            {
              IsaScope on(isa);
              Gemm::tile(s, a.ptr<float>(), b.ptr<float>(), tg.ptr<float>());
            }
            EXPECT_EQ(std::memcmp(tw.ptr<float>(), tg.ptr<float>(), sizeof(float) * d.M * d.N), 0)
                << "tile " << gemm_isa_name(isa) << " M=" << d.M << " N=" << d.N << " K=" << d.K;
          }
        }
  }
  if (!gemm_isa_supported(GemmIsa::avx512)) GTEST_SKIP() << "no other vector path to compare (no AVX-512)";
  EXPECT_GT(compared, 0);
}

void expect_error(const std::function<void()>& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; wanted one containing '" << part << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(GemmPaths, NamesParseAndAMissingPathIsRefused) {
  for (GemmIsa isa : {GemmIsa::generic, GemmIsa::avx2, GemmIsa::avx512, GemmIsa::amx})
    EXPECT_EQ(parse_gemm_isa(gemm_isa_name(isa)), isa);
  expect_error([] { parse_gemm_isa("sse"); }, "use generic, avx2, avx512 or amx");
  EXPECT_TRUE(gemm_isa_supported(GemmIsa::generic));
  EXPECT_EQ(supported_gemm_isas().front(), GemmIsa::generic);
  for (GemmIsa isa : {GemmIsa::avx512, GemmIsa::amx}) {
    if (!gemm_isa_supported(isa)) expect_error([isa] { set_gemm_isa(isa); }, "this CPU has no");
  }
  // The path in use is the best one unless OOMLESS_ISA names another.
  if (!std::getenv("OOMLESS_ISA")) {
    EXPECT_EQ(gemm_isa(), supported_gemm_isas().back());
  }
}

// The AMX micro-kernel alone against a scalar sum of the same pair words: every tile count (1 or 2 row
// tiles, 1 or 2 column tiles), partial tiles, accumulate, and a k depth of several tiles. Pair words from
// random bf16 values; the rows of A past m are zero, as the packing leaves them.
TEST(GemmAmx, MicroKernelAgainstScalarSums) {
  if (!gemm_isa_supported(GemmIsa::amx)) GTEST_SKIP() << "this CPU has no AMX-BF16 path";
  std::mt19937_64 rng(17);
  std::normal_distribution<float> nd;
  const int64_t kpp = 48;  // three tiles of 16 pairs
  for (int m : {1, 15, 16, 17, 32})
    for (int n : {1, 16, 17, 32})
      for (bool acc : {false, true}) {
        std::vector<uint32_t> a(32 * kpp, 0), b(2 * 16 * kpp);
        auto word = [&] { return (uint32_t(f32_to_bf16(nd(rng))) << 16) | f32_to_bf16(nd(rng)); };
        for (int i = 0; i < m; ++i)
          for (int64_t p = 0; p < kpp; ++p) a[i * kpp + p] = word();
        for (auto& w : b) w = word();
        const int64_t ldc = 40;
        std::vector<float> c(32 * ldc), c0;
        for (auto& x : c) x = nd(rng);
        c0 = c;
        gemm_detail::AmxMicro u{};
        u.a = a.data(), u.lda = kpp, u.b = b.data(), u.b_second = 16 * kpp, u.c = c.data(), u.ldc = ldc;
        u.kpp = kpp, u.m = m, u.n = n, u.acc = acc;
        gemm_detail::amx_begin();
        gemm_detail::micro_amx(u);
        gemm_detail::amx_end();
        auto hi = [](uint32_t w) { return double(bf16_to_f32(uint16_t(w >> 16))); };
        auto lo = [](uint32_t w) { return double(bf16_to_f32(uint16_t(w & 0xffff))); };
        int64_t bad = 0, outside = 0;
        for (int i = 0; i < 32; ++i)
          for (int j = 0; j < ldc; ++j) {
            if (i >= m || j >= n) {
              outside += c[i * ldc + j] != c0[i * ldc + j];
              continue;
            }
            double sum = acc ? c0[i * ldc + j] : 0.0, mag = std::fabs(sum);
            for (int64_t p = 0; p < kpp; ++p) {
              const uint32_t x = a[i * kpp + p], y = j < 16 ? b[p * 16 + j] : b[16 * kpp + p * 16 + j - 16];
              sum += hi(x) * hi(y) + lo(x) * lo(y);
              mag += std::fabs(hi(x) * hi(y)) + std::fabs(lo(x) * lo(y));
            }
            bad += std::fabs(c[i * ldc + j] - sum) > 2.0 * 2 * kpp * eps_of(DType::f32) * mag;
          }
        EXPECT_EQ(bad, 0) << "m=" << m << " n=" << n << " acc=" << acc;
        EXPECT_EQ(outside, 0) << "m=" << m << " n=" << n << ": wrote outside the tile";
      }
}

}  // namespace
}  // namespace oomless::test
