// AdamW's elementwise update over a range, in clones for AVX-512, AVX2 and the baseline that give the same
// bits (the file is built without fused multiply-adds; every element's arithmetic is its own).
#pragma once
#include <cstdint>

namespace oomless::cpu {

struct AdamWScalars {
  float b1, b2, omb1, omb2;   // beta1, beta2, 1 - beta1, 1 - beta2
  float inv_bc1, inv_sqrt_bc2;  // 1 / (1 - beta1^t), 1 / sqrt(1 - beta2^t)
  float lr, wd, eps, keep;    // keep = 1 - lr wd (decay after the update)
  bool after;                 // decay after the update (p - lr u) keep, else p - lr (u + wd p)
};

// p, m, v updated in place from g over [0, n).
void adamw_range(const AdamWScalars& s, float* p, const float* g, float* m, float* v, int64_t n);

}  // namespace oomless::cpu
