// Row-scaled fp8 / int8 K/V (the decode cache of generate --kv-dtype fp8|int8): Ops::cast_rows_scaled on
// both backends against a scalar model of its definition, and attention over row-scaled blocks equal, bit
// for bit, to attention over f32 blocks holding the decoded values. (The model's cache: generate_test.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "util/harness.h"

namespace oomless::test {
namespace {

// (N, K) values with rows of very different sizes, a zero row and a row with one large element.
std::vector<float> rows_of_values(int64_t N, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n) {
    const float size = std::ldexp(1.0f, static_cast<int>(n % 23) - 11);
    for (int64_t k = 0; k < K; ++k) x[static_cast<size_t>(n * K + k)] = n == 3 ? 0.0f : nd(rng) * size;
  }
  x[static_cast<size_t>(5 * K + 7)] = 1000.0f;
  return x;
}

float code_value(DType t, const void* codes, int64_t i) {
  return t == DType::i8 ? static_cast<float>(static_cast<const int8_t*>(codes)[i])
                        : f8e4m3_to_f32(static_cast<const uint8_t*>(codes)[i]);
}

TEST(CastRowsScaled, IsTheRowAbsmaxScaleOnBothBackends) {
  const int64_t N = 77, K = 64;
  const std::vector<float> x = rows_of_values(N, K, 11);
  const std::vector<double> xd(x.begin(), x.end());
  auto cpu = make_ops("cpu");
  auto ref = make_ops("ref");
  for (DType t : {DType::f8_e4m3, DType::i8}) {
    SCOPED_TRACE(dtype_name(t));
    const float qmax = t == DType::i8 ? 127.0f : 448.0f;
    std::vector<uint8_t> codes(static_cast<size_t>(N * K), 0xAB), rcodes(codes.size(), 0xCD);
    std::vector<float> scales(static_cast<size_t>(N), -1.0f);
    std::vector<double> rscales(static_cast<size_t>(N), -1.0);
    cpu->cast_rows_scaled(Tensor(codes.data(), t, {N, K}), Tensor::of(scales.data(), {N}), Tensor::of(const_cast<float*>(x.data()), {N, K}));
    ref->cast_rows_scaled(Tensor(rcodes.data(), t, {N, K}), Tensor::of(rscales.data(), {N}),
                          Tensor::of(const_cast<double*>(xd.data()), {N, K}));
    int64_t ref_differs = 0;
    for (int64_t n = 0; n < N; ++n) {
      float amax = 0;
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[static_cast<size_t>(n * K + k)]));
      const float s = amax / qmax;
      ASSERT_EQ(scales[static_cast<size_t>(n)], s) << "row " << n;
      EXPECT_NEAR(rscales[static_cast<size_t>(n)], s, 1e-7 * s) << "row " << n;
      const float inv = s == 0.0f ? 0.0f : 1.0f / s;
      float err = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = n * K + k;
        const float y = x[static_cast<size_t>(i)] * inv;
        const uint8_t want = t == DType::i8 ? static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::nearbyint(y), -127.0f, 127.0f)))
                                            : f32_to_f8e4m3(y, true);
        ASSERT_EQ(codes[static_cast<size_t>(i)], want) << "row " << n << " element " << k;
        err = std::max(err, std::fabs(code_value(t, codes.data(), i) * s - x[static_cast<size_t>(i)]));
        // f64 and f32 products may land on either side of a rounding midpoint: one code apart at most.
        const float a = code_value(t, codes.data(), i), b = code_value(t, rcodes.data(), i);
        ref_differs += a != b;
        EXPECT_LE(std::fabs(a - b), t == DType::i8 ? 1.0f : std::max(std::fabs(a), std::fabs(b)) / 8 + 1e-9f) << i;
      }
      // Half a code step at most: 1/2 of s for int8; 1/16 of the value (3 mantissa bits) or the
      // subnormal step for E4M3.
      EXPECT_LE(err, t == DType::i8 ? 0.5f * s * 1.0001f : std::max(amax / 16, 0x1p-10f * s)) << "row " << n;
    }
    EXPECT_LE(ref_differs, N * K / 100);
    for (int64_t k = 0; k < K; ++k) EXPECT_EQ(codes[static_cast<size_t>(3 * K + k)], 0) << "the zero row";
    EXPECT_EQ(scales[3], 0.0f);
  }
  // dst of another dtype, or scales of the wrong length, are refused.
  std::vector<uint16_t> b16(static_cast<size_t>(N * K));
  std::vector<float> sc(static_cast<size_t>(N));
  EXPECT_THROW(cpu->cast_rows_scaled(Tensor(b16.data(), DType::bf16, {N, K}), Tensor::of(sc.data(), {N}),
                                     Tensor::of(const_cast<float*>(x.data()), {N, K})),
               Error);
  EXPECT_THROW(cpu->cast_rows_scaled(Tensor(b16.data(), DType::i8, {N, K}), Tensor::of(sc.data(), {N - 1}),
                                     Tensor::of(const_cast<float*>(x.data()), {N, K})),
               Error);
}

