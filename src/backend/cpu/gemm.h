// The one GEMM interface of the CPU backend. Every matrix product on the CPU goes through it, so a
// faster kernel can replace this one without touching callers. run() is a blocked GotoBLAS-style GEMM
// (gemm_blocked.cpp), tile() a single-threaded one for use inside parallel regions (gemm_tile.cpp).
//
// Row-major: c (M, N) [+]= op(a) (M, K) . op(b) (K, N), fp32 accumulation. a is stored (M, K) with
// leading dimension lda (or (K, M) when ta), b is (K, N) with ldb (or (N, K) when tb), c has ldc.
// a and b are both f32 or both bf16 (ab); c is f32. With b_as_bf16, a is bf16 and b is f32 rounded to
// bf16 as it is packed: the product of the bf16 copy of b, without the copy.
#pragma once
#include <cstdint>
#include <memory>

#include "core/dtype.h"
#include "core/tensor.h"

namespace oomless {

class Arena;

struct GemmShape {
  int64_t M = 0, N = 0, K = 0;
  bool ta = false, tb = false;
  int64_t lda = 0, ldb = 0, ldc = 0;  // 0: the packed default (K or M for a, N or K for b, N for c)
  DType ab = DType::f32;
  bool b_as_bf16 = false;
  bool accumulate = false;
  // b block-quantised (b pointer unused): the rows b_qrow0.. of *b_quant, dequantised while packing
  // (rounded to bf16 when b_as_bf16); a is f32 or bf16 (ab). ldb is the matrix's cols.
  const QuantMatrix* b_quant = nullptr;
  int64_t b_qrow0 = 0;
};

class Gemm {
 public:
  // Scratchpads come from `workspace` (Category::workspace).
  explicit Gemm(Arena& workspace);
  ~Gemm();
  // Multi-threaded (the OpenMP pool) product, bitwise the same for any thread count; packing buffers
  // come from the workspace arena and are kept between calls.
  void run(const GemmShape& s, const void* a, const void* b, float* c);
  // Single-threaded product for use inside an OpenMP parallel region (tiles of attention and
  // cross-entropy): f32 only, no allocation, deterministic.
  static void tile(const GemmShape& s, const float* a, const float* b, float* c);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oomless
