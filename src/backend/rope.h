// RoPE's frequencies, the math every backend shares (the ref oracle and the CPU kernels alike): inv_freq
// for a head dimension under the model's RopeConfig (none, linear, llama3 and yarn scaling, as
// transformers computes them, in double).
#pragma once
#include <cstdint>

#include "backend/ops.h"

namespace oomless {

// inv_freq (D/2) in double for a head dim D, as RopeConfig describes.
void rope_inv_freq(double* inv_freq, int64_t D, const RopeConfig& cfg);

}  // namespace oomless