// Attention reads a row-scaled block as code * its row's scale: the result is the f32 blocks' holding those
// values, bit for bit (paged table, GQA, a partial last block, queries after history; f32 and bf16
// products, and fp8's backward), and i8 blocks without their scales are refused.
TEST(CastRowsScaled, AttentionOverRowScaledBlocksIsItsDecodedValues) {
  const int64_t T = 37, H = 4, Hkv = 2, D = 64, P = 32, off = 50, keys = off + T, nb = (keys + P - 1) / P;
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<size_t>(T * H * D)), k(static_cast<size_t>(nb * Hkv * P * D)), v(k.size());
  for (float& e : q) e = nd(rng);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = nd(rng) * (1.0f + static_cast<float>(i / D % 5));  // rows of different sizes
    v[i] = nd(rng);
  }
  std::vector<int32_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[static_cast<size_t>(t)] = static_cast<int32_t>(off + t);
  auto ops = make_ops("cpu");
  const int64_t rows = nb * Hkv * P;
  for (DType t : {DType::f8_e4m3, DType::i8}) {
    SCOPED_TRACE(dtype_name(t));
    std::vector<uint8_t> kc(k.size()), vc(v.size());
    std::vector<float> ks(static_cast<size_t>(rows)), vs(ks.size()), kd(k.size()), vd(v.size());
    ops->cast_rows_scaled(Tensor(kc.data(), t, {rows, D}), Tensor::of(ks.data(), {rows}), Tensor::of(k.data(), {rows, D}));
    ops->cast_rows_scaled(Tensor(vc.data(), t, {rows, D}), Tensor::of(vs.data(), {rows}), Tensor::of(v.data(), {rows, D}));
    for (int64_t i = 0; i < static_cast<int64_t>(k.size()); ++i) {
      kd[static_cast<size_t>(i)] = code_value(t, kc.data(), i) * ks[static_cast<size_t>(i / D)];
      vd[static_cast<size_t>(i)] = code_value(t, vc.data(), i) * vs[static_cast<size_t>(i / D)];
    }
    std::vector<KvBlock> narrow, wide;
    const int64_t per = Hkv * P * D;
    for (int64_t b = 0; b < nb; ++b) {
      const int32_t len = static_cast<int32_t>(std::min(P, keys - b * P));
      KvBlock n{kc.data() + b * per, vc.data() + b * per, static_cast<int32_t>(b * P), len};
      n.k_rows = ks.data() + b * Hkv * P;
      n.v_rows = vs.data() + b * Hkv * P;
      narrow.push_back(n);
      wide.push_back(KvBlock{kd.data() + b * per, vd.data() + b * per, static_cast<int32_t>(b * P), len});
    }
    std::vector<float> o1(q.size()), o2(q.size()), l1(static_cast<size_t>(H * T)), l2(l1.size());
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    Tensor qt = Tensor::of(q.data(), {T, H, D}), pt(pos.data(), DType::i32, {T});
    // With bf16 products too (bf16 compute; on an AMX CPU its tiles, the key tiles packed from the decoded
    // values), and for fp8 the backward as well.
    for (bool bf16 : {true, false}) {
      SCOPED_TRACE(bf16 ? "bf16 products" : "f32 products");
      const KvBlocks kn{narrow.data(), nb, Hkv, P, D, t, bf16}, kw{wide.data(), nb, Hkv, P, D, DType::f32, bf16};
      ops->attention_forward(Tensor::of(o1.data(), {T, H, D}), Tensor::of(l1.data(), {H, T}), qt, kn, pt, scale);
      ops->attention_forward(Tensor::of(o2.data(), {T, H, D}), Tensor::of(l2.data(), {H, T}), qt, kw, pt, scale);
      EXPECT_EQ(o1, o2);
      EXPECT_EQ(l1, l2);
      if (t != DType::f8_e4m3) continue;
      std::vector<float> dout(q.size()), dq1(q.size()), dq2(q.size()), dkv1(2 * k.size()), dkv2(2 * k.size());
      for (float& e : dout) e = nd(rng);
      std::vector<KvBlock> g1, g2;
      for (int64_t b = 0; b < nb; ++b) {
        g1.push_back(KvBlock{dkv1.data() + b * per, dkv1.data() + k.size() + b * per, narrow[b].start, narrow[b].len});
        g2.push_back(KvBlock{dkv2.data() + b * per, dkv2.data() + k.size() + b * per, narrow[b].start, narrow[b].len});
      }
      Tensor dt = Tensor::of(dout.data(), {T, H, D}), ot = Tensor::of(o1.data(), {T, H, D});
      Tensor lt = Tensor::of(l1.data(), {H, T});
      ops->attention_backward(Tensor::of(dq1.data(), {T, H, D}), KvBlocks{g1.data(), nb, Hkv, P, D, DType::f32}, dt,
                              qt, kn, ot, lt, pt, scale);
      ops->attention_backward(Tensor::of(dq2.data(), {T, H, D}), KvBlocks{g2.data(), nb, Hkv, P, D, DType::f32}, dt,
                              qt, kw, ot, lt, pt, scale);
      EXPECT_EQ(dq1, dq2);
      EXPECT_EQ(dkv1, dkv2);
      EXPECT_GT(std::fabs(dq1[5]) + std::fabs(dkv1[5]), 0.0f);
    }
    // ... and close to attention over the values before narrowing (the quantisation is what differs).
    std::vector<KvBlock> exact;
    for (int64_t b = 0; b < nb; ++b)
      exact.push_back(KvBlock{k.data() + b * per, v.data() + b * per, static_cast<int32_t>(b * P),
                              static_cast<int32_t>(std::min(P, keys - b * P))});
    ops->attention_forward(Tensor::of(o2.data(), {T, H, D}), Tensor::of(l2.data(), {H, T}), qt,
                           KvBlocks{exact.data(), nb, Hkv, P, D, DType::f32}, pt, scale);
    double num = 0, den = 0;
    for (size_t i = 0; i < o1.size(); ++i) num += (o1[i] - o2[i]) * (o1[i] - o2[i]), den += o2[i] * o2[i];
    EXPECT_LT(std::sqrt(num / den), t == DType::i8 ? 2e-2 : 1e-1);
    EXPECT_GT(num, 0.0);
    if (t == DType::i8) {
      narrow[0].k_rows = narrow[0].v_rows = nullptr;
      EXPECT_THROW(ops->attention_forward(Tensor::of(o1.data(), {T, H, D}), Tensor::of(l1.data(), {H, T}), qt,
                                          KvBlocks{narrow.data(), nb, Hkv, P, D, t}, pt, scale),
                   Error);
    }
  }
}

}  // namespace
}  // namespace oomless::test
