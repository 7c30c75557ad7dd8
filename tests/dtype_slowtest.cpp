// Every one of the 2^32 floats through each narrow encoder (bf16, f16, f8_e4m3 and f8_e5m2 in both
// saturation modes), checked against a reference that shares nothing with the bit-level code:
// decode every code of the target from its fields with ldexp, sort the finite values, and pick the
// nearest one, ties to the even code. The overflow rule is IEEE's "round as if the exponent range
// were unbounded": a virtual entry one spacing above the largest finite value stands for the first
// unrepresentable value; landing on it means overflow (inf, NaN or saturation by format and mode).
//
// "Nearest, ties to even" makes the positive floats that map to sorted entry j one interval, from
// the midpoint below it to the midpoint above it, each midpoint going to the neighbour with the
// even code. Midpoints of these formats are exact floats, so the table stores, per entry, the bits
// of the last positive float in its interval. The sweep visits positive floats in increasing order
// (blocks of 2^16 inputs, each starting with a binary search) and advances j when an interval ends;
// both signs and both modes are checked from one walk. A second pass feeds f64 inputs (every
// midpoint, its neighbours, and random doubles) through convert(), which must round f64 sources
// once, straight to the target; there the nearest entry comes from a binary search and a
// comparison with the midpoint.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"

namespace oomless {
namespace {

struct Layout {
  const char* name;
  int E, M;
  bool has_inf;  // all-ones exponent = inf/NaN; otherwise only the all-ones code is NaN (e4m3fn)
  int sign_shift() const { return E + M; }
};

double field_value(const Layout& L, uint32_t code) {
  const int bias = (1 << (L.E - 1)) - 1;
  const uint32_t exp_ones = (1u << L.E) - 1, man_ones = (1u << L.M) - 1;
  const uint32_t exp = (code >> L.M) & exp_ones, man = code & man_ones;
  if (L.has_inf && exp == exp_ones)
    return man == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  if (!L.has_inf && exp == exp_ones && man == man_ones) return std::numeric_limits<double>::quiet_NaN();
  const double sig = exp == 0 ? man : man + std::ldexp(1.0, L.M);
  const double v = std::ldexp(sig, (exp == 0 ? 1 : static_cast<int>(exp)) - bias - L.M);
  return ((code >> L.sign_shift()) & 1) ? -v : v;
}

// The non-negative finite values of a format in increasing order, their codes, and the midpoints
// between neighbours. Entry K (the last) is the virtual first value past the largest finite one.
struct Table {
  std::vector<double> v, mid;
  std::vector<uint32_t> code;
  std::vector<uint32_t> last_bits;  // per entry: bits of the largest positive float nearest to it
  size_t K = 0;

  explicit Table(const Layout& L) {
    std::vector<std::pair<double, uint32_t>> vals;
    for (uint32_t c = 0; c < (1u << L.sign_shift()); ++c) {
      const double x = field_value(L, c);
      if (std::isfinite(x)) vals.push_back({x, c});
    }
    std::sort(vals.begin(), vals.end());
    for (auto& [x, c] : vals) v.push_back(x), code.push_back(c);
    K = v.size();
    v.push_back(v[K - 1] + (v[K - 1] - v[K - 2]));
    code.push_back(code[K - 1] + 1);
    for (size_t k = 0; k + 1 < v.size(); ++k) mid.push_back((v[k] + v[k + 1]) / 2);
    for (size_t k = 0; k < K; ++k) {
      const float m = static_cast<float>(mid[k]);
      EXPECT_EQ(static_cast<double>(m), mid[k]) << "midpoint not exact in f32";
      last_bits.push_back((code[k] & 1) == 0 ? f32_bits(m) : f32_bits(m) - 1);
    }
    last_bits.push_back(0x7f800000u);  // the virtual entry: everything up to inf overflows
  }

