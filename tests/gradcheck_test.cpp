// Central finite differences in float64 against every backward of the reference backend (attention and
// cross-entropy have theirs beside their conformance tests). With the cpu backend matched to ref in
// ops_test, this checks the cpu backwards too.
#include <cmath>
#include <functional>

#include "backend/ref/ref_ops.h"
#include "util/harness.h"

namespace oomless::test {
namespace {

// L(x) = sum(forward(x) * W). Compares dL/dx from `analytic` (what the backward gave) with central
// differences of L over every element of x.
void check_grad(HostTensor& x, const std::function<double()>& loss, const HostTensor& analytic, const std::string& what,
                double tol = 1e-7) {
  ASSERT_EQ(x.dtype(), DType::f64);
  HostTensor numeric(DType::f64, {x.numel()});
  for (int64_t i = 0; i < x.numel(); ++i) {
    double orig = x.get(i), h = 1e-6 * std::max(1.0, std::fabs(orig));
    x.set(i, orig + h);
    double lp = loss();
    x.set(i, orig - h);
    double lm = loss();
    x.set(i, orig);
    numeric.set(i, (lp - lm) / (2 * h));
  }
  HostTensor flat = analytic;
  double err = rel_l2(flat, numeric);
  EXPECT_LE(err, tol) << what << ": backward vs finite differences, relative L2 " << err;
}

double dot(const HostTensor& a, const HostTensor& b) {
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += a.get(i) * b.get(i);
  return s;
}

class GradCheck : public testing::Test {
 protected:
  HostTensor randn(std::vector<int64_t> shape, double sd = 1.0) {
    HostTensor t(DType::f64, shape);
    t.randn(rng, sd);
    return t;
  }
  RefOps ref;
  std::mt19937_64 rng{99};
};

TEST_F(GradCheck, RmsNorm) {
  const int64_t R = 3, E = 7;
  HostTensor x = randn({R, E}), w = randn({E}), W = randn({R, E}), y(DType::f64, {R, E}), rstd(DType::f64, {R});
  auto loss = [&] {
    ref.rmsnorm_forward(y, rstd, x, w, 1e-5);
    return dot(y, W);
  };
  loss();
  HostTensor dx(DType::f64, {R, E}), dw(DType::f64, {E});
  ref.rmsnorm_backward(dx, dw, W, x, w, rstd);
  check_grad(x, loss, dx, "rmsnorm dx");
  check_grad(w, loss, dw, "rmsnorm dweight");
}

TEST_F(GradCheck, Rope) {
  for (RopeScaling kind : {RopeScaling::none, RopeScaling::linear, RopeScaling::llama3, RopeScaling::yarn}) {
    const int64_t T = 4, H = 2, D = 8;
    RopeConfig cfg;
    cfg.scaling = kind;
    cfg.factor = 4.0;
    cfg.original_max_position = 64;
    if (kind == RopeScaling::yarn) cfg.attention_factor = 1.3;  // the backward must carry it too
    HostTensor x = randn({T, H, D}), W = randn({T, H, D}), y(DType::f64, {T, H, D}), pos(DType::i32, {T});
    for (int64_t t = 0; t < T; ++t) pos.set(t, 3 + 17 * t);
    auto loss = [&] {
      ref.rope_forward(y, x, pos, cfg);
      return dot(y, W);
    };
    HostTensor dx(DType::f64, {T, H, D});
    ref.rope_backward(dx, W, pos, cfg);
    check_grad(x, loss, dx, std::string("rope ") + rope_scaling_name(kind) + " dx");
  }
}

TEST_F(GradCheck, SwiGlu) {
  const int64_t T = 3, F = 5;
  HostTensor g = randn({T, F}, 2.0), u = randn({T, F}), W = randn({T, F}), y(DType::f64, {T, F});
  auto loss = [&] {
    ref.swiglu_forward(y, g, u);
    return dot(y, W);
  };
  HostTensor dg(DType::f64, {T, F}), du(DType::f64, {T, F});
  ref.swiglu_backward(dg, du, W, g, u);
  check_grad(g, loss, dg, "swiglu dgate");
  check_grad(u, loss, du, "swiglu dup");
}

TEST_F(GradCheck, Embedding) {
  const int64_t T = 6, V = 4, E = 3;
  HostTensor table = randn({V, E}), W = randn({T, E}), y(DType::f64, {T, E}), ids(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) ids.set(t, (t * 3) % V);  // repeated ids accumulate
  auto loss = [&] {
    ref.embedding_forward(y, ids, table);
    return dot(y, W);
  };
  HostTensor dt(DType::f64, {V, E});
  dt.fill(0.0);
  ref.embedding_backward(dt, W, ids);
  check_grad(table, loss, dt, "embedding dtable");
}

TEST_F(GradCheck, MatmulProductRule) {
  // The model's linear backward is two matmuls: dA = dC . B^T (NT), dB = A^T . dC (TN).
  const int64_t M = 3, K = 4, N = 5;
  HostTensor a = randn({M, K}), b = randn({K, N}), W = randn({M, N}), c(DType::f64, {M, N});
  auto loss = [&] {
    ref.matmul(c, a, b, false, false, false);
    return dot(c, W);
  };
  HostTensor da(DType::f64, {M, K}), db(DType::f64, {K, N});
  ref.matmul(da, W, b, false, true, false);
  ref.matmul(db, a, W, true, false, false);
  check_grad(a, loss, da, "matmul dA");
  check_grad(b, loss, db, "matmul dB");
}

}  // namespace
}  // namespace oomless::test
