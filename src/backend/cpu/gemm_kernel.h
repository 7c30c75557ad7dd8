// Internal to the CPU GEMMs (Gemm::tile in gemm_tile.cpp, the blocked Gemm::run in gemm_blocked.cpp):
// the 6x16 micro-kernel and the panel packing routines, written once for both.
//
// The micro-kernel computes a 6 x 16 tile (or fewer rows) of C from a(i, k) = a[i * ras + k * cas] and
// a packed B panel b(k, j) = b[k * 16 + j], summing k in ascending order for every output, and either
// overwrites C or adds the sum to it. A packed A strip (6 rows interleaved, a[k * 6 + i]) is the
// ras = 1, cas = 6 case. There is an AVX2+FMA version (eight-wide vectors, two per row, twelve
// accumulators in registers), an AVX-512 one (gemm_avx512.cpp: one ZMM vector per row; the same bits as
// AVX2) and a portable scalar version, chosen at run time by GemmIsa (gemm.h); each ISA's results are
// bitwise reproducible, and f32 results are the same on AVX2 and AVX-512.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "backend/cpu/gemm.h"
#include "core/dtype.h"

namespace oomless::gemm_detail {

constexpr int kMr = 6;   // rows of the micro tile
constexpr int kNr = 16;  // columns of the micro tile
// Rows of the AVX-512 f32 kernels of eight rows (rows_wide3, packed8*, rows_t): at 8 x 48, twenty-four
// accumulators, where six rows leave the FMA pipes waiting on B's loads.
constexpr int kMrRows = 8;

// Where the micro-kernel finds its operands. a(i, k) = a[i * ras + k * cas]; b(k, j) = b[k * 16 + j]
// (a packed panel); c(i, j) = c[i * ldc + j] for j < n.
struct Micro {
  const float* a;
  int64_t ras, cas;
  const float* b;
  float* c;
  int64_t ldc;
  int64_t kc;
  int n;     // valid columns, 1..16
  bool acc;  // add to c instead of overwriting it
  // Floats from one k's row of B to the next: kNr in a packed panel; Gemm::tile passes B's own rows (its
  // row stride) for a full panel it need not pack. Only the kernels of unpacked A (Gemm::tile) read it.
  int64_t bs = kNr;
  // Floats from the first of two adjacent panels to the second (the tile_wide kernels): kNr * kc packed,
  // kNr for B's rows read in place.
  int64_t b2 = 0;
};

// ---- portable micro-kernel --------------------------------------------------------------------------

template <int M>
void micro_generic(const Micro& u) {
  float acc[M][kNr] = {};
  for (int64_t k = 0; k < u.kc; ++k) {
    const float* bk = u.b + k * u.bs;
    for (int i = 0; i < M; ++i) {
      const float ai = u.a[i * u.ras + k * u.cas];
      for (int j = 0; j < kNr; ++j) acc[i][j] += ai * bk[j];
    }
  }
  for (int i = 0; i < M; ++i) {
    float* ci = u.c + i * u.ldc;
    for (int j = 0; j < u.n; ++j) ci[j] = u.acc ? ci[j] + acc[i][j] : acc[i][j];
  }
}

// ---- AVX2 + FMA micro-kernel ------------------------------------------------------------------------

// Lane masks for the last, partial panel: lanes [0, n) of a 16-wide row set.
__attribute__((target("avx2,fma"))) inline void lane_masks(int n, __m256i* lo, __m256i* hi) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  *lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
  *hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), idx);
}

