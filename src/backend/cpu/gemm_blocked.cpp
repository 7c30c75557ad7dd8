// The blocked multi-threaded GEMM behind Gemm::run, deterministic for any thread count by construction.
//
// GotoBLAS/BLIS loop nest, all in one OpenMP parallel region:
//   for each column panel of C (up to kNcMax wide):
//     for each k slice (up to kKcMax deep), in increasing k:
//       pack B's (kc x nc) panel once into the shared buffer, 16-column micro-panels split over the
//       threads (static), then a barrier;
//       the (row block x column range) units of the panel split over the threads (static): a thread
//       packs its row block of A (mc x kc, 6-row strips) into its own buffer and runs the 6x16
//       micro-kernel (gemm_kernel.h) over the unit's strips and micro-panels; then a barrier.
// The first k slice overwrites C (unless accumulate), later slices add to it. Each output element is
// one micro-kernel sum per k slice (k ascending) added to C in slice order, whichever thread computes
// it, and the slices depend only on K, so the bits do not depend on the number of threads. The units
// themselves also depend only on the shape (never on the thread count).
//
// Sizes for this CPU class (32 KiB L1d, 1 MiB L2 per core, a large shared L3): a kc x 16 B
// micro-panel (24 KiB at kc = 384) stays in L1 while a strip of the A block streams from L2
// (mc x kc <= 192 x 384 floats = 288 KiB); the packed B panel (<= 384 x 4096 floats = 6 MiB) lives in
// L3. kc = 384 rather than 256 means fewer passes over C (each k slice reads and writes it once). The
// k slices, column panels and row blocks are balanced (equal sizes, rounded to the micro tile) so
// that no tiny remainder block is left, and there are at least six units per panel where the rows
// allow (a panel with fewer row blocks also splits its columns), so that 1, 2, 3 or 6 threads share
// the work evenly. Products of at most 24 rows take a separate loop nest without shared packing
// (run_skinny).
//
// Transposes, leading dimensions, bf16 -> f32 widening and the rounding of an f32 B read as bf16 all
// happen in the packing, so neither a transposed A nor bf16 operands cost an extra pass over memory.
#include <omp.h>

#include <algorithm>
#include <type_traits>

#include "backend/cpu/gemm_kernel.h"
#include "core/dtype.h"

