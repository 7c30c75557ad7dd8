// Shared by the tests that compare against goldens and perturb parameters: F64 golden tensors, relative
// L2 error, tensors as float64, and non-trivial norms and biases.
#pragma once
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/params.h"
#include "util/harness.h"

namespace oomless::test {

inline std::vector<double> read_f64(const SafetensorsFile& f, const std::string& name) {
  const StTensor* t = f.find(name);
  OOM_CHECK(t && t->dtype == DType::f64, "golden tensor ", name, " missing or not F64");
  std::vector<double> v(static_cast<size_t>(t->numel()));
  std::memcpy(v.data(), t->data, v.size() * sizeof(double));
  return v;
}

inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num) / std::sqrt(den);
}

inline std::vector<double> to_f64(const Tensor& t) { return tensor_f64(t); }

// Non-trivial norms and biases (+ U(-0.3, 0.3)) so their effect and gradients are exercised.
inline void perturb(ParamSet& p, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-0.3, 0.3);
  for (size_t i = 0; i < p.specs().size(); ++i) {
    const std::string& n = p.specs()[i].name;
    const Tensor& t = p.tensors()[i];
    if (n.find("norm") == std::string::npos && n.find(".bias") == std::string::npos) continue;
    std::vector<double> v = tensor_f64(t);
    for (double& x : v) x += u(rng);
    write_tensor(t, [&](void* h) { convert(h, t.dtype, v.data(), DType::f64, t.numel()); });
  }
}

}  // namespace oomless::test
