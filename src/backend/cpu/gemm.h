// The one GEMM interface of the CPU backend. Every matrix product on the CPU goes through it, so a
// faster kernel can replace this one without touching callers. run() is a blocked GotoBLAS-style GEMM
// (gemm_blocked.cpp), tile() a single-threaded one for use inside parallel regions (gemm_tile.cpp).
//
// Row-major: c (M, N) [+]= op(a) (M, K) . op(b) (K, N), fp32 accumulation. a is stored (M, K) with
// leading dimension lda (or (K, M) when ta), b is (K, N) with ldb (or (N, K) when tb), c has ldc.
// a and b are both f32 or both bf16 (ab); c is f32. With b_as_bf16, a is bf16 and b is f32 rounded to
// bf16 as it is packed: the product of the bf16 copy of b, without the copy.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace oomless {

class Arena;

// The instruction set the CPU GEMMs (and the attention and cross-entropy tiles, which use the same
// micro-kernels) run on:
//   generic  portable C++ (no vector intrinsics);
//   avx2     AVX2 + FMA, 6x16 tiles of 8-wide vectors; bf16 operands widened to f32 while packing;
//   avx512   AVX-512F 6x16 tiles of 16-wide vectors (the same f32 bits as avx2), and with AVX512-BF16
//            bf16 operands multiplied as they are (vdpbf16ps on k pairs; see gemm_avx512.cpp) where
//            that instruction is the faster: on some CPUs (the Emerald Rapids Xeon measured) it adds half
//            the FLOPs a cycle two FMA pipes do, and bf16 is widened while packing instead (below);
//   amx      avx512's kernels, and bf16 products of two rows or more on AMX-BF16 tiles (32 x 32 outputs
//            from tdpbf16ps on the same k pairs; gemm_amx.cpp): not the other paths' bf16 bits, but
//            bitwise the same for any thread count.
// Chosen at first use: the best the CPU and the OS's saved register state (XCR0) allow, or the one
// OOMLESS_ISA names (generic, avx2, avx512, amx; a path the CPU lacks is an error). Every path computes
// each output's sum in a fixed order (ascending k, or the tile instruction's over fixed k slices), so
// results are bitwise the same for any thread count on each path.
enum class GemmIsa { generic, avx2, avx512, amx };
const char* gemm_isa_name(GemmIsa isa);
// "avx2", ... ; an unknown name is an error naming the accepted ones.
GemmIsa parse_gemm_isa(std::string_view name);
bool gemm_isa_supported(GemmIsa isa);
std::vector<GemmIsa> supported_gemm_isas();  // lowest first
GemmIsa gemm_isa();                          // the current path (reads OOMLESS_ISA on first use)
// Switches the path for later products (tests and benches compare paths); an unsupported one is an
// error. Not while a product runs.
void set_gemm_isa(GemmIsa isa);
// The current path for logs: "avx512 (f32 zmm, bf16 vdpbf16ps)".
std::string gemm_path();
// The avx512 path's bf16 products of two rows or more (one-row products with B stored (K, N), bound by reading
// B, and the amx path keep their pair kernels; one-row x W^T reads B's rows in fp32 lanes on every path): in
// vdpbf16ps k pairs, or widened to f32 while packing and multiplied by
// FMAs. The same sums either way (a bf16 product is exact in fp32, each output's chain ascends in k), but
// for the instruction's denormal handling (inputs read as zero, results flushed). Chosen at first use by
// OOMLESS_BF16_GEMM=pairs|widened, or else by measurement: bf16_pair_speed() (the instruction's FLOPs a
// cycle over FMA's, from register-resident loops timed in turn, best of several) above 1 takes pairs.
// Pairs need AVX512-BF16.
bool gemm_bf16_pairs();
void set_gemm_bf16_pairs(bool pairs);  // tests and benches; an error without AVX512-BF16
double bf16_pair_speed();              // measured once (0 without AVX512-BF16)

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
  // The packing buffers run() takes for `s` with `threads` threads: {shared B panel, the threads' A blocks}.
  static std::array<size_t, 2> pack_bytes(const GemmShape& s, int64_t threads);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oomless