namespace oomless::gemm_detail {

namespace {

constexpr int64_t kKcMax = 384;       // k slice
constexpr int64_t kMcMax = 192;       // rows of an A block (a multiple of 6)
constexpr int64_t kNcMax = 4096;      // columns of a B panel (a multiple of 16)
constexpr int64_t kUnits = 6;         // units per panel at least, where the shape allows
constexpr int64_t kSkinnyStrips = 4;  // products of up to 24 rows take the skinny loop nest
constexpr int64_t kSkinnyUnits = 12;  // column ranges of a skinny product
constexpr int64_t kSpare = 8;         // floats past each packed A block that strip packing may spill into

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The partition of one product, from the shape alone.
struct Plan {
  int64_t kc = 0, nk = 0;          // k slice depth and count
  int64_t nc = 0, nj = 0;          // column panel width and count
  int64_t strips = 0, nbm = 0;     // 6-row strips of C, row blocks
  int64_t max_strips = 0;          // strips of the largest row block
  bool skinny = false;             // few rows: the skinny loop nest (run_skinny)
};

Plan make_plan(const GemmShape& s) {
  Plan p;
  p.nk = cdiv(s.K, kKcMax);
  p.kc = cdiv(s.K, p.nk);
  p.nj = cdiv(s.N, kNcMax);
  p.nc = cdiv(cdiv(s.N, p.nj), kNr) * kNr;
  p.strips = cdiv(s.M, kMr);
  p.nbm = std::min(p.strips, cdiv(cdiv(s.M, kMcMax), kUnits) * kUnits);
  p.max_strips = cdiv(p.strips, p.nbm);
  p.skinny = p.strips <= kSkinnyStrips;
  return p;
}

// Sixteen bf16 (or f32-as-bf16) values of each of kc rows, widened into one kc x 16 panel.
template <class T>
__attribute__((target("avx2,fma"))) void widen_rows_avx2(float* dst, const T* src, int64_t ld, int64_t kc) {
  for (int64_t k = 0; k < kc; ++k) {
    _mm256_storeu_ps(dst + k * kNr, load8(src + k * ld));
    _mm256_storeu_ps(dst + k * kNr + 8, load8(src + k * ld + 8));
  }
}

// A position in a block-quantised B (the "pointer" the packing loops offset): element `off` of the
// row-major (rows, ld) matrix starting at row qrow0 of *q.
struct QuantB {
  const QuantMatrix* q = nullptr;
  int64_t qrow0 = 0;
  int64_t off = 0;
  bool round = false;  // read as bf16
  QuantB operator+(int64_t d) const { return {q, qrow0, off + d, round}; }
};

// One kc x 16 micro-panel of B from b(k, j) = src[k * ld + j] (tb false) or src[j * ld + k] (tb
// true), columns j < n, zero past n.
template <class T>
void pack_b_micro(float* dst, const T* src, int64_t ld, bool tb, int64_t kc, int64_t n, bool avx2);

// A quantised B: the panel's rows (tb: its n columns are n rows of the matrix, kc long; otherwise kc
// rows, n long) dequantised into a small buffer, then packed as f32, so the packed panel holds exactly
// the dequantised values (bf16-rounded when read as bf16).
void pack_b_micro(float* dst, const QuantB& src, int64_t ld, bool tb, int64_t kc, int64_t n, bool avx2) {
  float tmp[kNr * kKcMax];
  const int64_t row = src.qrow0 + src.off / ld, col = src.off % ld;
  const int64_t len = tb ? kc : n, count = tb ? n : kc;
  for (int64_t i = 0; i < count; ++i) src.q->dequant_row(*src.q, row + i, col, len, tmp + i * len);
  if (src.round)
    for (int64_t i = 0; i < count * len; ++i) tmp[i] = round_to_bf16(tmp[i]);
  pack_b_micro(dst, tmp, len, tb, kc, n, avx2);
}

template <class T>
void pack_b_micro(float* dst, const T* src, int64_t ld, bool tb, int64_t kc, int64_t n, bool avx2) {
  if constexpr (std::is_same_v<T, float>) {
    if (tb) kernels().pack_bt(dst, src, ld, kc, n);
    else pack_b_panel(dst, src, ld, kc, n);
  } else if (avx2) {
    if (tb) {
      pack_bt_avx2(dst, src, ld, kc, n);
    } else if (n == kNr) {
      widen_rows_avx2(dst, src, ld, kc);
    } else {
      for (int64_t k = 0; k < kc; ++k)
        for (int j = 0; j < kNr; ++j) dst[k * kNr + j] = j < n ? widen(src[k * ld + j]) : 0.0f;
    }
  } else if (tb) {
    for (int64_t j = 0; j < kNr; ++j)
      for (int64_t k = 0; k < kc; ++k) dst[k * kNr + j] = j < n ? widen(src[j * ld + k]) : 0.0f;
  } else if (n == kNr) {
    for (int64_t k = 0; k < kc; ++k)
      for (int j = 0; j < kNr; ++j) dst[k * kNr + j] = widen(src[k * ld + j]);
  } else {
    for (int64_t k = 0; k < kc; ++k)
      for (int j = 0; j < kNr; ++j) dst[k * kNr + j] = j < n ? widen(src[k * ld + j]) : 0.0f;
  }
}

// One full 6-row strip of a stored (M, K), k in [0, kc): eight k at a time through an 8x8 register
// transpose (rows 6 and 7 zero). Each 8-wide store of a k row spills two zeros into the next k row's
// slot, which the next store overwrites; the last one spills past the strip (buffers keep 8 spare
// floats, see blocked_sizes).
template <class T>
__attribute__((target("avx2,fma"))) void pack_a_strip_avx2(float* d, const T* src, int64_t ld, int64_t kc) {
  int64_t k = 0;
  for (; k + 8 <= kc; k += 8) {
    __m256 r[8];
    for (int i = 0; i < kMr; ++i) r[i] = load8(src + i * ld + k);
    r[6] = r[7] = _mm256_setzero_ps();
    store_transposed8(d + k * kMr, kMr, r);
  }
  for (; k < kc; ++k)
    for (int i = 0; i < kMr; ++i) d[k * kMr + i] = widen(src[i * ld + k]);
}

// A block rows [0, m) of a(i, k) = src[i * ld + k] (ta false) or src[k * ld + i] (ta true), k < kc,
// as 6-row strips: strip t at dst + 6t * kc, element (i, k) at [k * 6 + i]. Rows past m in the last
// strip are left unset; the micro-kernel for fewer rows never reads them.
template <class T>
void pack_a_block(float* dst, const T* src, int64_t ld, bool ta, int64_t kc, int64_t m, bool avx2) {
  for (int64_t i0 = 0; i0 < m; i0 += kMr) {
    float* d = dst + i0 * kc;
    const int64_t rows = std::min<int64_t>(kMr, m - i0);
    if (ta) {
      const T* sp = src + i0;
      if (rows == kMr) {
        for (int64_t k = 0; k < kc; ++k)
          for (int i = 0; i < kMr; ++i) d[k * kMr + i] = widen(sp[k * ld + i]);
      } else {
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t i = 0; i < rows; ++i) d[k * kMr + i] = widen(sp[k * ld + i]);
      }
    } else if (avx2 && rows == kMr) {
      pack_a_strip_avx2(d, src + i0 * ld, ld, kc);
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        const T* row = src + (i0 + i) * ld;
        for (int64_t k = 0; k < kc; ++k) d[k * kMr + i] = widen(row[k]);
      }
    }
  }
}

