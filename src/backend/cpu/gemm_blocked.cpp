// The blocked multi-threaded GEMM behind Gemm::run, deterministic for any thread count by construction.
//
// GotoBLAS/BLIS loop nest, all in one OpenMP parallel region:
//   for each column panel of C (up to kNcMax wide):
//     for each k slice (up to kKcMax deep), in increasing k:
//       pack B's (kc x nc) panel once into the shared buffer, 16-column micro-panels split over the
//       threads (static), then a barrier;
//       the (row block x column range) units of the panel split over the threads (static): a thread
//       packs its row block of A (mc x kc, 6-row strips) into its own buffer and runs the 6x16
//       micro-kernel (gemm_kernel.h) over the unit's strips and micro-panels; then a barrier. (On the
//       avx512 path an f32 A that is not transposed is not packed: its kernels read A's rows in place,
//       eight at a time over three panels; a transposed f32 A is packed in 8-row strips.)
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
// happen in the packing, so neither a transposed A nor bf16 operands cost an extra pass over memory. On the
// avx512 path with AVX512-BF16, bf16 operands are packed in k pairs instead (pack_a_pairs, pack_b_pairs:
// strips and panels of 32-bit pair words, half the depth) for the pair kernels of gemm_avx512.cpp, and where
// the ISA has wide kernels a unit's micro-panels are taken two at a time (6 x 32 tiles). On the amx path,
// bf16 products of two rows or more take the same nest with 32-row strips, A in rows of pair words
// (pack_a_amx), k slices of up to 1024 padded to whole tiles, and the 32 x 32 AMX micro tile of gemm_amx.cpp
// (run_blocked_amx).
//
// One row (M = 1: decoding, a GEMV) with an f32 or block-quantised B, or of bf16 operands with B stored (N, K),
// takes run_row instead: nothing in B is reused, so packing it would only add passes over memory. B is streamed
// once (quantised rows dequantised in segments of kRowSeg into a per-thread buffer; bf16 rows widened, and f32
// ones read as bf16 rounded, as they are loaded); with tb each output is a dot product of a with a contiguous row of B,
// otherwise c accumulates a_k times row k of B over a range of at most kRowSeg columns kept in cache (in registers,
// 128 columns at a time, on the avx512 path: Kernels::row_axpy). Each output
// sums k in a fixed order (eight lanes in k mod 8 combined in a fixed tree, then the last K mod 8 terms; or k
// ascending) whatever the thread count or column split, so its bits do not depend on them; they are not
// the blocked loop nest's bits.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "backend/cpu/gemm_kernel.h"
#include "core/clones.h"
#include "core/cpu_info.h"
#include "core/dtype.h"
#include "core/q8_act.h"