// TA: a(i, k) = a[k * cas + i] (a stored (K, M)), else a[i * ras + k]; PACKED: a packed strip,
// a(i, k) = a[k * 6 + i], whose constant stride lets the unrolled loop use immediate offsets. The
// template lets the compiler keep the six row pointers (or the one column pointer) in registers.
template <int M, bool TA, bool PACKED = false>
__attribute__((target("avx2,fma"))) void micro_avx2(const Micro& u) {
  // In the blocked GEMM C is out of cache (each k slice passes over all of it) and is read or written
  // only after the k loop: fetching its lines now hides the misses. Gemm::tile's C is in cache.
  if constexpr (PACKED) {
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(u.c + i * u.ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(u.c + i * u.ldc + kNr - 1), _MM_HINT_T0);
    }
  }
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) {
    c0[i] = _mm256_setzero_ps();
    c1[i] = _mm256_setzero_ps();
  }
  const float* b = u.b;
  if constexpr (PACKED) {
    const float* a = u.a;
    const int64_t kc = u.kc;
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a + i);
        c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
        c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
      }
      a += kMr;
      b += kNr;
    }
  } else if constexpr (TA) {
    const float* a = u.a;
    const int64_t lda = u.cas, kc = u.kc;
    for (int64_t k = 0; k < kc; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a + i);
        c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
        c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
      }
      a += lda;
      b += u.bs;
    }
  } else {
    const float* ar[kMr];
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) ar[i] = u.a + i * u.ras;
    for (int64_t k = 0; k < u.kc; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) {
        const __m256 ai = _mm256_broadcast_ss(ar[i] + k);
        c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
        c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
      }
      b += u.bs;
    }
  }
  if (u.n == kNr) {
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      float* ci = u.c + i * u.ldc;
      if (u.acc) {
        c0[i] = _mm256_add_ps(_mm256_loadu_ps(ci), c0[i]);
        c1[i] = _mm256_add_ps(_mm256_loadu_ps(ci + 8), c1[i]);
      }
      _mm256_storeu_ps(ci, c0[i]);
      _mm256_storeu_ps(ci + 8, c1[i]);
    }
  } else {
    __m256i lo, hi;
    lane_masks(u.n, &lo, &hi);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      float* ci = u.c + i * u.ldc;
      if (u.acc) {
        c0[i] = _mm256_add_ps(_mm256_maskload_ps(ci, lo), c0[i]);
        c1[i] = _mm256_add_ps(_mm256_maskload_ps(ci + 8, hi), c1[i]);
      }
      _mm256_maskstore_ps(ci, lo, c0[i]);
      _mm256_maskstore_ps(ci + 8, hi, c1[i]);
    }
  }
}

// ---- B packing: panels of 16 columns, each kc x 16 contiguous floats, columns past nc zero ----------

// Packs columns [0, nc) of b(k, j) = src[j * ld + k] (b stored (N, K), the transposed case) for k in
// [0, kc); panel p (columns 16p..16p+15) starts at dst + 16p * kc.
inline void pack_bt_generic(float* dst, const float* src, int64_t ld, int64_t kc, int64_t nc) {
  for (int64_t p = 0; p < nc; p += kNr) {
    float* d = dst + p * kc;
    for (int64_t k = 0; k < kc; ++k)
      for (int j = 0; j < kNr; ++j) d[k * kNr + j] = p + j < nc ? src[(p + j) * ld + k] : 0.0f;
  }
}

// An f32 read as bf16 (rounded to nearest even as it is loaded): a packing source type like float.
struct F32AsBf16 {
  float v;
};
static_assert(sizeof(F32AsBf16) == sizeof(float));

// Values as floats: T is float, uint16_t (bf16 bits) or F32AsBf16; load8 reads eight consecutive ones.
inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return bf16_to_f32(v); }
inline float widen(F32AsBf16 v) { return round_to_bf16(v.v); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// f32_to_bf16 on eight lanes: add 0x7fff plus the kept lowest bit and clear the low half; a NaN keeps
// its top half with the quiet bit set.
__attribute__((target("avx2,fma"))) inline __m256 load8(const F32AsBf16* p) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}