// Few rows: B is read once and barely reused, so sharing a packed panel buys nothing. The columns are
// cut into ranges (from the shape) spread over the threads, and each thread packs every kc x 16
// micro-panel of its range into a private buffer just before the micro-kernel uses it, with no barrier
// at all. The k slices and micro-kernel are those of the blocked loop nest, so the bits are too.
// BP: a pointer to B's elements (f32, bf16, f32-as-bf16) or a QuantB position.
template <class TA, class BP>
void run_skinny(const GemmShape& s, const Plan& p, const TA* a, BP b, float* c, float* work) {
  const Kernels& kern = kernels();
  const bool avx2 = kern.avx2;
  const int64_t panels = cdiv(s.N, kNr);
  const int64_t units = std::min(panels, kSkinnyUnits);
  const size_t stride = static_cast<size_t>(p.strips * kMr * p.kc + kSpare + kNr * p.kc);
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    float* ap = work + static_cast<size_t>(omp_get_thread_num()) * stride;
    float* bp = ap + p.strips * kMr * p.kc + kSpare;
    const int64_t q0 = u * panels / units, q1 = (u + 1) * panels / units;
    for (int64_t kp = 0; kp < p.nk; ++kp) {
      const int64_t k0 = kp * p.kc;
      const int64_t kc = std::min(p.kc, s.K - k0);
      pack_a_block(ap, s.ta ? a + k0 * s.lda : a + k0, s.lda, s.ta, kc, s.M, avx2);
      Micro m{};
      m.ras = 1;
      m.cas = kMr;
      m.ldc = s.ldc;
      m.kc = kc;
      m.acc = s.accumulate || kp > 0;
      m.b = bp;
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t jq = q * kNr;
        m.n = static_cast<int>(std::min<int64_t>(kNr, s.N - jq));
        pack_b_micro(bp, s.tb ? b + jq * s.ldb + k0 : b + k0 * s.ldb + jq, s.ldb, s.tb, kc, m.n, avx2);
        for (int64_t r = 0; r < s.M; r += kMr) {
          m.a = ap + r * kc;
          m.c = c + r * s.ldc + jq;
          kern.packed[std::min<int64_t>(kMr, s.M - r)](m);
        }
      }
    }
  }
}