namespace oomless::gemm_detail {

namespace {

constexpr int64_t kKcMax = 384;       // k slice
// The AMX nest: deeper k slices (C is read and written once per slice, and the tiles' arithmetic is so fast
// that those passes cost more than on the vector paths; measured 384 / 768 / 1024 / 1536), narrower column
// panels (the packed B panel at most 1024 x 2048 bf16, 4 MiB), and every bf16 product of two rows or more
// (a 16-row tile with a few live rows still beats the vector kernels).
constexpr int64_t kKcAmx = 1024;
constexpr int64_t kNcAmx = 2048;
// A 32-row strip of packed A (32 x kpp pair words) that fits the L1 data cache beside the tiles' other
// traffic (48 KiB on the AMX CPUs measured): the AMX nest then keeps the strip and walks the column panels
// (B streams from L2, so its panel is kept narrower, kNcAmxStrip); otherwise it keeps a panel pair and walks
// the strips (run_blocked_amx). Measured at the model shapes (docs/BENCHMARKS.md).
constexpr int64_t kAmxStripBytes = 48 * 1024;
constexpr int64_t kNcAmxStrip = 1024;
constexpr int64_t kAmxMinRows = 2;
constexpr int64_t kMcMax = 192;       // rows of an A block (a multiple of 6)
constexpr int64_t kNcMax = 4096;      // columns of a B panel (a multiple of 16)
constexpr int64_t kUnits = 6;         // units per panel at least, where the shape allows
// Products of up to 132 rows take the skinny loop nest: measured against the blocked nest on every f32 path
// (docs/BENCHMARKS.md), it is 1.2-2.2x faster from 30 to 128 rows (the shared panel of the blocked nest is packed
// and read back for too few rows to pay for it), even at 128 rows for E x E, and behind from about 256 rows.
constexpr int64_t kSkinnyStrips = 22;
constexpr int64_t kSkinnyUnits = 12;  // column ranges of a skinny product
constexpr int64_t kSpare = 8;         // floats past each packed A block that strip packing may spill into
constexpr int64_t kRowSeg = 512;      // run_row: k (tb) or columns per segment; a multiple of 8
constexpr int kRowGroup = 8;          // run_row with tb: outputs computed together (a read once for them)
constexpr int64_t kRowAhead = 128;    // dot_group: floats of each row prefetched ahead of the loads

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The partition of one product, from the shape alone.
struct Plan {
  int64_t kc = 0, nk = 0;          // k slice depth and count
  int64_t nc = 0, nj = 0;          // column panel width and count
  int64_t strips = 0, nbm = 0;     // 6-row strips of C, row blocks
  int64_t max_strips = 0;          // strips of the largest row block
  bool skinny = false;             // few rows: the skinny loop nest (run_skinny)
};

// mr: rows of a strip (kMr, or kMrAmx for the AMX nest); the skinny test counts 6-row strips either way.
Plan make_plan(const GemmShape& s, int64_t mr = kMr, int64_t kc_max = kKcMax, int64_t nc_max = kNcMax) {
  Plan p;
  p.nk = cdiv(s.K, kc_max);
  p.kc = cdiv(s.K, p.nk);
  p.nj = cdiv(s.N, nc_max);
  p.nc = cdiv(cdiv(s.N, p.nj), kNr) * kNr;
  p.strips = cdiv(s.M, mr);
  p.nbm = std::min(p.strips, cdiv(cdiv(s.M, kMcMax), kUnits) * kUnits);
  p.max_strips = cdiv(p.strips, p.nbm);
  p.skinny = cdiv(s.M, kMr) <= kSkinnyStrips;
  return p;
}

// Column panel jp of a plan: its first column, its 16-column micro-panels and its (row block x column range)
// units (none past N).
struct PanelUnits {
  int64_t j0, panels, nbn, units;
};
PanelUnits panel_units(const Plan& p, int64_t N, int64_t jp) {
  const int64_t j0 = jp * p.nc;
  const int64_t panels = j0 < N ? cdiv(std::min(p.nc, N - j0), kNr) : 0;
  const int64_t nbn = std::min(panels, cdiv(kUnits, p.nbm));
  return {j0, panels, nbn, p.nbm * nbn};
}
// Unit u of a panel: row block bm, rows [r0, r1) in strips of mr rows, micro-panels [q0, q1).
struct Unit {
  int64_t bm, r0, r1, q0, q1;
};
Unit unit_of(const Plan& p, const PanelUnits& pu, int64_t u, int64_t mr, int64_t M) {
  const int64_t bm = u / pu.nbn, bn = u % pu.nbn;
  const int64_t s0 = bm * p.strips / p.nbm, s1 = (bm + 1) * p.strips / p.nbm;
  return {bm, s0 * mr, std::min(M, s1 * mr), bn * pu.panels / pu.nbn, (bn + 1) * pu.panels / pu.nbn};
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
// as MR-row strips (kMr, or kMrRows for the avx512 path's packed8 kernels): strip t at dst + MR t * kc,
// element (i, k) at [k * MR + i]. Rows past m in the last strip are left unset; the micro-kernel for fewer
// rows never reads them.
template <int MR = kMr, class T>
void pack_a_block(float* dst, const T* src, int64_t ld, bool ta, int64_t kc, int64_t m, bool avx2) {
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    float* d = dst + i0 * kc;
    const int64_t rows = std::min<int64_t>(MR, m - i0);
    if (ta) {
      const T* sp = src + i0;
      if (rows == MR) {
        for (int64_t k = 0; k < kc; ++k)
          for (int i = 0; i < MR; ++i) d[k * MR + i] = widen(sp[k * ld + i]);
      } else {
        for (int64_t k = 0; k < kc; ++k)
          for (int64_t i = 0; i < rows; ++i) d[k * MR + i] = widen(sp[k * ld + i]);
      }
    } else if (avx2 && rows == kMr && MR == kMr) {
      pack_a_strip_avx2(d, src + i0 * ld, ld, kc);
    } else {
      for (int64_t i = 0; i < rows; ++i) {
        const T* row = src + (i0 + i) * ld;
        for (int64_t k = 0; k < kc; ++k) d[k * MR + i] = widen(row[k]);
      }
    }
  }
}

// ---- bf16 k pairs (the pair kernels of gemm_avx512.cpp) ------------------------------------------

// One 32-bit word of a pair: k in the high half (the instruction's first product), k + 1 in the low one.
inline uint32_t pair_word(uint16_t first, uint16_t second) { return (static_cast<uint32_t>(first) << 16) | second; }
inline uint16_t bf16_of(uint16_t v) { return v; }
inline uint16_t bf16_of(F32AsBf16 v) { return f32_to_bf16(v.v); }

// Products whose operands all hold bf16 values take the pair kernels where the ISA has them: always on the
// amx path (its tiles take pairs) and for one row (bound by reading B, which pairs keep at 2 bytes a value
// where widening packs 4), on avx512 where they are the faster (gemm_bf16_pairs).
bool use_pairs(const GemmShape& s) {
  const Kernels& k = kernels();
  return s.ab == DType::bf16 && (!s.b_quant || s.b_as_bf16) && k.packed_pairs[1] != nullptr &&
         (k.amx || s.M == 1 || gemm_bf16_pairs());
}
// k depth of a packed strip or panel: k itself, or its pairs.
inline int64_t depth(int64_t kc, bool pairs) { return pairs ? (kc + 1) / 2 : kc; }

// Pair strips of A rows [0, m) (bf16), k < kc: word (pair p, row i) of strip t at dst[t * 6 * kp + p * 6 + i],
// a zero half past kc. Rows past m in the last strip are left unset, as in pack_a_block.
void pack_a_pairs(uint32_t* dst, const uint16_t* src, int64_t ld, bool ta, int64_t kc, int64_t m) {
  const int64_t kp = depth(kc, true), whole = kc / 2;
  for (int64_t i0 = 0; i0 < m; i0 += kMr) {
    uint32_t* d = dst + i0 * kp;
    const int64_t rows = std::min<int64_t>(kMr, m - i0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = i0 + i;
      auto at = [&](int64_t k) { return ta ? src[k * ld + r] : src[r * ld + k]; };
      for (int64_t p = 0; p < whole; ++p) d[p * kMr + i] = pair_word(at(2 * p), at(2 * p + 1));
      if (kc % 2) d[whole * kMr + i] = pair_word(at(kc - 1), 0);
    }
  }
}

// GCC 12's AVX-512 shift intrinsics trip -Wmaybe-uninitialized on their own undefined operand.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Sixteen bf16 values from p: bf16 bits, or f32 rounded as f32_to_bf16 does (ties to even, NaN kept
// quiet), each in the low half of a 32-bit lane.
__attribute__((target("avx512f,avx512bw"))) inline __m512i bf16x16(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
__attribute__((target("avx512f,avx512bw"))) inline __m512i bf16x16(const F32AsBf16* p) {
  const __m512i u = _mm512_loadu_si512(p);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
  return _mm512_srli_epi32(_mm512_mask_blend_epi32(nan, rounded, quiet), 16);
}

// The 16 x 16 transpose of 32-bit words: row j of the result = word j of every r[i].
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now r[4g + m] holds, in 128-bit lane L, words m' of rows 4L.. (interleaved); two 128-bit shuffles finish.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Pair words (pair q: k = 2q high, 2q + 1 low) of 32 consecutive k from p (one column of a stored (N, K) b).
template <class T>
__attribute__((target("avx512f,avx512bw"))) inline __m512i pairs32(const T* p) {
  const __m512i lo = bf16x16(p), hi = bf16x16(p + 16);  // k 0..15, 16..31, one per lane
  // Lane pairs (2q, 2q + 1) -> word q = (v[2q] << 16) | v[2q + 1].
  const __m512i even = _mm512_permutex2var_epi32(
      lo, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), hi);
  const __m512i odd = _mm512_permutex2var_epi32(
      lo, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), hi);
  return _mm512_or_si512(_mm512_slli_epi32(even, 16), odd);
}

// Full panels (16 columns) of a stored (N, K) b, 32 k at a time: sixteen columns' pair words, transposed.
// Returns the k done (a multiple of 32).
template <class T>
__attribute__((target("avx512f,avx512bw"))) int64_t pack_bt_pairs_avx512(uint32_t* dst, const T* src, int64_t ld,
                                                                          int64_t kc) {
  int64_t k = 0;
  for (; k + 32 <= kc; k += 32) {
    __m512i r[16];
    for (int j = 0; j < 16; ++j) r[j] = pairs32(src + j * ld + k);
    transpose16(r);
    for (int q = 0; q < 16; ++q) _mm512_storeu_si512(dst + (k / 2 + q) * kNr, r[q]);
  }
  return k;
}

// Rows k and k + 1 of a stored (K, N) b, 16 columns: one row of pair words.
template <class T>
__attribute__((target("avx512f,avx512bw"))) void pair_row_avx512(uint32_t* dst, const T* r0, const T* r1) {
  const __m512i w = r1 ? _mm512_or_si512(_mm512_slli_epi32(bf16x16(r0), 16), bf16x16(r1))
                       : _mm512_slli_epi32(bf16x16(r0), 16);
  _mm512_storeu_si512(dst, w);
}

// ---- the A block of the AMX nest -------------------------------------------------------------------

// Rows [0, m) of a bf16 a(i, k) = src[i * ld + k] (ta: src[k * ld + i]), k < kc, as rows of pair words
// (pair_word order): row i at dst + i * kpp, pair p at [p], zero from pair (kc + 1) / 2 to kpp and in the
// rows from m to m rounded up to 16 (the micro-kernel loads whole 16-row tiles).
__attribute__((target("avx512f,avx512bw"))) void pack_a_amx(uint32_t* dst, const uint16_t* src, int64_t ld, bool ta,
                                                             int64_t kc, int64_t m, int64_t kpp) {
  const int64_t whole = kc / 2, p32 = kc / 32 * 16;  // pairs; pairs in whole groups of 32 k
  auto at = [&](int64_t i, int64_t k) { return ta ? src[k * ld + i] : src[i * ld + k]; };
  auto rest = [&](int64_t i, int64_t p) {  // row i from pair p on, one word at a time
    uint32_t* d = dst + i * kpp;
    for (; p < whole; ++p) d[p] = pair_word(at(i, 2 * p), at(i, 2 * p + 1));
    if (kc % 2) d[p++] = pair_word(at(i, kc - 1), 0);
    for (; p < kpp; ++p) d[p] = 0;
  };
  int64_t i = 0;
  if (!ta) {
    // Sixteen words of a row as they lie (k in the low half), halves swapped.
    for (; i < m; ++i) {
      const uint16_t* row = src + i * ld;
      uint32_t* d = dst + i * kpp;
      for (int64_t p = 0; p < p32; p += 16)
        _mm512_storeu_si512(d + p, _mm512_rol_epi32(_mm512_loadu_si512(row + 2 * p), 16));
      rest(i, p32);
    }
  } else {
    // Sixteen rows at a time: the words of pairs p..p+15 as vectors over the rows (two k rows of the stored
    // (K, M) a each), then transposed.
    for (; i + 16 <= m; i += 16) {
      for (int64_t p = 0; p < p32; p += 16) {
        __m512i r[16];
        for (int q = 0; q < 16; ++q) {
          const uint16_t* k0 = src + 2 * (p + q) * ld + i;
          r[q] = _mm512_or_si512(_mm512_slli_epi32(bf16x16(k0), 16), bf16x16(k0 + ld));
        }
        transpose16(r);
        for (int t = 0; t < 16; ++t) _mm512_storeu_si512(dst + (i + t) * kpp + p, r[t]);
      }
      for (int t = 0; t < 16; ++t) rest(i + t, p32);
    }
    for (; i < m; ++i) rest(i, 0);
  }
  for (; i < cdiv(m, 16) * 16; ++i) std::memset(dst + i * kpp, 0, sizeof(uint32_t) * kpp);
}

#pragma GCC diagnostic pop

// One pair panel of B (16 columns, zero past n) from b(k, j) = src[k * ld + j] (tb false) or src[j * ld + k].
template <class T>
void pack_b_pairs(uint32_t* dst, const T* src, int64_t ld, bool tb, int64_t kc, int64_t n) {
  const int64_t kp = depth(kc, true), whole = kc / 2;
  if (!tb && n == kNr) {
    for (int64_t p = 0; p < whole; ++p) pair_row_avx512(dst + p * kNr, src + 2 * p * ld, src + (2 * p + 1) * ld);
    if (kc % 2) pair_row_avx512<T>(dst + whole * kNr, src + (kc - 1) * ld, nullptr);
    return;
  }
  const int64_t k0 = tb && n == kNr ? pack_bt_pairs_avx512(dst, src, ld, kc) : 0;  // k0 even
  for (int64_t j = 0; j < kNr; ++j) {
    if (j >= n) {
      for (int64_t p = 0; p < kp; ++p) dst[p * kNr + j] = 0;
      continue;
    }
    auto at = [&](int64_t k) { return bf16_of(tb ? src[j * ld + k] : src[k * ld + j]); };
    for (int64_t p = k0 / 2; p < whole; ++p) dst[p * kNr + j] = pair_word(at(2 * p), at(2 * p + 1));
    if (kc % 2) dst[whole * kNr + j] = pair_word(at(kc - 1), 0);
  }
}

// A quantised B read as bf16: its rows dequantised into a small buffer (as pack_b_micro does), then paired
// with the rounding.
void pack_b_pairs(uint32_t* dst, const QuantB& src, int64_t ld, bool tb, int64_t kc, int64_t n) {
  float tmp[kNr * std::max(kKcMax, kKcAmx)];
  const int64_t row = src.qrow0 + src.off / ld, col = src.off % ld;
  const int64_t len = tb ? kc : n, count = tb ? n : kc;
  for (int64_t i = 0; i < count; ++i) src.q->dequant_row(*src.q, row + i, col, len, tmp + i * len);
  pack_b_pairs(dst, reinterpret_cast<const F32AsBf16*>(tmp), len, tb, kc, n);
}
// f32 products never take the pair kernels.
void pack_b_pairs(uint32_t*, const float*, int64_t, bool, int64_t, int64_t) {}

// The A block of a product: 6-row strips of floats, 8-row ones (eight: the packed8 kernels), or pair strips
// for a bf16 a on the pair kernels.
template <class TA>
void pack_a_any(float* dst, const TA* src, int64_t ld, bool ta, int64_t kc, int64_t m, bool avx2, bool pairs,
                bool eight = false) {
  if constexpr (std::is_same_v<TA, uint16_t>) {
    if (pairs) return pack_a_pairs(reinterpret_cast<uint32_t*>(dst), src, ld, ta, kc, m);
  }
  if (eight) return pack_a_block<kMrRows>(dst, src, ld, ta, kc, m, avx2);
  pack_a_block(dst, src, ld, ta, kc, m, avx2);
}
template <class BP>
void pack_b_any(float* dst, BP src, int64_t ld, bool tb, int64_t kc, int64_t n, bool avx2, bool pairs) {
  if (pairs) return pack_b_pairs(reinterpret_cast<uint32_t*>(dst), src, ld, tb, kc, n);
  pack_b_micro(dst, src, ld, tb, kc, n, avx2);
}

// A thread's packed A block in the blocked nest: the largest row block's rows rounded up to whole strips of
// either height (kMr or kMrRows), whichever the product takes.
size_t block_floats(const Plan& p) {
  return static_cast<size_t>(cdiv(p.max_strips * kMr, kMrRows) * kMrRows * p.kc + kSpare);
}

// A thread's buffer in the skinny nest: its A strips, then two B micro-panels (the wide kernels read two).
// Its A strips take the rows rounded up to whole strips of either height (kMr or kMrRows).
int64_t skinny_a_floats(const Plan& p) { return cdiv(p.strips * kMr, kMrRows) * kMrRows * p.kc + kSpare; }
size_t skinny_floats(const Plan& p) { return static_cast<size_t>(skinny_a_floats(p) + 2 * kNr * p.kc); }

// The skinny nests' loop, inside a parallel region: for each k slice, this thread's static share of the
// column ranges (the same share every slice, so no barrier between slices), A's slice packed once by
// pack_a(k0, kc) before its first range, then from each range's first micro-panel q on,
// q += step(kp, k0, kc, q, q1) (the micro-panels it ran: one, or two side by side).
template <class PackA, class Step>
void skinny_loop(const GemmShape& s, const Plan& p, int64_t panels, PackA&& pack_a, Step&& step) {
  const int64_t units = std::min(panels, kSkinnyUnits);
  for (int64_t kp = 0; kp < p.nk; ++kp) {
    const int64_t k0 = kp * p.kc, kc = std::min(p.kc, s.K - k0);
    bool packed = false;
#pragma omp for schedule(static) nowait
    for (int64_t u = 0; u < units; ++u) {
      if (!packed) pack_a(k0, kc), packed = true;
      const int64_t q1 = (u + 1) * panels / units;
      for (int64_t q = u * panels / units; q < q1;) q += step(kp, k0, kc, q, q1);
    }
  }
}

// Few rows: B is read once and barely reused, so sharing a packed panel buys nothing. The columns are
// cut into ranges (from the shape) spread over the threads, and each thread packs every kc x 16
// micro-panel of its range into a private buffer just before the micro-kernel uses it, with no barrier
// at all (on the avx512 path an f32 B is not packed: stored (K, N), three panels at a time are read where
// they are; stored (N, K), the product runs as C^T = B A^T, run_skinny_t); A's k slice is packed once a
// slice by each thread, for all its ranges. The k slices and micro-kernel chains are those of the blocked
// loop nest, so the bits are too.
//
// An f32 B stored (N, K) (x W^T) on the avx512 path: C^T = B A^T instead (micro_avx512_rows_t), B's rows
// read where they are, eight at a time, and A^T packed once a k slice by each thread (A is the small operand:
// packing B would transpose all of it in every product: measured 1.05-1.3x faster at 16-128 rows,
// docs/BENCHMARKS.md). The column ranges of the nest become ranges of B's 8-row strips; the k slices are the
// plan's and each output's chain is the same, so the bits are too.
void run_skinny_t(const GemmShape& s, const Plan& p, const float* a, const float* b, float* c, float* work) {
  const Kernels& kern = kernels();
  const int64_t mp = cdiv(s.M, kNr);          // panels of A^T
  const int64_t strips = cdiv(s.N, kMrRows);  // 8-row strips of B
  const size_t stride = skinny_floats(p);     // holds the mp * 16 x kc panels (s.M <= 132)
#pragma omp parallel
  {
    float* ap = work + static_cast<size_t>(omp_get_thread_num()) * stride;
    auto pack_a = [&](int64_t k0, int64_t kc) { kern.pack_bt(ap, a + k0, s.lda, kc, s.M); };
    skinny_loop(s, p, strips, pack_a, [&](int64_t kp, int64_t k0, int64_t kc, int64_t q, int64_t) -> int64_t {
      const int64_t n0 = q * kMrRows;
      const int64_t rows = std::min<int64_t>(kMrRows, s.N - n0);
      Micro m{};
      m.a = b + n0 * s.ldb + k0;
      m.ras = s.ldb;
      m.cas = 1;
      m.kc = kc;
      m.ldc = s.ldc;
      m.acc = s.accumulate || kp > 0;
      for (int64_t g = 0; g < mp; g += 3) {
        const int64_t panels = std::min<int64_t>(3, mp - g);
        m.b = ap + g * kNr * kc;
        m.c = c + g * kNr * s.ldc + n0;
        m.n = static_cast<int>(std::min<int64_t>(3 * kNr, s.M - g * kNr));
        kern.rows_t[panels - 1][rows](m);
      }
      return 1;
    });
  }
}

// BP: a pointer to B's elements (f32, bf16, f32-as-bf16) or a QuantB position.
template <class TA, class BP>
void run_skinny(const GemmShape& s, const Plan& p, const TA* a, BP b, float* c, float* work) {
  const Kernels& kern = kernels();
  if constexpr (std::is_same_v<TA, float> && std::is_same_v<BP, const float*>)
    if (s.tb && !s.ta && kern.rows_t[0][1] != nullptr)
      return run_skinny_t(s, p, a, b, c, work);
  const bool avx2 = kern.avx2, pairs = use_pairs(s);
  // An f32 A packs in strips of eight rows where the ISA has kernels for them (8 x 16 and 8 x 32: the same to
  // 1.1x the speed of six rows at 16-128 rows, docs/BENCHMARKS.md).
  const bool packed8 = std::is_same_v<TA, float> && kern.packed8_wide[1] != nullptr;
  const int64_t amr = packed8 ? kMrRows : kMr;  // rows of a packed strip
  // An f32 B stored (K, N): three panels at a time read where they are, row k at b + k * ldb (packed8_brows3),
  // not packed by each thread (1.2-1.35x faster at 16-128 rows, docs/BENCHMARKS.md); the last columns of a
  // range, fewer than three full panels, are packed.
  const bool brows = std::is_same_v<BP, const float*> && packed8 && !s.tb && !pairs;
  const MicroFn* micro = pairs ? kern.packed_pairs : packed8 ? kern.packed8 : kern.packed;
  const MicroFn* wide = pairs ? kern.packed_pairs_wide : packed8 ? kern.packed8_wide : kern.packed_wide;
  const int64_t panels = cdiv(s.N, kNr);
  const size_t stride = skinny_floats(p);
#pragma omp parallel
  {
    float* ap = work + static_cast<size_t>(omp_get_thread_num()) * stride;
    float* bp = ap + skinny_a_floats(p);
    auto pack_a = [&](int64_t k0, int64_t kc) {
      pack_a_any(ap, s.ta ? a + k0 * s.lda : a + k0, s.lda, s.ta, kc, s.M, avx2, pairs, packed8);
    };
    skinny_loop(s, p, panels, pack_a, [&](int64_t kp, int64_t k0, int64_t kc, int64_t q, int64_t q1) -> int64_t {
      const int64_t jq = q * kNr, kd = depth(kc, pairs);
      Micro m{};
      m.ras = 1;
      m.cas = amr;
      m.ldc = s.ldc;
      m.kc = kd;
      m.acc = s.accumulate || kp > 0;
      auto over_strips = [&](const MicroFn* fn) {  // every strip of A times the panels at m.b
        for (int64_t r = 0; r < s.M; r += amr) {
          m.a = ap + r * kd;
          m.c = c + r * s.ldc + jq;
          fn[std::min<int64_t>(amr, s.M - r)](m);
        }
      };
      if constexpr (std::is_same_v<BP, const float*>)
        if (brows && q + 2 < q1 && s.N - jq >= 3 * kNr) {
          m.b = b + k0 * s.ldb + jq;
          m.bs = s.ldb;
          m.b2 = kNr;
          m.n = 3 * kNr;
          over_strips(kern.packed8_brows3);
          return 3;
        }
      // Two panels at a time where the ISA has a wide kernel, packed side by side (the three-panel kernel of
      // the blocked nest was measured slower here: 0.93-0.95x at 64 rows).
      const int64_t w = wide[1] && q + 1 < q1 ? 2 : 1;
      m.b = bp;
      m.n = static_cast<int>(std::min<int64_t>(w * kNr, s.N - jq));
      for (int64_t h = 0; h < w; ++h) {
        const int64_t jh = jq + h * kNr;
        pack_b_any(bp + h * kNr * kd, s.tb ? b + jh * s.ldb + k0 : b + k0 * s.ldb + jh, s.ldb, s.tb, kc,
                   std::min<int64_t>(kNr, s.N - jh), avx2, pairs);
      }
      over_strips(w == 2 ? wide : micro);
      return w;
    });
  }
}

// np adjacent kc x 16 panels of f32 B rows (b(k, j) = src[k * ld + j], j < n, zero past n), panel q at
// dst + q * 16 * kd: k outer, so that each row's np * 16 floats are read as one run (panel by panel, every row
// was a new line of a strided walk, and the packing waited on memory). The same panels as pack_b_panel's.
void pack_b_rows(float* dst, const float* src, int64_t ld, int64_t kc, int64_t np, int64_t n, int64_t kd) {
  const int64_t full = n / kNr;
  for (int64_t k = 0; k < kc; ++k) {
    const float* r = src + k * ld;
    for (int64_t q = 0; q < full; ++q) std::memcpy(dst + q * kNr * kd + k * kNr, r + q * kNr, kNr * sizeof(float));
    for (int64_t q = full; q < np; ++q) {
      float* d = dst + q * kNr * kd + k * kNr;
      for (int64_t j = 0; j < kNr; ++j) d[j] = q * kNr + j < n ? r[q * kNr + j] : 0.0f;
    }
  }
}

// ---- one row ----------------------------------------------------------------------------------------

// run_row takes a one-row product whose B holds f32 values (f32 or block-quantised), and one of bf16 operands
// whose B is stored (N, K) (x W^T: a decode step's projections and LM head under bf16 compute), whatever B holds
// (bf16, f32 read as bf16, or blocks read as bf16): each output is then a dot product of a with a contiguous row
// of B, which packing would transpose a token at a time (a bf16 decode step spent a third of its time doing so,
// and ran 1.4x slower than in f32). The rule depends on the shape and dtype only, not on how B is stored, so a
// bf16 copy, an f32 matrix read as bf16 and a quantised one read as bf16 take the same path, for the same bits.
// A bf16 B stored (K, N) keeps the packed path, where widening costs nothing extra.
bool one_row(const GemmShape& s) {
  if (s.M != 1) return false;
  if (s.ab == DType::bf16 && s.tb) return true;
  return !s.b_as_bf16 && (s.b_quant || s.ab == DType::f32);
}

// Elements [0, n) of b as floats: b itself when f32, dequantised into buf when block-quantised (and rounded
// to bf16 there when read as bf16). A bf16 B, or an f32 one read as bf16, is read where it is (dot_lanes).
inline const float* row_floats(const float* b, int64_t, int64_t, float*) { return b; }
inline const uint16_t* row_floats(const uint16_t* b, int64_t, int64_t, float*) { return b; }
inline const F32AsBf16* row_floats(const F32AsBf16* b, int64_t, int64_t, float*) { return b; }
inline const float* row_floats(const QuantB& b, int64_t n, int64_t ld, float* buf) {
  b.q->dequant_row(*b.q, b.qrow0 + b.off / ld, b.off % ld, n, buf);
  if (b.round)
    for (int64_t k = 0; k < n; ++k) buf[k] = round_to_bf16(buf[k]);
  return buf;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8f __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
__attribute__((always_inline)) inline v8f ld8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
// Eight bf16 values, widened (exact).
__attribute__((always_inline)) inline v8f ld8(const uint16_t* p) {
  v8h h;
  std::memcpy(&h, p, sizeof h);
  const v8u w = __builtin_convertvector(h, v8u) << 16;
  v8f v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
// Eight f32 values rounded to bf16 as f32_to_bf16 does (ties to even, a NaN kept quiet), as floats: load8's rounding
// (gemm_kernel.h) in portable vectors, for dot_lanes' clones without AVX2.
__attribute__((always_inline)) inline v8f ld8(const F32AsBf16* p) {
  v8u u;
  std::memcpy(&u, p, sizeof u);
  const v8i nan = (reinterpret_cast<const v8i&>(u) & 0x7fffffff) > 0x7f800000;  // all ones where NaN
  const v8u rounded = u + (0x7fffu + ((u >> 16) & 1u));
  const v8u w = (nan ? u | 0x00400000u : rounded) & 0xffff0000u;
  v8f v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

// acc[i] += the eight-lane products of a and r[i] over [0, n8) (n8 a multiple of 8), for rows i < g: k outer
// (a loaded once for the group, kRowGroup independent sums in flight), each row's lanes summed in k order.
// The rows stream from memory once per product (a decode step's weights): each is prefetched a line at a
// time kRowAhead floats ahead (past its end: the next row's start, where the group's rows are adjacent),
// which the hardware's prefetcher did not do for eight interleaved streams (a decode step of SmolLM2-135M in
// f32 took 12% longer without).
// (B's rows as f32, bf16, or f32 read as bf16: each product of two bf16 values is exact in fp32, so a product
// of bf16 operands has the same bits with or without fused multiply-adds, on every clone.)
template <int G, class T>
__attribute__((always_inline)) inline void dot_group(const float* a, const T* const* r, int64_t n8, v8f* acc) {
  v8f s[G];
  for (int i = 0; i < G; ++i) s[i] = acc[i];
  for (int64_t k = 0; k < n8; k += 8) {
    const v8f va = ld8(a + k);
    if (k % 16 == 0)
      for (int i = 0; i < G; ++i) __builtin_prefetch(r[i] + k + kRowAhead);
    for (int i = 0; i < G; ++i) s[i] += va * ld8(r[i] + k);
  }
  for (int i = 0; i < G; ++i) acc[i] = s[i];
}
#define OOMLESS_DOT_LANES(T, ...)                                                  \
  OOMLESS_CLONES(__VA_ARGS__)                                                      \
  void dot_lanes(const float* a, const T* const* r, int g, int64_t n8, v8f* acc) { \
    if (g == kRowGroup) return dot_group<kRowGroup>(a, r, n8, acc);               \
    for (int i = 0; i < g; ++i) dot_group<1>(a, r + i, n8, acc + i);              \
  }
OOMLESS_DOT_LANES(float, "arch=x86-64-v3", "default")
// (bf16 rows: widening and rounding are the work here, which AVX-512's encodings shorten; the same lanes, so the
// same bits.)
OOMLESS_DOT_LANES(uint16_t, "arch=x86-64-v4", "arch=x86-64-v3", "default")
OOMLESS_DOT_LANES(F32AsBf16, "arch=x86-64-v4", "arch=x86-64-v3", "default")
#undef OOMLESS_DOT_LANES

// y[j] += x[0] r[0][j], then += x[1] r[1][j], ... for g <= 4 rows and j < n: the sequence of one-row
// updates (the same bits), with y loaded and stored once.
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void axpy_rows(float* y, const float* x, const float* const* r, int g, int64_t n) {
  if (g == 4) {
    const float x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    const float *r0 = r[0], *r1 = r[1], *r2 = r[2], *r3 = r[3];
    for (int64_t j = 0; j < n; ++j) y[j] = (((y[j] + x0 * r0[j]) + x1 * r1[j]) + x2 * r2[j]) + x3 * r3[j];
    return;
  }
  for (int i = 0; i < g; ++i)
    for (int64_t j = 0; j < n; ++j) y[j] += x[i] * r[i][j];
}
#pragma GCC diagnostic pop

// Whether dot_lanes runs its FMA clone here, so that a quantised matrix's dot_rows (one fused multiply-add a
// term) gives its bits; OOMLESS_ROW_DOT=0 turns dot_rows off (benchmarks compare the two).
bool dot_from_blocks() {
  static const bool yes = [] {
    const char* e = std::getenv("OOMLESS_ROW_DOT");
    if (e && std::strcmp(e, "0") == 0) return false;
    const CpuInfo c = detect_cpu();
    return c.avx2 && c.fma;
  }();
  return yes;
}

// run_row's column range without tb: kRowSeg or less, a multiple of 16, so that the ranges number a multiple of
// kUnits where N has at least 64 columns a range.
int64_t row_segment(int64_t N) {
  const int64_t units = std::min(cdiv(cdiv(N, kRowSeg), kUnits) * kUnits, std::max<int64_t>(1, N / 64));
  return std::min(kRowSeg, cdiv(cdiv(N, units), 16) * 16);
}

// run_row without tb (B stored (K, N), f32 or block-quantised): c accumulates a_k times row k of B.
template <class BP>
void run_row_axpy(const GemmShape& s, const float* af, BP b, float* c, float* work) {
  const int64_t N = s.N, K = s.K;
  // Column ranges of at most kRowSeg, as many as a multiple of kUnits where N allows (1536 columns: six of 256,
  // not three of 512, which left one of two threads idle a third of the time), from the shape alone. Each
  // output's sum runs over k in order whatever its range, so the ranges do not change its bits.
  const int64_t seg = row_segment(N);
  const int64_t units = cdiv(N, seg);
  if constexpr (std::is_same_v<BP, const float*>) {
    if (const auto row_axpy = kernels().row_axpy) {
#pragma omp parallel for schedule(static)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t j0 = u * seg;
        row_axpy(c + j0, af, b + j0, s.ldb, K, std::min(seg, N - j0), s.accumulate);
      }
      return;
    }
  }
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    float* acc = work + static_cast<size_t>(omp_get_thread_num()) * kRowGroup * kRowSeg;
    float* buf = acc + kRowSeg;  // four row segments
    const int64_t j0 = u * seg, n = std::min(seg, N - j0);
    std::fill(acc, acc + n, 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += 4) {
      const int g = static_cast<int>(std::min<int64_t>(4, K - k0));
      const float* r[4];
      for (int i = 0; i < g; ++i) r[i] = row_floats(b + (k0 + i) * s.ldb + j0, n, s.ldb, buf + i * kRowSeg);
      axpy_rows(acc, af + k0, r, g, n);
    }
    for (int64_t j = 0; j < n; ++j) c[j0 + j] = s.accumulate ? c[j0 + j] + acc[j] : acc[j];
  }
}

// c (1, N) (+)= af (1, K) . op(b), af the gathered f32 row of a; work: kRowGroup * kRowSeg floats a thread.
// qa: af quantised to 8 bits where B's matrix takes integer one-row products (QuantMatrix::dot_rows_q8).
template <class BP>
void run_row(const GemmShape& s, const float* af, BP b, float* c, float* work, const Q8Act* qa) {
  const int64_t N = s.N, K = s.K;
  if constexpr (std::is_same_v<BP, QuantB>) {
    // A matrix of bf16 values (QuantBase's "bf16" format: --base-dtype or --embed-dtype bf16) stored (N, K) is read
    // where it is, as a bf16 B: the values dequant_row gives (exact in f32, so rounding them to bf16 changes
    // none), without copying them (the same bits). (Under bf16 compute gemm_blocked has already made it a bf16
    // B; this is f32 compute's one-row product.)
    if (s.tb && std::strcmp(b.q->format, "bf16") == 0)
      return run_row(s, af, static_cast<const uint16_t*>(b.q->data) + b.qrow0 * s.ldb + b.off, c, work, nullptr);
    // (Asked for no rows first: whether the span is whole blocks, which is the same for every group.)
    // Output j is the matrix's row row0 + j, from column col on (divided out once, not per row).
    const int64_t row0 = b.qrow0 + b.off / s.ldb, col = b.off % s.ldb;
    if (qa && s.tb && b.q->dot_rows_q8(*b.q, nullptr, 0, col, K, *qa, nullptr)) {
      const int64_t groups = cdiv(N, kRowGroup);
#pragma omp parallel for schedule(static)
      for (int64_t q = 0; q < groups; ++q) {
        const int64_t j0 = q * kRowGroup;
        const int g = static_cast<int>(std::min<int64_t>(kRowGroup, N - j0));
        int64_t rows[kRowGroup];
        float out[kRowGroup];
        for (int i = 0; i < g; ++i) rows[i] = row0 + j0 + i;
        b.q->dot_rows_q8(*b.q, rows, g, col, K, *qa, out);
        for (int i = 0; i < g; ++i) c[j0 + i] = s.accumulate ? c[j0 + i] + out[i] : out[i];
      }
      return;
    }
  }
  if (s.tb) {
    const int64_t groups = cdiv(N, kRowGroup), k8 = K / 8 * 8;
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < groups; ++q) {
      float* buf = work + static_cast<size_t>(omp_get_thread_num()) * kRowGroup * kRowSeg;
      const int64_t j0 = q * kRowGroup;
      const int g = static_cast<int>(std::min<int64_t>(kRowGroup, N - j0));
      v8f acc[kRowGroup] = {};
      float tail[kRowGroup] = {};
      std::remove_cv_t<decltype(row_floats(b, 0, 0, nullptr))> r[kRowGroup];
      int64_t k_from = 0;  // [0, k_from) done from the blocks
      if constexpr (std::is_same_v<BP, QuantB>) {
        if (b.q->dot_rows && !b.round && k8 > 0 && dot_from_blocks()) {
          int64_t rows[kRowGroup];
          const int64_t row0 = b.qrow0 + b.off / s.ldb;  // as above: output j is row row0 + j
          for (int i = 0; i < g; ++i) rows[i] = row0 + j0 + i;
          if (b.q->dot_rows(*b.q, rows, g, b.off % s.ldb, k8, af, reinterpret_cast<float*>(acc))) k_from = k8;
        }
      }
      for (int64_t k0 = k_from; k0 < K; k0 += kRowSeg) {
        const int64_t n = std::min(kRowSeg, K - k0);
        for (int i = 0; i < g; ++i) r[i] = row_floats(b + (j0 + i) * s.ldb + k0, n, s.ldb, buf + i * kRowSeg);
        const int64_t n8 = std::min(n, k8 - k0);
        if (n8 > 0) dot_lanes(af + k0, r, g, n8, acc);
        for (int i = 0; i < g; ++i)
          for (int64_t k = std::max<int64_t>(n8, 0); k < n; ++k) tail[i] += af[k0 + k] * widen(r[i][k]);
      }
      for (int i = 0; i < g; ++i) {
        const v8f v = acc[i];
        const float sum = (((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))) + tail[i];
        c[j0 + i] = s.accumulate ? c[j0 + i] + sum : sum;
      }
    }
    return;
  }
  if constexpr (std::is_same_v<BP, const float*> || std::is_same_v<BP, QuantB>)
    return run_row_axpy(s, af, b, c, work);
  else
    fail("[gemm] internal: a one-row product of bf16 operands with B stored (K, N) takes the packed path");
}

// ---- the AMX nest ------------------------------------------------------------------------------------

// bf16 products on the amx path that are not skinny (below): the blocked nest above with 32-row strips, A packed in
// rows of pair words (pack_a_amx), the B pair panels of the vdpbf16ps kernels, k slices padded with zero
// pairs to whole tiles (16 pairs), and 32 x 32 AMX micro tiles (two panels at a time).
inline int64_t amx_depth(int64_t kc) { return cdiv(depth(kc, true), 16) * 16; }
bool use_amx(const GemmShape& s) { return kernels().amx && use_pairs(s) && s.M >= kAmxMinRows; }
// The AMX nest's partition, from the shape alone (so the order of the tiles, which does not change a bit of
// any output, is fixed too): strip_outer when a strip of A fits L1.
struct AmxPlan {
  Plan p;
  int64_t kpp;
  bool strip_outer;
};
AmxPlan amx_plan(const GemmShape& s) {
  const int64_t kpp = amx_depth(make_plan(s, kMrAmx, kKcAmx, kNcAmx).kc);
  const bool strip_outer = kMrAmx * kpp * 4 <= kAmxStripBytes;
  return {make_plan(s, kMrAmx, kKcAmx, strip_outer ? kNcAmxStrip : kNcAmx), kpp, strip_outer};
}

template <class BP>
void run_blocked_amx(const GemmShape& s, const AmxPlan& amx, const uint16_t* a, BP b, float* c, float* bpack,
                     float* apack) {
  const Plan& p = amx.p;
  const int64_t kpp = amx.kpp;
  const size_t a_stride = static_cast<size_t>(p.max_strips * kMrAmx * kpp);
  uint32_t* const bw = reinterpret_cast<uint32_t*>(bpack);
#pragma omp parallel
  {
    uint32_t* ap = reinterpret_cast<uint32_t*>(apack) + static_cast<size_t>(omp_get_thread_num()) * a_stride;
    amx_begin();
    for (int64_t jp = 0; jp < p.nj; ++jp) {
      const PanelUnits pu = panel_units(p, s.N, jp);
      if (pu.j0 >= s.N) break;
      const int64_t j0 = pu.j0, panels = pu.panels, units = pu.units;
      for (int64_t kp = 0; kp < p.nk; ++kp) {
        const int64_t k0 = kp * p.kc;
        const int64_t kc = std::min(p.kc, s.K - k0), kd = depth(kc, true);
#pragma omp for schedule(static)
        for (int64_t q = 0; q < panels; ++q) {
          const int64_t jq = j0 + q * kNr;
          uint32_t* d = bw + q * kNr * kpp;
          pack_b_pairs(d, s.tb ? b + jq * s.ldb + k0 : b + k0 * s.ldb + jq, s.ldb, s.tb, kc,
                       std::min<int64_t>(kNr, s.N - jq));
          std::memset(d + kd * kNr, 0, sizeof(uint32_t) * (kpp - kd) * kNr);
        }
        int64_t packed_bm = -1;
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
          const Unit un = unit_of(p, pu, u, kMrAmx, s.M);
          const int64_t bm = un.bm, r0 = un.r0, r1 = un.r1;
          if (bm != packed_bm) {
            pack_a_amx(ap, s.ta ? a + k0 * s.lda + r0 : a + r0 * s.lda + k0, s.lda, s.ta, kc, r1 - r0, kpp);
            packed_bm = bm;
          }
          const int64_t q0 = un.q0, q1 = un.q1;
          AmxMicro m{};
          m.lda = kpp;
          m.b_second = kNr * kpp;
          m.ldc = s.ldc;
          m.kpp = kpp;
          m.acc = s.accumulate || kp > 0;
          // Each tile's sum is the same in either order.
          auto tile = [&](int64_t r, int64_t q, int64_t w) {
            const int64_t jq = j0 + q * kNr;
            m.n = static_cast<int>(std::min<int64_t>(w * kNr, s.N - jq));
            m.b = bw + q * kNr * kpp;
            m.a = ap + (r - r0) * kpp;
            m.c = c + r * s.ldc + jq;
            m.m = static_cast<int>(std::min<int64_t>(kMrAmx, r1 - r));
            micro_amx(m);
          };
          if (amx.strip_outer) {
            for (int64_t r = r0; r < r1; r += kMrAmx)
              for (int64_t q = q0; q < q1; q += 2) tile(r, q, q + 1 < q1 ? 2 : 1);
          } else {
            for (int64_t q = q0; q < q1; q += 2)
              for (int64_t r = r0; r < r1; r += kMrAmx) tile(r, q, q + 1 < q1 ? 2 : 1);
          }
        }
      }
    }
    amx_end();
  }
}

