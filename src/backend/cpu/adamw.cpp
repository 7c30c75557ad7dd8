#include "backend/cpu/adamw.h"

#include <cmath>

#include "core/clones.h"

namespace oomless::cpu {

namespace {

// One form of the decay, inlined into each clone below (a loop per form: choosing per element computes both).
template <bool kAfter>
__attribute__((always_inline)) inline void update(const AdamWScalars& s, float* p, const float* g, float* m, float* v,
                                                  int64_t n) {
  const float b1 = s.b1, b2 = s.b2, omb1 = s.omb1, omb2 = s.omb2, inv_bc1 = s.inv_bc1, inv_sqrt_bc2 = s.inv_sqrt_bc2;
  const float lr = s.lr, wd = s.wd, eps = s.eps, keep = s.keep;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float u = (mi * inv_bc1) / (std::sqrt(vi) * inv_sqrt_bc2 + eps);
    if constexpr (kAfter) p[i] = (p[i] - lr * u) * keep;
    else p[i] -= lr * (u + wd * p[i]);
  }
}

}  // namespace

OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void adamw_range(const AdamWScalars& s, float* p, const float* g, float* m, float* v, int64_t n) {
  if (s.after) update<true>(s, p, g, m, v, n);
  else update<false>(s, p, g, m, v, n);
}

}  // namespace oomless::cpu
