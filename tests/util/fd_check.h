// Finite-difference check of a model's parameter gradients in float64: `per_tensor` coordinates of every
// parameter tensor, drawn with `seed`, each compared with the central difference (h = 1e-5) of `loss`
// within 1e-7 + 1e-6 |fd|. Returns how many coordinates were checked.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "model/params.h"

namespace oomless::test {

inline int check_sampled_gradients(ParamSet& params, const ParamSet& grads, const std::function<double()>& loss,
                                   int per_tensor, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const Tensor& w = params.tensors()[i];
    double* wp = static_cast<double*>(w.data);
    const double* gp = static_cast<const double*>(grads.tensors()[i].data);
    for (int k = 0; k < per_tensor; ++k) {
      const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(w.numel()));
      const double save = wp[j], h = 1e-5;
      wp[j] = save + h;
      const double lp = loss();
      wp[j] = save - h;
      const double lm = loss();
      wp[j] = save;
      const double fd = (lp - lm) / (2 * h);
      EXPECT_NEAR(gp[j], fd, 1e-7 + 1e-6 * std::abs(fd)) << params.specs()[i].name << "[" << j << "]";
      ++checked;
    }
  }
  return checked;
}

}  // namespace oomless::test