// bf16 products on the amx path with few rows (the plan's skinny test): the skinny nest over AMX tiles. For
// each k slice, each thread packs every strip of A once, then for each pair of B panels in its column ranges
// packs them into its own buffer just before the tiles read them: no shared panel written and read back, no
// barrier (the column ranges are the same static share for every slice). The k slices, panel pairs and micro
// tiles are the blocked AMX nest's, so the bits are too.
size_t skinny_amx_words(const Plan& p, int64_t kpp) {
  return static_cast<size_t>(p.strips * kMrAmx * kpp + 2 * kNr * kpp);
}

template <class BP>
void run_skinny_amx(const GemmShape& s, const Plan& p, const uint16_t* a, BP b, float* c, float* apack) {
  const int64_t kpp = amx_depth(p.kc);
  const int64_t panels = cdiv(s.N, kNr);
  const size_t stride = skinny_amx_words(p, kpp);
#pragma omp parallel
  {
    uint32_t* ap = reinterpret_cast<uint32_t*>(apack) + static_cast<size_t>(omp_get_thread_num()) * stride;
    uint32_t* bp = ap + p.strips * kMrAmx * kpp;
    amx_begin();
    auto pack_a = [&](int64_t k0, int64_t kc) {
      pack_a_amx(ap, s.ta ? a + k0 * s.lda : a + k0, s.lda, s.ta, kc, s.M, kpp);
    };
    skinny_loop(s, p, panels, pack_a, [&](int64_t kp, int64_t k0, int64_t kc, int64_t q, int64_t q1) -> int64_t {
      const int64_t jq = q * kNr, w = q + 1 < q1 ? 2 : 1, kd = depth(kc, true);
      AmxMicro m{};
      m.lda = kpp;
      m.b_second = kNr * kpp;
      m.ldc = s.ldc;
      m.kpp = kpp;
      m.acc = s.accumulate || kp > 0;
      m.b = bp;
      m.n = static_cast<int>(std::min<int64_t>(w * kNr, s.N - jq));
      for (int64_t h = 0; h < w; ++h) {
        const int64_t jh = jq + h * kNr;
        uint32_t* d = bp + h * kNr * kpp;
        pack_b_pairs(d, s.tb ? b + jh * s.ldb + k0 : b + k0 * s.ldb + jh, s.ldb, s.tb, kc,
                     std::min<int64_t>(kNr, s.N - jh));
        std::memset(d + kd * kNr, 0, sizeof(uint32_t) * (kpp - kd) * kNr);
      }
      for (int64_t r = 0; r < s.M; r += kMrAmx) {
        m.a = ap + r * kpp;
        m.c = c + r * s.ldc + jq;
        m.m = static_cast<int>(std::min<int64_t>(kMrAmx, s.M - r));
        micro_amx(m);
      }
      return w;
    });
    amx_end();
  }
}

