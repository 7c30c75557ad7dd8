// Linear::rows: every per-output-row part of a projection narrowed together (W, b, B, DoRA's g and n, their
// gradients), the input side (A, dA) whole, a quantised weight by its row offset, empty parts empty.
#include <gtest/gtest.h>

#include <vector>

#include "model/linear.h"

namespace oomless::test {
namespace {

TEST(Linear, RowsNarrowsEveryPerRowPart) {
  const int64_t N = 8, K = 5, r = 3;
  std::vector<float> w(N * K), b(N), gw(N * K), gb(N), a(r * K), bm(N * r), ga(r * K), gbm(N * r), g(N), n(N), gm(N);
  Linear L;
  L.w = Tensor::of(w.data(), {N, K}).read_as_bf16();
  L.b = Tensor::of(b.data(), {N});
  L.gw = Tensor::of(gw.data(), {N, K});
  L.gb = Tensor::of(gb.data(), {N});
  L.a = Tensor::of(a.data(), {r, K});
  L.bm = Tensor::of(bm.data(), {N, r});
  L.ga = Tensor::of(ga.data(), {r, K});
  L.gbm = Tensor::of(gbm.data(), {N, r});
  L.g = Tensor::of(g.data(), {N}), L.n = Tensor::of(n.data(), {N}), L.gm = Tensor::of(gm.data(), {N});
  L.scale = 2.5, L.dropout_seed = 77;

  const Linear h = L.rows(2, 3);
  EXPECT_EQ(h.w.data, w.data() + 2 * K);
  EXPECT_EQ(h.out(), 3);
  EXPECT_EQ(h.in(), K);
  EXPECT_TRUE(h.w.as_bf16);  // the read mode stays
  EXPECT_EQ(h.gw.data, gw.data() + 2 * K);
  EXPECT_EQ(h.b.data, b.data() + 2);
  EXPECT_EQ(h.b.dims[0], 3);
  EXPECT_EQ(h.gb.data, gb.data() + 2);
  EXPECT_EQ(h.bm.data, bm.data() + 2 * r);
  EXPECT_EQ(h.bm.dims[0], 3);
  EXPECT_EQ(h.bm.dims[1], r);
  EXPECT_EQ(h.gbm.data, gbm.data() + 2 * r);
  EXPECT_EQ(h.g.data, g.data() + 2);
  EXPECT_EQ(h.n.data, n.data() + 2);
  EXPECT_EQ(h.gm.data, gm.data() + 2);
  EXPECT_EQ(h.a.data, a.data());  // the input side stays whole
  EXPECT_EQ(h.a.dims[0], r);
  EXPECT_EQ(h.ga.data, ga.data());
  EXPECT_EQ(h.scale, 2.5);
  EXPECT_EQ(h.dropout_seed, 77u);
  EXPECT_TRUE(h.lora());
  EXPECT_TRUE(h.dora());
}

TEST(Linear, FrozenAndQuantisedParts) {
  const int64_t N = 6, K = 4;
  QuantMatrix q;
  q.rows = 12, q.cols = K;
  Linear L;
  L.w = Tensor(nullptr, DType::f32, {N, K});
  L.w.quant = &q, L.w.qrow0 = 6;  // rows 6..11 of the quantised matrix
  const Linear h = L.rows(4, 2);
  EXPECT_EQ(h.w.quant, &q);
  EXPECT_EQ(h.w.qrow0, 10);
  EXPECT_EQ(h.w.dims[0], 2);
  EXPECT_EQ(h.gw.data, nullptr);  // frozen: no gradient, still none
  EXPECT_EQ(h.b.data, nullptr);
  EXPECT_FALSE(h.lora());
  EXPECT_FALSE(h.dora());
}

}  // namespace
}  // namespace oomless::test
