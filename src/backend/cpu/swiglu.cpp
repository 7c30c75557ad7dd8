// SwiGLU on the CPU: y = silu(g) u with silu(g) = g / (1 + exp(-g)), and its backward
//   du = dy g s,  dg = dy u s (1 + g (1 - s)),  s = 1 / (1 + exp(-g)).
// exp is exp_f32 (branch-free, so the loops vectorise; libm's expf is a call per element), in clones for AVX2
// and AVX-512 compiled without contracted multiply-adds: the same bits on every machine.
#include <omp.h>

#include <algorithm>

#include "backend/checks.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/exp_f32.h"
#include "core/clones.h"

namespace oomless {

namespace {

constexpr int64_t kChunk = 4096;  // elements a thread takes at a time

OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void swiglu_rows(float* y, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
}

OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void swiglu_grad_rows(float* dg, float* du, const float* dy, const float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + exp_f32(-g[i]));
    const float d = dy[i], gi = g[i], ui = u[i];
    du[i] = d * gi * s;
    dg[i] = d * ui * s * (1.0f + gi * (1.0f - s));
  }
}

}  // namespace

void CpuOps::swiglu_forward(Tensor out, Tensor gate, Tensor up) {
  check_elementwise("[swiglu]", {&out, &gate, &up}, DType::f32);
  const float* g = static_cast<const float*>(gate.data);
  const float* u = static_cast<const float*>(up.data);
  float* y = static_cast<float*>(out.data);
  const int64_t n = out.numel(), chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk;
    swiglu_rows(y + i0, g + i0, u + i0, std::min(kChunk, n - i0));
  }
}

void CpuOps::swiglu_backward(Tensor dgate, Tensor dup, Tensor dout, Tensor gate, Tensor up) {
  check_elementwise("[swiglu_backward]", {&dgate, &dup, &dout, &gate, &up}, DType::f32);
  const float* g = static_cast<const float*>(gate.data);
  const float* u = static_cast<const float*>(up.data);
  const float* dy = static_cast<const float*>(dout.data);
  float* dg = static_cast<float*>(dgate.data);
  float* du = static_cast<float*>(dup.data);
  const int64_t n = dout.numel(), chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk;
    swiglu_grad_rows(dg + i0, du + i0, dy + i0, g + i0, u + i0, std::min(kChunk, n - i0));
  }
}

}  // namespace oomless