template <class TA, class BP>
void run_blocked(const GemmShape& s, const TA* a, BP b, float* c, float* bpack, float* apack) {
  if (one_row(s)) {  // a GEMV: a's row gathered in f32 into bpack, then B streamed (run_row)
    for (int64_t k = 0; k < s.K; ++k) bpack[k] = widen(a[s.ta ? k * s.lda : k]);
    if constexpr (std::is_same_v<BP, QuantB>) {
      if (s.tb && !b.round && b.q->dot_rows_q8 && s.K % kQ8Block == 0) {  // and in 8 bits after it
        const Q8Act qa = q8_act_at(bpack + s.K, s.K);
        quantise_q8_act(bpack, qa);
        return run_row(s, bpack, b, c, apack, &qa);
      }
    }
    return run_row(s, bpack, b, c, apack, nullptr);
  }
  if constexpr (std::is_same_v<TA, uint16_t>) {
    if (use_amx(s)) {
      const AmxPlan ap = amx_plan(s);
      if (ap.p.skinny) return run_skinny_amx(s, ap.p, a, b, c, apack);
      return run_blocked_amx(s, ap, a, b, c, bpack, apack);
    }
  }
  const Plan p = make_plan(s);
  if (p.skinny) return run_skinny(s, p, a, b, c, apack);
  const Kernels& kern = kernels();
  const bool avx2 = kern.avx2, pairs = use_pairs(s);
  // A transposed f32 A packs into strips of eight rows where the ISA has kernels for them (packed8).
  const bool packed8 = std::is_same_v<TA, float> && s.ta && kern.packed8_wide3[1] != nullptr;
  const int64_t amr = packed8 ? kMrRows : kMr;  // rows of a packed strip
  const MicroFn* micro = pairs ? kern.packed_pairs : packed8 ? kern.packed8 : kern.packed;
  const MicroFn* wide = pairs ? kern.packed_pairs_wide : packed8 ? kern.packed8_wide : kern.packed_wide;
  const MicroFn* wide3 = pairs ? nullptr : packed8 ? kern.packed8_wide3 : kern.packed_wide3;
  const size_t a_stride = block_floats(p);
  const bool rows_of_b = std::is_same_v<BP, const float*> && !s.tb && !pairs;
  // An f32 A stored (M, K) is read where it is by kernels of unpacked rows, where the ISA has them (see
  // micro_avx512_wide3<M, true>): 6 x kc strips of it stay in L1 as packed ones would, and the pass that would
  // pack them is saved (up to 8% of a product with N = 128). A transposed A is still packed (its rows would be
  // columns, a cache line read for 6 floats).
  const bool in_place = std::is_same_v<TA, float> && !s.ta && kern.rows_wide3[1] != nullptr;
#pragma omp parallel
  {
    float* ap = apack + static_cast<size_t>(omp_get_thread_num()) * a_stride;
    for (int64_t jp = 0; jp < p.nj; ++jp) {
      const PanelUnits pu = panel_units(p, s.N, jp);
      if (pu.j0 >= s.N) break;
      const int64_t j0 = pu.j0, panels = pu.panels, units = pu.units;
      for (int64_t kp = 0; kp < p.nk; ++kp) {
        const int64_t k0 = kp * p.kc;
        const int64_t kc = std::min(p.kc, s.K - k0), kd = depth(kc, pairs);
        const bool acc = s.accumulate || kp > 0;
        if (rows_of_b) {  // f32 rows of B: this thread's panels a row of k at a time (see pack_b_rows)
          const int nt = omp_get_num_threads(), t = omp_get_thread_num();
          const int64_t qa = panels * t / nt, qb = panels * (t + 1) / nt;
          if constexpr (std::is_same_v<BP, const float*>)
            if (qb > qa)
              pack_b_rows(bpack + qa * kNr * kd, b + k0 * s.ldb + j0 + qa * kNr, s.ldb, kc, qb - qa,
                          std::min(s.N - (j0 + qa * kNr), (qb - qa) * kNr), kd);
#pragma omp barrier
        } else {
#pragma omp for schedule(static)
          for (int64_t q = 0; q < panels; ++q) {
            const int64_t jq = j0 + q * kNr;
            const BP src = s.tb ? b + jq * s.ldb + k0 : b + k0 * s.ldb + jq;
            pack_b_any(bpack + q * kNr * kd, src, s.ldb, s.tb, kc, std::min<int64_t>(kNr, s.N - jq), avx2, pairs);
          }
        }
        int64_t packed_bm = -1;  // the row block now in ap (units of one block are consecutive)
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; ++u) {
          const Unit un = unit_of(p, pu, u, kMr, s.M);
          const int64_t bm = un.bm, r0 = un.r0, r1 = un.r1;
          if (bm != packed_bm && !in_place) {
            const TA* src = s.ta ? a + k0 * s.lda + r0 : a + r0 * s.lda + k0;
            pack_a_any(ap, src, s.lda, s.ta, kc, r1 - r0, avx2, pairs, packed8);
            packed_bm = bm;
          }
          const int64_t q0 = un.q0, q1 = un.q1;
          Micro m{};
          m.ras = 1;
          m.cas = amr;
          m.ldc = s.ldc;
          m.kc = kd;
          m.acc = acc;
          for (int64_t q = q0; q < q1;) {
            const int64_t jq = j0 + q * kNr;
            // Three or two panels at a time where the ISA has wide kernels and the unit has them (each
            // output's sum is the same).
            const int64_t w = wide3 && wide3[1] && q + 2 < q1 ? 3 : wide[1] && q + 1 < q1 ? 2 : 1;
            m.n = static_cast<int>(std::min<int64_t>(w * kNr, s.N - jq));
            m.b = bpack + q * kNr * kd;
            const MicroFn* fn = w == 3 ? wide3 : w == 2 ? wide : micro;
            if (in_place) {  // unpacked A rows: micro[0] and tile_wide[0] read B's panels at bs = kNr, b2 apart
              fn = w == 3 ? kern.rows_wide3 : w == 2 ? kern.tile_wide[0] : kern.micro[0];
              m.ras = s.lda;
              m.b2 = kNr * kd;
            }
            // In place, three panels take eight rows at a time (rows_wide3: the unit's rows need not be a
            // multiple of eight, the last call takes what is left); the other kernels six.
            const int64_t mr = in_place ? (w == 3 ? kMrRows : kMr) : amr;
            for (int64_t r = r0; r < r1; r += mr) {
              if constexpr (std::is_same_v<TA, float>)
                if (in_place) {
                  m.a = a + r * s.lda + k0;
                  m.c = c + r * s.ldc + jq;
                  fn[std::min<int64_t>(mr, r1 - r)](m);
                  continue;
                }
              m.a = ap + (r - r0) * kd;
              m.c = c + r * s.ldc + jq;
              fn[std::min<int64_t>(mr, r1 - r)](m);
            }
            q += w;
          }
        }
      }
    }
  }
}

}  // namespace