// The transpose of the 8x8 block r (row i = r[i]) into t: t[j] holds column j.
__attribute__((target("avx2,fma"), always_inline)) inline void transpose8(const __m256 r[8], __m256 t[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  t[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  t[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  t[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  t[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  t[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  t[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  t[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  t[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Stores the transpose of the 8x8 block r (row i = r[i]) as 8 rows of 8 floats, row j at o + j * stride.
__attribute__((target("avx2,fma"))) inline void store_transposed8(float* o, int64_t stride, const __m256 r[8]) {
  __m256 t[8];
  transpose8(r, t);
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + j * stride, t[j]);
}

// The same with 8x8 register transposes for the full 8 x 8 pieces (and bf16 widened on the way).
template <class T>
__attribute__((target("avx2,fma"))) void pack_bt_avx2(float* dst, const T* src, int64_t ld, int64_t kc, int64_t nc) {
  for (int64_t p = 0; p < nc; p += kNr) {
    float* d = dst + p * kc;
    for (int half = 0; half < 2; ++half) {
      const int64_t j0 = p + 8 * half;
      const int64_t nj = std::clamp<int64_t>(nc - j0, 0, 8);
      int64_t k = 0;
      if (nj == 8) {
        for (; k + 8 <= kc; k += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = load8(src + (j0 + j) * ld + k);
          store_transposed8(d + k * kNr + 8 * half, kNr, r);
        }
      }
      for (; k < kc; ++k)
        for (int j = 0; j < 8; ++j) d[k * kNr + 8 * half + j] = j < nj ? widen(src[(j0 + j) * ld + k]) : 0.0f;
    }
  }
}

// Copies b(k, j) = src[k * ld + j], j < n <= 16, into one zero-padded kc x 16 panel.
inline void pack_b_panel(float* dst, const float* src, int64_t ld, int64_t kc, int64_t n) {
  if (n == kNr) {
    for (int64_t k = 0; k < kc; ++k) std::memcpy(dst + k * kNr, src + k * ld, kNr * sizeof(float));
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    float* d = dst + k * kNr;
    for (int j = 0; j < kNr; ++j) d[j] = j < n ? src[k * ld + j] : 0.0f;
  }
}

// ---- run-time dispatch ------------------------------------------------------------------------------

using MicroFn = void (*)(const Micro&);

// The kernels of one GemmIsa (gemm_isa.cpp builds them; GemmIsa is in gemm.h).
struct Kernels {
  MicroFn micro[2][kMr + 1];  // [ta][rows]
  MicroFn packed[kMr + 1];    // [rows], a packed A strip (ras = 1, cas = 6)
  // [rows], the same over two adjacent packed panels (n: 17..32 columns, the second kNr * kc floats after
  // the first); null where the ISA has none.
  MicroFn packed_wide[kMr + 1];
  // [rows], the same over three adjacent packed panels (n: 33..48 columns, the k-th kNr * kc * k floats after
  // the first); null where the ISA has none.
  MicroFn packed_wide3[kMr + 1];
  // [rows], the same with A's rows read where they are (row i at a + i * ras, k contiguous; no packed strip),
  // up to kMrRows rows; null where the ISA has none.
  MicroFn rows_wide3[kMrRows + 1];
  // [rows], packed, wide and wide3 over packed strips of kMrRows rows (a[k * 8 + i]): the blocked nest's
  // products of a transposed f32 A, whose strips cost no more to pack eight rows high; null where the ISA
  // has none.
  MicroFn packed8[kMrRows + 1], packed8_wide[kMrRows + 1], packed8_wide3[kMrRows + 1];
  // [rows], packed8_wide3 with B's rows read where they are (b(k, j) = b[k * bs + j], the k-th panel b2 = 16
  // floats after the first; all 48 columns valid): the skinny nest's f32 B stored (K, N).
  MicroFn packed8_brows3[kMrRows + 1];
  // [panels - 1][rows], the skinny nest's f32 B stored (N, K) with the roles swapped (gemm_avx512.cpp,
  // micro_avx512_rows_t): B's rows read in place, A^T in packed panels, C stored transposed; null where the ISA
  // has none.
  MicroFn rows_t[3][kMrRows + 1];
  // [rows], bf16 k pairs (gemm_avx512.cpp): a pair strip and a pair panel, kc counting pairs; null
  // where the ISA has no pair instruction (bf16 then widens to f32 while packing).
  MicroFn packed_pairs[kMr + 1];
  MicroFn packed_pairs_wide[kMr + 1];  // the same over two adjacent pair panels
  // [ta][rows], unpacked A (Gemm::tile) over two adjacent panels (n: 17..32 columns, Micro::b2 apart); null
  // where the ISA has none (AVX2's 6 x 16 kernel already keeps twelve chains in flight).
  MicroFn tile_wide[2][kMr + 1];
  void (*pack_bt)(float*, const float*, int64_t, int64_t, int64_t);
  // c[0, n) (+)= x (1, K) . b (K, n), ldb apart, each output the chain of fused multiply-adds over k ascending
  // from 0 (the one-row product of an f32 B stored (K, N), run_row); null where the ISA has none.
  void (*row_axpy)(float* c, const float* x, const float* b, int64_t ldb, int64_t K, int64_t n, bool accumulate);
  bool avx2;                  // the AVX2 packing routines may run
  bool amx;                   // bf16 products of two rows or more take the AMX loop nest (micro_amx)
  GemmIsa isa;
};

template <bool TA, bool PACKED, int... M>
void fill_avx2(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_avx2<M + 1, TA, PACKED>), ...);
}
template <int... M>
void fill_generic(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_generic<M + 1>), ...);
}
// The AVX-512 f32 kernels, and with bf16 the AVX512-BF16 pair kernels (gemm_avx512.cpp).
void fill_avx512_kernels(Kernels& k, bool bf16);
// vdpbf16ps's FLOP rate over FMA's on this core: twelve independent chains of each, timed in turn.
double measure_bf16_pair_speed();

// ---- AMX-BF16 (gemm_amx.cpp) ------------------------------------------------------------------------

constexpr int kMrAmx = 32;  // rows of the AMX micro tile (two 16-row tiles); columns: two 16-column panels

// Up to 32 x 32 outputs: c(i, j) (+)= sum over pairs p < kpp (a multiple of 16) of the pair products of
// a[i * lda + p] and b[p * 16 + j] (j < 16) or b[b_second + p * 16 + j - 16]; rows i < m, columns j < n.
// The A block holds 16 (m <= 16) or 32 rows, zero past m.
struct AmxMicro {
  const uint32_t* a;
  int64_t lda;  // words
  const uint32_t* b;
  int64_t b_second;  // words from the first B panel to the second
  float* c;
  int64_t ldc;
  int64_t kpp;
  int m, n;
  bool acc;
};
// GCC 12's tile load and store intrinsics are asm statements that name no memory operand: this barrier, around
// them, keeps the compiler from moving or dropping the stores a tile load reads and the reads of what a tile
// store wrote.
inline void tile_barrier() { __asm__ volatile("" ::: "memory"); }
// Between amx_begin and amx_end on the calling thread (which configure and release the tiles).
void micro_amx(const AmxMicro& u);
void amx_begin();
void amx_end();
// A single-threaded bf16 product on AMX tiles (the attention tiles under bf16 compute): c (M, N) (+)= op(a)
// op(b), a and b bf16 with the leading dimensions of `s` (all given), k slices of up to 1024 added in order.
// work: amx_tile_words(M, N, K) 32-bit words (the packed operands). Configures and releases the tiles.
size_t amx_tile_words(int64_t M, int64_t N, int64_t K);
void tile_bf16_amx(const GemmShape& s, const uint16_t* a, const uint16_t* b, float* c, uint32_t* work);
// Whether the OS lets this process use AMX tile data (asks it once; Linux 5.16 and later).
bool amx_os_permits();

// The kernels of the current GemmIsa (gemm_isa(); set_gemm_isa switches them between products).
const Kernels& kernels();

// ---- the blocked multi-threaded GEMM (gemm_blocked.cpp) ---------------------------------------------

// Floats of packing buffer the blocked GEMM needs for shape `s` (defaults filled): one shared B panel
// and one A block per thread.
struct BlockedSizes {
  size_t b_floats = 0;
  size_t a_floats_per_thread = 0;
};
BlockedSizes blocked_sizes(const GemmShape& s);

// c (+)= op(a) op(b) for f32 or bf16 a, b (leading dims filled in `s`), on the OpenMP threads.
// `bpack` holds b_floats, `apack` threads x a_floats_per_thread (threads = omp_get_max_threads()).
// Bitwise the same for any thread count.
void gemm_blocked(const GemmShape& s, const void* a, const void* b, float* c, float* bpack, float* apack);

}  // namespace oomless::gemm_detail
