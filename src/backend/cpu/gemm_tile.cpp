// Gemm::tile: a single-threaded f32 GEMM for small and medium products inside OpenMP regions
// (attention tiles, cross-entropy tiles). No heap allocation, deterministic, all transposes.
//
// Structure (a reduced GotoBLAS/BLIS loop nest):
//   for each k block of up to kKc:          C (+)= A[:, kb] . B[kb, :]   (the first block overwrites
//     for each column block of up to kNc:                                   unless accumulate)
//       for each 16-wide column panel:      B panel packed on the stack, kc x 16 contiguous floats
//         for each 6-row strip of C:        the 6x16 micro-kernel, 12 accumulators in registers
//
// B is always packed (transposed when b is stored (N, K), zero-padded past N): the panel stays in L1
// while every strip of C uses it, and read in place at a power-of-two leading dimension its rows would
// fall into a few L1 sets and be evicted between strips (2x slower for the attention shapes).
// A is never packed: the micro-kernel broadcasts a(i, k) straight from memory, reading row i of a
// stored (M, K) or column i of a stored (K, M), which stays in L2 across the panels.
//
// The micro-kernel has an AVX2+FMA version (eight-wide vectors, two per row of the 6x16 tile) chosen
// at run time when the CPU has AVX2 and FMA, and a portable scalar version with the same blocking.
// A given CPU always takes the same path, so results are bitwise reproducible on it; the k order of
// each output's sum is fixed (k ascending within a block, blocks in order).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "backend/cpu/gemm.h"
#include "core/error.h"

namespace oomless {

namespace {

constexpr int kMr = 6;            // rows of the micro tile
constexpr int kNr = 16;           // columns of the micro tile
constexpr int64_t kKc = 256;      // k block
constexpr int64_t kNc = 64;       // columns packed at once: kKc * kNc floats = 64 KiB of stack

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
};

// ---- portable micro-kernel --------------------------------------------------------------------------

template <int M>
void micro_generic(const Micro& u) {
  float acc[M][kNr] = {};
  for (int64_t k = 0; k < u.kc; ++k) {
    const float* bk = u.b + k * kNr;
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

// TA: a is stored (K, M) (ras = 1, cas = lda), else (M, K) (ras = lda, cas = 1); the template lets
// the compiler keep the six row pointers (or the one column pointer) in registers.
template <int M, bool TA>
__attribute__((target("avx2,fma"))) void micro_avx2(const Micro& u) {
  __m256 c0[M], c1[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) {
    c0[i] = _mm256_setzero_ps();
    c1[i] = _mm256_setzero_ps();
  }
  const float* b = u.b;
  if constexpr (TA) {
    const float* a = u.a;
    const int64_t lda = u.cas;
    for (int64_t k = 0; k < u.kc; ++k) {
      const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) {
        const __m256 ai = _mm256_broadcast_ss(a + i);
        c0[i] = _mm256_fmadd_ps(ai, b0, c0[i]);
        c1[i] = _mm256_fmadd_ps(ai, b1, c1[i]);
      }
      a += lda;
      b += kNr;
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
      b += kNr;
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

// Packs columns [j0, j0 + nc) of b(k, j) for k in [0, kc) into panels of 16 columns, each kc x 16
// floats, columns past nc zero. b(k, j) = src[j * ld + k] (b stored (N, K), the transposed case).
void pack_bt_generic(float* dst, const float* src, int64_t ld, int64_t kc, int64_t nc) {
  for (int64_t p = 0; p < nc; p += kNr) {
    float* d = dst + p * kc;
    for (int64_t k = 0; k < kc; ++k)
      for (int j = 0; j < kNr; ++j) d[k * kNr + j] = p + j < nc ? src[(p + j) * ld + k] : 0.0f;
  }
}

// The same with 8x8 register transposes for the full 8 x 8 pieces.
__attribute__((target("avx2,fma"))) void pack_bt_avx2(float* dst, const float* src, int64_t ld, int64_t kc,
                                                      int64_t nc) {
  for (int64_t p = 0; p < nc; p += kNr) {
    float* d = dst + p * kc;
    for (int half = 0; half < 2; ++half) {
      const int64_t j0 = p + 8 * half;
      const int64_t nj = std::clamp<int64_t>(nc - j0, 0, 8);
      int64_t k = 0;
      if (nj == 8) {
        for (; k + 8 <= kc; k += 8) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + (j0 + j) * ld + k);
          const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
          const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
          const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
          const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
          const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
          const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
          const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
          const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
          float* o = d + k * kNr + 8 * half;
          _mm256_storeu_ps(o + 0 * kNr, _mm256_permute2f128_ps(s0, s4, 0x20));
          _mm256_storeu_ps(o + 1 * kNr, _mm256_permute2f128_ps(s1, s5, 0x20));
          _mm256_storeu_ps(o + 2 * kNr, _mm256_permute2f128_ps(s2, s6, 0x20));
          _mm256_storeu_ps(o + 3 * kNr, _mm256_permute2f128_ps(s3, s7, 0x20));
          _mm256_storeu_ps(o + 4 * kNr, _mm256_permute2f128_ps(s0, s4, 0x31));
          _mm256_storeu_ps(o + 5 * kNr, _mm256_permute2f128_ps(s1, s5, 0x31));
          _mm256_storeu_ps(o + 6 * kNr, _mm256_permute2f128_ps(s2, s6, 0x31));
          _mm256_storeu_ps(o + 7 * kNr, _mm256_permute2f128_ps(s3, s7, 0x31));
        }
      }
      for (; k < kc; ++k)
        for (int j = 0; j < 8; ++j) d[k * kNr + 8 * half + j] = j < nj ? src[(j0 + j) * ld + k] : 0.0f;
    }
  }
}

// Copies b(k, j) = src[k * ld + j], j < n <= 16, into one zero-padded kc x 16 panel.
void pack_b_panel(float* dst, const float* src, int64_t ld, int64_t kc, int64_t n) {
  if (n == kNr) {
    for (int64_t k = 0; k < kc; ++k) std::memcpy(dst + k * kNr, src + k * ld, kNr * sizeof(float));
    return;
  }
  for (int64_t k = 0; k < kc; ++k) {
    float* d = dst + k * kNr;
    for (int j = 0; j < kNr; ++j) d[j] = j < n ? src[k * ld + j] : 0.0f;
  }
}

using MicroFn = void (*)(const Micro&);

struct Kernels {
  MicroFn micro[2][kMr + 1];  // [ta][rows]
  void (*pack_bt)(float*, const float*, int64_t, int64_t, int64_t);
};

template <bool TA, int... M>
void fill_avx2(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_avx2<M + 1, TA>), ...);
}
template <int... M>
void fill_generic(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_generic<M + 1>), ...);
}