template <class TA, class BP>
void run_blocked(const GemmShape& s, const TA* a, BP b, float* c, float* bpack, float* apack) {
  const Plan p = make_plan(s);
  if (p.skinny) return run_skinny(s, p, a, b, c, apack);
  const Kernels& kern = kernels();
  const bool avx2 = kern.avx2;
  const size_t a_stride = static_cast<size_t>(p.max_strips * kMr * p.kc + kSpare);
#pragma omp parallel
  {
    float* ap = apack + static_cast<size_t>(omp_get_thread_num()) * a_stride;
    for (int64_t jp = 0; jp < p.nj; ++jp) {
      const int64_t j0 = jp * p.nc;
      if (j0 >= s.N) break;
      const int64_t nc = std::min(p.nc, s.N - j0);
      const int64_t panels = cdiv(nc, kNr);
      const int64_t nbn = std::min(panels, cdiv(kUnits, p.nbm));
      const int64_t units = p.nbm * nbn;
      for (int64_t kp = 0; kp < p.nk; ++kp) {
        const int64_t k0 = kp * p.kc;
        const int64_t kc = std::min(p.kc, s.K - k0);
        const bool acc = s.accumulate || kp > 0;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; ++q) {
          const int64_t jq = j0 + q * kNr;
          const BP src = s.tb ? b + jq * s.ldb + k0 : b + k0 * s.ldb + jq;
          pack_b_micro(bpack + q * kNr * kc, src, s.ldb, s.tb, kc, std::min<int64_t>(kNr, s.N - jq), avx2);
        }
        int64_t packed_bm = -1;  // the row block now in ap (units of one block are consecutive)
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
          const int64_t bm = u / nbn, bn = u % nbn;
          const int64_t s0 = bm * p.strips / p.nbm, s1 = (bm + 1) * p.strips / p.nbm;
          const int64_t r0 = s0 * kMr, r1 = std::min(s.M, s1 * kMr);
          if (bm != packed_bm) {
            const TA* src = s.ta ? a + k0 * s.lda + r0 : a + r0 * s.lda + k0;
            pack_a_block(ap, src, s.lda, s.ta, kc, r1 - r0, avx2);
            packed_bm = bm;
          }
          const int64_t q0 = bn * panels / nbn, q1 = (bn + 1) * panels / nbn;
          Micro m{};
          m.ras = 1;
          m.cas = kMr;
          m.ldc = s.ldc;
          m.kc = kc;
          m.acc = acc;
          for (int64_t q = q0; q < q1; ++q) {
            const int64_t jq = j0 + q * kNr;
            m.n = static_cast<int>(std::min<int64_t>(kNr, s.N - jq));
            m.b = bpack + q * kNr * kc;
            for (int64_t r = r0; r < r1; r += kMr) {
              m.a = ap + (r - r0) * kc;
              m.c = c + r * s.ldc + jq;
              kern.packed[std::min<int64_t>(kMr, r1 - r)](m);
            }
          }
        }
      }
    }
  }
}

}  // namespace

BlockedSizes blocked_sizes(const GemmShape& s) {
  const Plan p = make_plan(s);
  BlockedSizes z;
  z.b_floats = static_cast<size_t>(p.kc * cdiv(p.nc, kNr) * kNr);
  z.a_floats_per_thread = static_cast<size_t>(p.max_strips * kMr * p.kc + kSpare);
  if (p.skinny) {
    z.b_floats = 0;
    z.a_floats_per_thread = static_cast<size_t>(p.strips * kMr * p.kc + kSpare + kNr * p.kc);
  }
  return z;
}

void gemm_blocked(const GemmShape& s, const void* a, const void* b, float* c, float* bpack, float* apack) {
  if (s.b_quant) {
    const QuantB qb{s.b_quant, s.b_qrow0, 0, s.b_as_bf16};
    if (s.ab == DType::bf16) run_blocked(s, static_cast<const uint16_t*>(a), qb, c, bpack, apack);
    else run_blocked(s, static_cast<const float*>(a), qb, c, bpack, apack);
  } else if (s.b_as_bf16)
    run_blocked(s, static_cast<const uint16_t*>(a), static_cast<const F32AsBf16*>(b), c, bpack, apack);
  else if (s.ab == DType::bf16)
    run_blocked(s, static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), c, bpack, apack);
  else
    run_blocked(s, static_cast<const float*>(a), static_cast<const float*>(b), c, bpack, apack);
}

}  // namespace oomless::gemm_detail
