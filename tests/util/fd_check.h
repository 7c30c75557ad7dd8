// Finite-difference check of a model's parameter gradients in float64: `per_tensor` coordinates of every
// parameter tensor, drawn with `seed`, each compared with the central difference (h = 1e-5) of `loss`
// within 1e-7 + 1e-6 |fd|. Returns how many coordinates were checked.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "util/harness.h"

#include "model/params.h"

namespace oomless::test {

inline int check_sampled_gradients(ParamSet& params, const ParamSet& grads, const std::function<double()>& loss,
                                   int per_tensor, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const Tensor& w = params.tensors()[i];
    const std::vector<double> g = tensor_values<double>(grads.tensors()[i]);
    for (int k = 0; k < per_tensor; ++k) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(w.numel()));
      const Tensor one(static_cast<double*>(w.data) + j, DType::f64, {1}, w.tier);  // element j, through Ops
      const double save = tensor_values<double>(one)[0], h = 1e-5;
      auto set = [&](double v) { write_tensor(one, [v](void* p) { *static_cast<double*>(p) = v; }); };
      set(save + h);
      const double lp = loss();
      set(save - h);
      const double lm = loss();
      set(save);
      const double fd = (lp - lm) / (2 * h);
      EXPECT_NEAR(g[static_cast<size_t>(j)], fd, 1e-7 + 1e-6 * std::abs(fd)) << params.specs()[i].name << "[" << j << "]";
      ++checked;
    }
  }
  return checked;
}

}  // namespace oomless::test