Kernels choose_kernels() {
  Kernels k{};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    fill_avx2<false>(k.micro[0], std::make_integer_sequence<int, kMr>{});
    fill_avx2<true>(k.micro[1], std::make_integer_sequence<int, kMr>{});
    k.pack_bt = &pack_bt_avx2;
  } else {
    fill_generic(k.micro[0], std::make_integer_sequence<int, kMr>{});
    fill_generic(k.micro[1], std::make_integer_sequence<int, kMr>{});
    k.pack_bt = &pack_bt_generic;
  }
  return k;
}

const Kernels& kernels() {
  static const Kernels k = choose_kernels();
  return k;
}

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
  const int64_t ras = s.ta ? 1 : lda, cas = s.ta ? lda : 1;
  alignas(64) float packed[kKc * kNc];

  for (int64_t k0 = 0; k0 < K; k0 += kKc) {
    const int64_t kc = std::min(kKc, K - k0);
    const bool acc = s.accumulate || k0 > 0;
    const float* ak = a + k0 * cas;
    for (int64_t n0 = 0; n0 < N; n0 += kNc) {
      const int64_t nc = std::min(kNc, N - n0);
      if (s.tb) kern.pack_bt(packed, b + n0 * ldb + k0, ldb, kc, nc);
      for (int64_t p = 0; p < nc; p += kNr) {
        const int n = static_cast<int>(std::min<int64_t>(kNr, nc - p));
        Micro u{};
        u.ras = ras;
        u.cas = cas;
        u.ldc = ldc;
        u.kc = kc;
        u.n = n;
        u.acc = acc;
        if (s.tb) {
          u.b = packed + p * kc;
        } else {
          pack_b_panel(packed, b + k0 * ldb + n0 + p, ldb, kc, n);
          u.b = packed;
        }
        for (int64_t i0 = 0; i0 < M; i0 += kMr) {
          const int m = static_cast<int>(std::min<int64_t>(kMr, M - i0));
          u.a = ak + i0 * ras;
          u.c = c + i0 * ldc + n0 + p;
          micro[m](u);
        }
      }
    }
  }
}

}  // namespace oomless