size_t amx_tile_words(int64_t M, int64_t N, int64_t K) {
  const int64_t kpp = amx_depth(std::min(K, kKcAmx));
  return static_cast<size_t>((cdiv(M, 16) * 16 + cdiv(N, 32) * 32) * kpp);
}

void tile_bf16_amx(const GemmShape& s, const uint16_t* a, const uint16_t* b, float* c, uint32_t* work) {
  const int64_t M = s.M, N = s.N, K = s.K, panels = cdiv(N, kNr);
  amx_begin();
  for (int64_t k0 = 0; k0 < K; k0 += kKcAmx) {
    const int64_t kc = std::min(kKcAmx, K - k0), kd = depth(kc, true), kpp = amx_depth(kc);
    uint32_t* ap = work;
    uint32_t* bp = work + cdiv(M, 16) * 16 * kpp;
    pack_a_amx(ap, s.ta ? a + k0 * s.lda : a + k0, s.lda, s.ta, kc, M, kpp);
    for (int64_t q = 0; q < panels; ++q) {
      uint32_t* d = bp + q * kNr * kpp;
      const int64_t jq = q * kNr;
      pack_b_pairs(d, s.tb ? b + jq * s.ldb + k0 : b + k0 * s.ldb + jq, s.ldb, s.tb, kc, std::min<int64_t>(kNr, N - jq));
      std::memset(d + kd * kNr, 0, sizeof(uint32_t) * (kpp - kd) * kNr);
    }
    AmxMicro m{};
    m.lda = kpp;
    m.b_second = kNr * kpp;
    m.ldc = s.ldc;
    m.kpp = kpp;
    m.acc = s.accumulate || k0 > 0;
    for (int64_t q = 0; q < panels; q += 2) {
      m.n = static_cast<int>(std::min<int64_t>(2 * kNr, N - q * kNr));
      m.b = bp + q * kNr * kpp;
      for (int64_t r = 0; r < M; r += kMrAmx) {
        m.a = ap + r * kpp;
        m.c = c + r * s.ldc + q * kNr;
        m.m = static_cast<int>(std::min<int64_t>(kMrAmx, M - r));
        micro_amx(m);
      }
    }
  }
  amx_end();
}

