// The cpu backend gives identical bits for 1, 2 and 3 threads: bit-exact resume depends on it.
#include <omp.h>

#include <cstring>

#include "util/harness.h"

namespace oomless::test {
namespace {

struct Outputs {
  std::vector<HostTensor> t;
  double ss = 0;
};

Outputs run_all(int threads) {
  omp_set_num_threads(threads);
  auto ops = make_ops("cpu");
  std::mt19937_64 rng(5);
  const int64_t T = 97, E = 160, F = 224, V = 301;
  Outputs out;
  auto make = [&](std::vector<int64_t> shape) {
    HostTensor x(DType::f32, shape);
    x.randn(rng);
    return x;
  };
  HostTensor x = make({T, E}), w = make({E, F}), w2 = make({F, E}), norm_w = make({E}), ids(DType::i32, {T});
  ids.randint(rng, 0, static_cast<int32_t>(V));
  HostTensor table = make({V, E}), h = make({T, F}), y = make({T, E}), dw = make({E, F}), rstd(DType::f32, {T});
  ops->embedding_forward(x, ids, table);
  ops->rmsnorm_forward(y, rstd, x, norm_w, 1e-6);
  ops->matmul(h, y, w, false, false, false);
  ops->swiglu_forward(h, h, h);
  ops->matmul(y, h, w2, false, false, false);
  ops->matmul(dw, y, h, true, false, true);  // weight-gradient shape: a K = T reduction
  HostTensor dx = make({T, E}), dnw = make({E}), dtable = make({V, E});
  ops->rmsnorm_backward(dx, dnw, y, x, norm_w, rstd);
  ops->embedding_backward(dtable, dx, ids);
  HostTensor q = make({T, 4, 16}), pos(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) pos.set(t, t);
  ops->rope_forward(q, q, pos, RopeConfig{});
  out.ss = ops->sum_squares(dtable);
  out.t = {y, dw, dx, dnw, dtable, q, h};
  return out;
}

TEST(Determinism, SameBitsForOneTwoThreeThreads) {
  int saved = omp_get_max_threads();
  Outputs base = run_all(1);
  for (int threads : {2, 3}) {
    Outputs o = run_all(threads);
    for (size_t i = 0; i < base.t.size(); ++i)
      EXPECT_EQ(std::memcmp(base.t[i].t().data, o.t[i].t().data, base.t[i].t().nbytes()), 0)
          << "output " << i << " differs between 1 and " << threads << " threads";
    EXPECT_EQ(std::memcmp(&base.ss, &o.ss, sizeof(double)), 0)
        << "sum_squares with " << threads << " threads: " << base.ss << " vs " << o.ss;
  }
  omp_set_num_threads(saved);
}

}  // namespace
}  // namespace oomless::test
