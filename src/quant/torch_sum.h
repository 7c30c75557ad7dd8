// torch.sum / torch.mean of a contiguous float32 vector on the CPU, adding in exactly torch's order, so
// that bitsandbytes' double-quantisation offset (absmax.mean()) comes out bit-identical.
//
// torch 2.x (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum) sums a float32 row in float32:
//   - the row is read as V = n / W vectors of W lanes (W = 8 with the AVX2 kernels) and those vectors
//     are summed lane-wise by row_sum: four interleaved accumulators (vector i goes to accumulator
//     i % 4 for i < 4 * (V / 4)), each a 4-level cascade (multi_row_sum: level 0 takes 2^p consecutive
//     elements, p = max(4, ceil(log2(V / 4)) / 4), then carries into level 1, and so on), leftover
//     vectors added to accumulator 0, then accumulators 1..3 added to it;
//   - the n % W scalar tail is summed from 0 in order, then the W lanes are added to it one by one;
//   - a row shorter than W is summed the same way as scalars (row_sum with W = 1);
//   - the result is added to the output's 0.
// With T > 1 threads and n >= 32768 (at::internal::GRAIN_SIZE) the vector is cut into
// min(T, ceil(n / 32768)) chunks of ceil(n / chunks) elements, each summed as above into its slot of a
// T-element buffer (unused slots stay 0), and the buffer is summed the same way.
// torch.mean on the CPU is that sum divided by n (float32 division).
// Checked against torch 2.15 with W = 8 for T = 1, 2, 3, 16 (tests/golden/nf4); torch's AVX-512 kernels
// use W = 16, which `lanes` allows but no golden has checked.
#pragma once
#include <cstdint>

namespace oomless {

float torch_sum_f32(const float* x, int64_t n, int threads = 1, int lanes = 8);
float torch_mean_f32(const float* x, int64_t n, int threads = 1, int lanes = 8);

}  // namespace oomless
