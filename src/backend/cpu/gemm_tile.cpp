// Gemm::tile: a single-threaded f32 GEMM for small and medium products inside OpenMP regions
// (attention tiles, cross-entropy tiles). No heap allocation, deterministic, all transposes.
//
// Structure (a reduced GotoBLAS/BLIS loop nest):
//   for each k block of up to kKc:          C (+)= A[:, kb] . B[kb, :]   (the first block overwrites
//     for each column block of up to kNc:                                   unless accumulate)
//       for each 16-wide column panel:      B panel packed on the stack, kc x 16 contiguous floats
//         for each 6-row strip of C:        the 6x16 micro-kernel, 12 accumulators in registers
//   (on AVX-512, two adjacent panels at a time: the 6 x 32 tile_wide kernel, whose 12 chains keep both FMA
//   pipes busy where the 6 x 16 zmm kernel's six cannot; each output's chain is the same)
//
// B is packed (transposed when b is stored (N, K), zero-padded past N): the panel stays in L1 while every
// strip of C uses it, and read in place at a power-of-two leading dimension its rows would fall into a few
// L1 sets and be evicted between strips (2x slower for the attention shapes). Where C has one strip (a
// decode step's P V: the group's few query rows) nothing is reused, and a full panel of a B stored (K, N)
// is read in place, row stride and all (Micro::bs).
// A is never packed: the micro-kernel broadcasts a(i, k) straight from memory, reading row i of a
// stored (M, K) or column i of a stored (K, M), which stays in L2 across the panels.
//
// The micro-kernel and the packing routines live in gemm_kernel.h (shared with the blocked Gemm::run).
// The k order of each output's sum is fixed (k ascending within a block, blocks in order).
#include <algorithm>

#include "backend/cpu/gemm.h"
#include "backend/cpu/gemm_kernel.h"
#include "core/error.h"

namespace oomless {

namespace {

using namespace gemm_detail;

constexpr int64_t kKc = 256;      // k block
constexpr int64_t kNc = 64;       // columns packed at once: kKc * kNc floats = 64 KiB of stack

}  // namespace

void Gemm::tile(const GemmShape& s, const float* a, const float* b, float* c) {
  OOM_CHECK(s.ab == DType::f32, "[gemm] Gemm::tile takes f32 operands, got ", dtype_name(s.ab));
  OOM_CHECK(s.M >= 0 && s.N >= 0 && s.K >= 0, "[gemm] negative shape ", s.M, "x", s.N, "x", s.K);
  const int64_t M = s.M, N = s.N, K = s.K;
  const int64_t lda = s.lda ? s.lda : (s.ta ? M : K);
  const int64_t ldb = s.ldb ? s.ldb : (s.tb ? K : N);
  const int64_t ldc = s.ldc ? s.ldc : N;
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!s.accumulate)
      for (int64_t i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return;
  }
  const Kernels& kern = kernels();
  const MicroFn* micro = kern.micro[s.ta ? 1 : 0];
  const MicroFn* wide = kern.tile_wide[s.ta ? 1 : 0][1] ? kern.tile_wide[s.ta ? 1 : 0] : nullptr;
  const int64_t ras = s.ta ? 1 : lda, cas = s.ta ? lda : 1;
  alignas(64) float packed[kKc * kNc];

  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool acc = s.accumulate || k0 > 0;
    const float* ak = a + k0 * cas;
    for (int64_t n0 = 0; n0 < N; n0 += kNc) {
      const int64_t nc = std::min(kNc, N - n0);
      if (s.tb) kern.pack_bt(packed, b + n0 * ldb + k0, ldb, kc, nc);
      for (int64_t p = 0; p < nc;) {
        const bool two = wide && nc - p > kNr;  // two panels at once
        const int64_t width = two ? 2 * kNr : kNr;
        const int n = static_cast<int>(std::min(width, nc - p));
        Micro u{};
        u.ras = ras;
        u.cas = cas;
        u.ldc = ldc;
        u.kc = kc;
        u.n = n;
        u.acc = acc;
        u.b2 = kNr * kc;
        if (s.tb) {
          u.b = packed + p * kc;
        } else if (n == width && M <= kMr) {  // one strip, full panels: B's rows in place (the same values, order)
          u.b = b + k0 * ldb + n0 + p;
          u.bs = ldb;
          u.b2 = kNr;
        } else {
          pack_b_panel(packed, b + k0 * ldb + n0 + p, ldb, kc, std::min(n, static_cast<int>(kNr)));
          if (two) pack_b_panel(packed + kNr * kc, b + k0 * ldb + n0 + p + kNr, ldb, kc, n - kNr);
          u.b = packed;
        }
        const MicroFn* f = two ? wide : micro;
        for (int64_t i0 = 0; i0 < M; i0 += kMr) {
          const int m = static_cast<int>(std::min<int64_t>(kMr, M - i0));
          u.a = ak + i0 * ras;
          u.c = c + i0 * ldc + n0 + p;
          f[m](u);
        }
        p += n;
      }
    }
  }
}

}  // namespace oomless
