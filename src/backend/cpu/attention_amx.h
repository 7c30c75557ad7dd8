// The attention tiles of bf16 products on AMX (attention.cpp's amx path where D is a multiple of 32): one
// product over operands laid out for the tiles once, and the softmax rows that feed it in the layouts it
// reads. Compiled for AMX-BF16 and AVX512-BF16; called only where the amx GEMM path runs.
//
// Layouts (a pair word is two bf16 in one uint32, the lower index in the low half: memory order):
//   rows   bf16 (M, K) row-major with a row stride: an A operand as it is (q, dout, P, dS, and q / dout
//          transposed);
//   pairs  (K / 2, N) pair words, word (p, n) = (x[2p][n], x[2p + 1][n]): a B operand (AMX's VNNI form).
// pack_t gives the pairs of x^T (keys or values as the right side of Q K^T or dO V^T), pack_rows those of x
// (values or keys as the right side of P V or dS K).
//
// The products are the hardware's tile sums (tdpbf16ps: denormal inputs as zero, fp32 accumulation in an
// order of its own), k slices of 32 added in order: each output depends on its row of A and column of B
// only, never on the other rows, so a row's bits do not depend on the rows computed beside it.
#pragma once

#include <cstdint>

namespace oomless::attn_amx {

// out[p * ldo + j] = (x[j][2p], x[j][2p + 1]) for j < n, zero for n <= j < npad; p < D / 2. x: n rows of D
// bf16 (or f32, rounded to nearest even) at row stride ld.
void pack_t(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out, int64_t ldo);
void pack_t(const float* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out, int64_t ldo);
// out[p * D + d] = (x[2p][d], x[2p + 1][d]) for p < npad / 2, rows n and past zero.
void pack_rows(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out);
void pack_rows(const float* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out);
// out[d * ldo + i] = x[i][d] (bf16) for i < n, zero for n <= i < npad; d < D (even; ld even).
void transpose(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint16_t* out, int64_t ldo);

// The calling thread's tiles configured (every tile 16 rows of 64 bytes) and released: products run
// between the two.
void begin();
void end();
// c (M, N) = a (M, K) b, or += with acc: a rows (stride lda elements), b pairs (K / 2 rows, stride ldb
// words), c f32 (stride ldc). M and K multiples of 16 and 32, N of 32. Single-threaded, between begin and end.
void product(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c, int64_t ldc, int64_t M,
             int64_t N, int64_t K, bool acc);

// The forward's online-softmax step on a score tile S (rows x npad, stride npad; npad a multiple of 32): for
// each row r < nq, seeing the first n_r = clamp(qpos[r] - klo + 1, 0, nk) keys, with x = c s:
//   m' = max(m, max x), P = 2^(x - m') for the seen keys and 0 to npad, l = l 2^(m - m') + sum P,
//   O's row (D floats at O + r ldo) *= 2^(m - m');
// except that a row with a running max keeps it (m' = m) unless a lane of its sum over the tile (at most
// eight terms) passes 2^12, so most tiles take one pass over S and rescale nothing. l is kept as sixteen lanes a row (l16: rows x 16,
// fold_sums adds them up at the end). P goes to bf16 rows (stride npad); rows past nq, and rows that see no
// key of the tile, are zero.
void softmax_rows(const float* S, uint16_t* P, int64_t nq, int64_t rows, int64_t npad, int64_t nk, float c,
                  const int32_t* qpos, int64_t klo, float* m, float* l16, float* O, int64_t ldo, int64_t D);
// l[r] = the sum of l16's sixteen lanes of row r, for r < rows.
void fold_sums(const float* l16, int64_t rows, float* l);
// The backward's rows of a score tile S and its dP (rows x npad, stride npad; rows even): for each row
// r < nq, seeing the first n_r keys (as softmax_rows; none where lse2_r = -inf),
//   P = 2^(c s - lse2_r) for the seen keys, 0 elsewhere, dS = scale P (dP - dsum_r),
// P as pairs (rows / 2 x npad words), dS as bf16 rows and as pairs; rows past nq are zero.
void grad_rows(const float* S, const float* dP, uint32_t* Ppairs, uint16_t* dS, uint32_t* dSpairs, int64_t nq, int64_t rows,
               int64_t npad, int64_t nk, float c, const int32_t* qpos, int64_t klo, const float* lse2,
               const float* dsum, float scale);

// d[i] = s[i] in bf16 by the hardware (round to nearest even; denormals to zero, as the tiles read them).
void to_bf16(uint16_t* d, const float* s, int64_t n);
// sum a[d] b[d] over d < D (a multiple of 16), sixteen lanes then folded: the backward's rowsum(dO * O).
float dot(const float* a, const float* b, int64_t D);

}  // namespace oomless::attn_amx