BlockedSizes blocked_sizes(const GemmShape& s) {
  BlockedSizes z;
  if (one_row(s)) {  // a's row in f32, then in 8 bits (where B takes integer one-row products)
    z.b_floats = static_cast<size_t>(s.K) + (q8_act_bytes(s.K / kQ8Block * kQ8Block) + 3) / 4;
    z.a_floats_per_thread = static_cast<size_t>(kRowGroup * kRowSeg);
    return z;
  }
  if (use_amx(s)) {
    const AmxPlan ap = amx_plan(s);
    const Plan& p = ap.p;
    const int64_t kpp = ap.kpp;
    if (p.skinny) {
      z.a_floats_per_thread = skinny_amx_words(p, kpp);
      return z;
    }
    z.b_floats = static_cast<size_t>(kpp * cdiv(p.nc, kNr) * kNr);
    z.a_floats_per_thread = static_cast<size_t>(p.max_strips * kMrAmx * kpp);
    return z;
  }
  const Plan p = make_plan(s);
  z.b_floats = static_cast<size_t>(p.kc * cdiv(p.nc, kNr) * kNr);
  z.a_floats_per_thread = block_floats(p);
  if (p.skinny) {
    z.b_floats = 0;
    z.a_floats_per_thread = skinny_floats(p);
  }
  return z;
}

void gemm_blocked(const GemmShape& s, const void* a, const void* b, float* c, float* bpack, float* apack) {
  if (s.b_quant) {
    // A matrix of bf16 values (QuantBase's "bf16" format: --base-dtype or --embed-dtype bf16) read as bf16 under bf16
    // compute is a bf16 B where it is: the values its rows dequantise to (exact in f32, so rounding them changes
    // none) packed without the dequantised copy, the same plan and packing buffers, so the same bits.
    if (s.ab == DType::bf16 && s.b_as_bf16 && std::strcmp(s.b_quant->format, "bf16") == 0) {
      GemmShape t = s;
      t.b_quant = nullptr, t.b_qrow0 = 0, t.b_as_bf16 = false;
      return run_blocked(t, static_cast<const uint16_t*>(a),
                         static_cast<const uint16_t*>(s.b_quant->data) + s.b_qrow0 * s.ldb, c, bpack, apack);
    }
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
