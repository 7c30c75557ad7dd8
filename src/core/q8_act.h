// An activation row quantised to 8 bits, for integer products with block-quantised weights (the one-row
// products of decoding over a GGUF's Q4_0 / Q4_1 / Q8_0 blocks: QuantMatrix::dot_rows_q8). The row is
// cut in blocks of 32 elements, each with
//   d = amax / 127 (f32, amax the block's largest |x|),
//   q[k] = x[k] * (127 / amax) rounded to the nearest integer, ties to even (|q| <= 127),
//   s = d * (sum of the block's q) (f32): the term a block's offset (Q4_1's min, Q4_0's -8 d) multiplies.
// The codes are llama.cpp's Q8_0 / Q8_1 activations; the scales stay f32 (ggml rounds them to f16).
// A block of zeros (or of values below about 1e-36, whose 127 / amax overflows) has all codes 0; a block
// holding a NaN or an infinity gets d = NaN (and q = 0), so that its products are NaN, as the f32
// product's would be.
#pragma once
#include <cstddef>
#include <cstdint>

namespace oomless {

constexpr int64_t kQ8Block = 32;

struct Q8Act {
  int8_t* q = nullptr;  // the codes, blocks * 32
  float* d = nullptr;   // a scale a block
  float* s = nullptr;   // d * sum(q) a block
  int64_t blocks = 0;
};

// Bytes a row of n elements takes (n a multiple of 32), and that row laid out in `mem` (4-byte aligned).
size_t q8_act_bytes(int64_t n);
Q8Act q8_act_at(void* mem, int64_t n);
// Quantises x[0, 32 a.blocks) into a: the AVX2 form where the CPU has it (not under OOMLESS_ISA=generic),
// else plain C++; both give the same bits.
void quantise_q8_act(const float* x, Q8Act a);
// The plain C++ form (tests compare the vector form with it).
void quantise_q8_act_scalar(const float* x, Q8Act a);

}  // namespace oomless
