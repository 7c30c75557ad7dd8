// The AMX-BF16 micro-kernel of GemmIsa::amx (gemm.h), compiled for AMX and run only on a CPU that has it
// and whose kernel lets this process use tile data (gemm_isa.cpp asks once: arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
//
// A tile is 16 rows of 64 bytes. Every tile is configured 16 x 64 (palette 1) by amx_begin, on each thread
// of each product (other libraries, oneDNN among them, release the tiles after their own kernels, which
// clears the configuration), and released by amx_end, so a thread switch saves no tile state after it. The
// micro-kernel computes up to 32 x 32 outputs of C in four fp32 accumulator tiles (tmm0..3: rows 0-15 /
// 16-31 times columns 0-15 / 16-31), from two A tiles (tmm4, tmm5: 16 rows x 16 pair words each) and two B
// tiles (tmm6, tmm7: 16 pair rows x 16 columns, one pair panel of the blocked GEMM each), one `tdpbf16ps`
// per accumulator and 32 k. The operands are the pair words of the AVX512-BF16 kernels (k in the high
// half, k + 1 in the low one) in both A and B, so the same B pair panels serve both paths:
//   A: row i of the block at a + i * lda words, pair p at [p] (gemm_blocked.cpp packs it, rows past the
//      product's and pairs past the k slice zero);
//   B: pair p, column j at b[p * 16 + j]; the second panel at b + b_second.
// The instruction's sum order inside a tile product is the hardware's: the results are not the bits of
// the vdpbf16ps or widening kernels (within the fp32 rounding of a 32-term sum), but they are fixed for a
// given shape: tiles depend only on the shape and each k slice is added in order, so the GEMM stays
// bitwise the same for any thread count. With acc the accumulators start from C (the previous k slices'
// sum), otherwise from zero. Like vdpbf16ps the instruction treats denormal inputs as zero and flushes
// denormal results.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "backend/cpu/gemm_kernel.h"

namespace oomless::gemm_detail {

bool amx_os_permits() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// MT, NT: 16-row and 16-column tiles of C used (1 or 2 each).
template <int MT, int NT>
__attribute__((target("amx-tile,amx-bf16,avx512f,prfchw"))) void micro(const AmxMicro& u) {
  const bool full = u.m == 16 * MT && u.n == 16 * NT;
  alignas(64) float scratch[kMrAmx * 32];
  float* cp = u.c;
  int64_t ld = u.ldc;
  if (!full) {  // a partial tile: through a 32 x 32 buffer
    cp = scratch;
    ld = 32;
    if (u.acc) {
      std::memset(scratch, 0, sizeof scratch);
      for (int i = 0; i < u.m; ++i) std::memcpy(scratch + i * 32, u.c + i * u.ldc, sizeof(float) * u.n);
    }
  }
  const int64_t cs = ld * 4;
  // C's lines asked for in the owned state before the tiles are computed: the stores at the end otherwise
  // wait on reads for ownership (C is written once a k slice, from lines no earlier tile touched) and stall
  // the store buffer; at K = 576 that wait was most of a tile's time (measured, docs/BENCHMARKS.md).
  if (full)
    for (int i = 0; i < 16 * MT; ++i) {
      __builtin_prefetch(cp + i * ld, 1, 3);
      if constexpr (NT == 2) __builtin_prefetch(cp + i * ld + 16, 1, 3);
    }
  tile_barrier();
  if (u.acc) {
    _tile_loadd(0, cp, cs);
    if constexpr (NT == 2) _tile_loadd(1, cp + 16, cs);
    if constexpr (MT == 2) _tile_loadd(2, cp + 16 * ld, cs);
    if constexpr (MT == 2 && NT == 2) _tile_loadd(3, cp + 16 * ld + 16, cs);
  } else {
    _tile_zero(0);
    if constexpr (NT == 2) _tile_zero(1);
    if constexpr (MT == 2) _tile_zero(2);
    if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  }
  const uint32_t* a0 = u.a;
  const uint32_t* a1 = u.a + 16 * u.lda;
  const uint32_t* b0 = u.b;
  const uint32_t* b1 = u.b + u.b_second;
  const int64_t as = u.lda * 4;
  for (int64_t p = 0; p < u.kpp; p += 16) {
    _tile_loadd(4, a0 + p, as);
    _tile_loadd(6, b0 + p * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) {
      _tile_loadd(7, b1 + p * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MT == 2) {
      _tile_loadd(5, a1 + p, as);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cp, cs);
  if constexpr (NT == 2) _tile_stored(1, cp + 16, cs);
  if constexpr (MT == 2) _tile_stored(2, cp + 16 * ld, cs);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, cp + 16 * ld + 16, cs);
  tile_barrier();
  if (!full)
    for (int i = 0; i < u.m; ++i) std::memcpy(u.c + i * u.ldc, scratch + i * 32, sizeof(float) * u.n);
}

// Every tile 16 rows of 64 bytes. In static storage: GCC 12's _tile_loadconfig tells the compiler that it
// reads only the first 8 bytes, so a configuration built on the stack can lose its other stores (seen).
constexpr TileConfig kTiles = [] {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  return cfg;
}();

}  // namespace

__attribute__((target("amx-tile"))) void amx_begin() { _tile_loadconfig(&kTiles); }

__attribute__((target("amx-tile"))) void amx_end() { _tile_release(); }

void micro_amx(const AmxMicro& u) {
  const bool two_rows = u.m > 16, two_cols = u.n > 16;
  if (two_rows) return two_cols ? micro<2, 2>(u) : micro<2, 1>(u);
  return two_cols ? micro<1, 2>(u) : micro<1, 1>(u);
}

}  // namespace oomless::gemm_detail