  // Index of the nearest entry to a >= 0 given k with v[k] <= a (k <= K); ties to the even code.
  size_t nearest_from(size_t k, double a) const {
    if (k == K || a == v[k]) return k;
    if (a < mid[k]) return k;
    if (a > mid[k]) return k + 1;
    return (code[k] & 1) == 0 ? k : k + 1;
  }
  size_t floor_index(double a) const {  // largest k with v[k] <= a
    return static_cast<size_t>(std::upper_bound(v.begin(), v.end(), a) - v.begin()) - 1;
  }
};

struct Mismatch {
  uint64_t count = 0;
  uint32_t input = 0, got = 0, want = 0;
  bool sat = false;
};

bool is_quiet_nan(const Layout& L, uint32_t code) {
  if (!std::isnan(field_value(L, code))) return false;
  return !L.has_inf || ((code >> (L.M - 1)) & 1);
}

// Runs all 2^32 floats. enc(float, sat) -> code; overflow_code(sat) -> magnitude code on overflow.
template <size_t NModes, class Enc, class Ovf>
void sweep_all_floats(const Layout& L, std::array<bool, NModes> modes, Enc enc, Ovf overflow_code) {
  const Table T(L);
  const uint32_t sign_bit = 1u << L.sign_shift();
  std::array<uint32_t, NModes> ovf;
  for (size_t i = 0; i < NModes; ++i) ovf[i] = overflow_code(modes[i]);
  constexpr int kBlocks = 1 << 15;  // high 15 bits of the magnitude; 2^16 inputs each
  std::vector<Mismatch> bad(kBlocks);
#pragma omp parallel for schedule(static)
  for (int blk = 0; blk < kBlocks; ++blk) {
    Mismatch& mm = bad[blk];
    auto fail = [&](uint32_t in, bool sat, uint32_t got, uint32_t want) {
      if (mm.count++ == 0) mm.input = in, mm.got = got, mm.want = want, mm.sat = sat;
    };
    const uint32_t u0 = static_cast<uint32_t>(blk) << 16;
    size_t j = static_cast<size_t>(std::lower_bound(T.last_bits.begin(), T.last_bits.end(), u0) - T.last_bits.begin());
    for (uint32_t u = u0; u < u0 + (1u << 16); ++u) {
      if (u > 0x7f800000u) {  // NaN in, NaN out, either sign, either mode
        for (uint32_t s : {0u, 0x80000000u})
          for (bool sat : modes) {
            const uint32_t got = enc(bits_f32(u | s), sat);
            if (!is_quiet_nan(L, got)) fail(u | s, sat, got, 0);
          }
        continue;
      }
      while (u > T.last_bits[j]) ++j;
      for (size_t i = 0; i < NModes; ++i) {
        const uint32_t want = j == T.K ? ovf[i] : T.code[j];
        const uint32_t pos = enc(bits_f32(u), modes[i]), neg = enc(bits_f32(u | 0x80000000u), modes[i]);
        if (pos != want) fail(u, modes[i], pos, want);
        if (neg != (want | sign_bit)) fail(u | 0x80000000u, modes[i], neg, want | sign_bit);
      }
    }
  }
  uint64_t total = 0;
  int shown = 0;
  for (const Mismatch& m : bad) {
    total += m.count;
    if (m.count != 0 && shown++ < 8)
      ADD_FAILURE() << L.name << (m.sat ? " (saturate)" : "") << ": input 0x" << std::hex << m.input << " ("
                    << bits_f32(m.input) << ") gives 0x" << m.got << ", reference 0x" << m.want;
  }
  EXPECT_EQ(total, 0u) << L.name << ": mismatching inputs out of 2^32 (x modes)";
}

const Layout kBf16{"bf16", 8, 7, true};
const Layout kF16{"f16", 5, 10, true};
const Layout kE4m3{"f8_e4m3", 4, 3, false};
const Layout kE5m2{"f8_e5m2", 5, 2, true};

TEST(DtypeSlow, Bf16AllFloats) {
  sweep_all_floats(kBf16, std::array{false}, [](float f, bool) -> uint32_t { return f32_to_bf16(f); },
                   [](bool) -> uint32_t { return 0x7f80; });
}

TEST(DtypeSlow, F16AllFloats) {
  sweep_all_floats(kF16, std::array{false}, [](float f, bool) -> uint32_t { return f32_to_f16(f); },
                   [](bool) -> uint32_t { return 0x7c00; });
}

TEST(DtypeSlow, E4m3AllFloatsBothModes) {
  // No infinities: overflow is NaN (0x7f), or the largest finite 448 (0x7e) when saturating.
  sweep_all_floats(kE4m3, std::array{true, false}, [](float f, bool sat) -> uint32_t { return f32_to_f8e4m3(f, sat); },
                   [](bool sat) -> uint32_t { return sat ? 0x7e : 0x7f; });
}

TEST(DtypeSlow, E5m2AllFloatsBothModes) {
  sweep_all_floats(kE5m2, std::array{false, true}, [](float f, bool sat) -> uint32_t { return f32_to_f8e5m2(f, sat); },
                   [](bool sat) -> uint32_t { return sat ? 0x7b : 0x7c; });
}

// convert() from f64, with each target's default overflow rule, against the same reference.
void sweep_f64(const Layout& L, DType t, uint32_t overflow_mag) {
  const Table T(L);
  const uint32_t sign_bit = 1u << L.sign_shift();
  auto ref = [&](double x) -> uint32_t {
    const double a = std::fabs(x);
    const size_t j = T.nearest_from(std::min(T.floor_index(a), T.K), a);
    const uint32_t mag = j == T.K ? overflow_mag : T.code[j];
    return std::signbit(x) ? (mag | sign_bit) : mag;
  };
  auto got = [&](double x) -> uint32_t {
    uint16_t out = 0;  // little-endian: 8-bit codes land in the low byte
    convert(&out, t, &x, DType::f64, 1);
    return dtype_bits(t) == 8 ? (out & 0xffu) : out;
  };
  std::vector<double> in;
  for (size_t k = 0; k < T.mid.size(); ++k) {
    for (double m : {T.mid[k], T.v[k]}) {
      in.push_back(m);
      in.push_back(std::nextafter(m, 0.0));
      in.push_back(std::nextafter(m, HUGE_VAL));
    }
  }
  // Random doubles spread over the format's range and a little past both ends.
  const double lo = std::log2(T.v[1]) - 4, hi = std::log2(T.v[T.K]) + 2;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> ex(lo, hi);
  for (int i = 0; i < (1 << 21); ++i) in.push_back(std::exp2(ex(rng)));
  in.push_back(HUGE_VAL);
  in.push_back(1e300);
  in.push_back(1e-300);
  in.push_back(0.0);
  uint64_t bad = 0;
  for (double a : in) {
    for (double x : {a, -a}) {
      const uint32_t g = got(x), w = ref(x);
      if (g != w && bad++ < 8)
        ADD_FAILURE() << L.name << " from f64 " << x << ": got 0x" << std::hex << g << ", reference 0x" << w;
    }
  }
  EXPECT_EQ(bad, 0u) << L.name << " from f64";
  const double nan = std::nan("");
  EXPECT_TRUE(is_quiet_nan(L, got(nan))) << L.name << " from f64 NaN";
}

TEST(DtypeSlow, ConvertF64Rounding) {
  sweep_f64(kBf16, DType::bf16, 0x7f80);
  sweep_f64(kF16, DType::f16, 0x7c00);
  sweep_f64(kE4m3, DType::f8_e4m3, 0x7e);  // convert saturates e4m3, as f32_to_f8e4m3 does by default
  sweep_f64(kE5m2, DType::f8_e5m2, 0x7c);
}

}  // namespace
}  // namespace oomless
