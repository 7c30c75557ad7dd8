// The per-block kernel of CpuOps::adamw8bit_step (Ops::adamw8bit_step has the arithmetic): one block of
// at most kAdam8Block elements, its codes and its two scales updated in place. Two implementations with
// the same bits: portable C++, and AVX2 + FMA (vector gathers of the maps and the lookup; a block with a
// non-finite moment is handed to the portable one), chosen once from cpuid.
#pragma once
#include <cstdint>

namespace oomless::cpu {

struct Adam8Scalars {
  float b1, b2, omb1, omb2;  // float(beta), float(1 - beta)
  float c2;                  // sqrt(1 - beta2^t)
  float step_size;           // -lr / (1 - beta1^t)
  float eps;
  float keep;                // 1 - lr * wd
  bool decay;                // wd > 0
};

void adam8_block_generic(const Adam8Scalars& s, float* p, const float* g, uint8_t* mc, float* ma, uint8_t* vc,
                         float* va, int64_t len);
// Needs AVX2 and FMA (adam8_avx2_supported()).
void adam8_block_avx2(const Adam8Scalars& s, float* p, const float* g, uint8_t* mc, float* ma, uint8_t* vc,
                      float* va, int64_t len);
bool adam8_avx2_supported();
// The one CpuOps uses: avx2 where supported (and not disabled by OOMLESS_ISA=generic), else generic.
using Adam8Block = void (*)(const Adam8Scalars&, float*, const float*, uint8_t*, float*, uint8_t*, float*, int64_t);
Adam8Block adam8_block();

}  // namespace oomless::cpu
