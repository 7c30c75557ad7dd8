// The integer one-row products over Q4_0, Q4_1 and Q8_0 blocks (io/gguf.h ggml_row_dot_q8) and the 8-bit
// activation rows they take (core/q8_act.h): the vector forms against the plain ones, bit for bit (this
// binary runs again under OOMLESS_ISA=avx2 and generic, so each form this CPU has is compared), and the plain
// forms against their definitions in float64.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/q8_act.h"
#include "io/gguf.h"
#include "util/gguf_blocks.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

struct Act {
  std::vector<char> mem;
  Q8Act a;
  explicit Act(int64_t n) : mem(q8_act_bytes(n)), a(q8_act_at(mem.data(), n)) {}
};

// Blocks of every kind the quantiser meets: random scales, a block of zeros, values whose codes fall on
// ties (x * 127 / amax = k + 1/2), values so small that 127 / amax overflows, a NaN and an infinity.
std::vector<float> awkward_row(int64_t blocks, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(blocks * kQ8Block));
  for (int64_t b = 0; b < blocks; ++b) {
    float* xb = x.data() + b * kQ8Block;
    const float scale = std::ldexp(1.0f, static_cast<int>(rng() % 20) - 10);
    for (int k = 0; k < kQ8Block; ++k) xb[k] = scale * nd(rng);
    switch (b % 7) {
      case 1: std::fill(xb, xb + kQ8Block, 0.0f); break;
      case 2:  // amax 127: codes are x itself, and k + 1/2 rounds to even
        for (int k = 0; k < kQ8Block; ++k) xb[k] = k == 0 ? 127.0f : static_cast<float>(k % 9) - 4.5f;
        break;
      case 3: for (int k = 0; k < kQ8Block; ++k) xb[k] *= 1e-38f; break;
      case 4: xb[5] = std::numeric_limits<float>::quiet_NaN(); break;
      case 5: xb[17] = -std::numeric_limits<float>::infinity(); break;
      default: break;
    }
  }
  return x;
}

TEST(GgufQ8Dot, QuantisedRowsAreThePlainFormsAndWithinHalfAStep) {
  const int64_t blocks = 70;
  const std::vector<float> x = awkward_row(blocks, 11);
  Act v(blocks * kQ8Block), p(blocks * kQ8Block);
  quantise_q8_act(x.data(), v.a);
  quantise_q8_act_scalar(x.data(), p.a);
  EXPECT_EQ(std::memcmp(v.a.q, p.a.q, static_cast<size_t>(blocks * kQ8Block)), 0);
  EXPECT_EQ(std::memcmp(v.a.d, p.a.d, static_cast<size_t>(blocks) * 4), 0);
  EXPECT_EQ(std::memcmp(v.a.s, p.a.s, static_cast<size_t>(blocks) * 4), 0);
  for (int64_t b = 0; b < blocks; ++b) {
    SCOPED_TRACE(b);
    const float* xb = x.data() + b * kQ8Block;
    const int8_t* q = p.a.q + b * kQ8Block;
    const float d = p.a.d[b];
    bool finite = true;
    for (int k = 0; k < kQ8Block; ++k) finite = finite && std::isfinite(xb[k]);
    if (!finite) {
      EXPECT_TRUE(std::isnan(d));
      continue;
    }
    int sum = 0;
    for (int k = 0; k < kQ8Block; ++k) {
      EXPECT_LE(std::abs(static_cast<int>(q[k])), 127);
      EXPECT_LE(std::abs(static_cast<double>(xb[k]) - static_cast<double>(q[k]) * d), 0.5001 * d + 1e-36) << k;  // (subnormal inputs round coarser)
      sum += q[k];
    }
    EXPECT_EQ(p.a.s[b], d * static_cast<float>(sum));
    if (b % 7 == 2) {  // the ties, to even: -3.5 -> -4, -2.5 -> -2, -1.5 -> -2, -0.5 -> 0, 0.5 -> 0, -4.5 -> -4
      const int want[] = {127, -4, -2, -2, 0, 0, 2, 2, 4, -4};
      for (int k = 0; k < 10; ++k) EXPECT_EQ(q[k], want[k]) << k;
    }
  }
}

// The plain form is the float64 product of the dequantised weights (io/gguf.h dequantize) with the
// dequantised activation codes, to f32 rounding; each vector form is the plain one bit for bit, for any
// number of rows a call (1..8), so that row groups and their tails agree.
TEST(GgufQ8Dot, EveryFormIsThePlainOneAndTheProductOfTheDequantisedValues) {
  const int64_t blocks = 13, rows = 8, K = blocks * kQ8Block;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(K));
  for (auto& v : x) v = nd(rng);
  Act act(K);
  quantise_q8_act_scalar(x.data(), act.a);
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    SCOPED_TRACE(ggml_type_name(t));
    const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(t));
    const std::vector<uint8_t> w = random_blocks(t, rows, K, 21);
    const int64_t row_bytes = blocks * ti->type_size;
    std::vector<float> plain(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w.data() + r * row_bytes;
      plain[static_cast<size_t>(r)] = ggml_row_dot_q8_scalar(t, row, blocks, act.a);
      std::vector<float> deq(static_cast<size_t>(K));
      dequantize(t, row, K, deq.data());
      double s = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double term = static_cast<double>(deq[static_cast<size_t>(k)]) * act.a.q[k] * act.a.d[k / kQ8Block];
        s += term, mag += std::abs(term);
      }
      EXPECT_NEAR(plain[static_cast<size_t>(r)], s, 1e-5 * mag) << "row " << r;
    }
    const GgmlRowDotQ8 form = ggml_row_dot_q8(t);
    if (!form) {
      EXPECT_STREQ(ggml_row_dot_q8_form(), "none");
      continue;
    }
    SCOPED_TRACE(ggml_row_dot_q8_form());
    for (int g = 1; g <= rows; ++g) {
      const uint8_t* p[8];
      for (int i = 0; i < g; ++i) p[i] = w.data() + i * row_bytes;
      std::vector<float> out(static_cast<size_t>(g));
      form(p, g, blocks, act.a, out.data(), 8 * row_bytes);
      EXPECT_EQ(std::memcmp(out.data(), plain.data(), static_cast<size_t>(g) * 4), 0) << g << " rows a call";
    }
  }
}

// A block whose activations hold a NaN makes the row's product NaN, as the f32 product would be.
TEST(GgufQ8Dot, ANonFiniteActivationGivesNaN) {
  std::vector<float> x(64, 1.0f);
  x[40] = std::numeric_limits<float>::infinity();
  Act act(64);
  quantise_q8_act(x.data(), act.a);
  for (GgmlType t : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0}) {
    const std::vector<uint8_t> w = random_blocks(t, 1, 64, 5);
    EXPECT_TRUE(std::isnan(ggml_row_dot_q8_scalar(t, w.data(), 2, act.a))) << ggml_type_name(t);
    if (const GgmlRowDotQ8 f = ggml_row_dot_q8(t)) {
      const uint8_t* p[1] = {w.data()};
      float out = 0;
      f(p, 1, 2, act.a, &out, 0);
      EXPECT_TRUE(std::isnan(out)) << ggml_type_name(t);
    }
  }
}

}  // namespace
}  // namespace oomless::test
