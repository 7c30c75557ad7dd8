// The AVX-512 GEMM kernels (GemmIsa::avx512), compiled for AVX-512 and chosen at run time only on a CPU
// that has it (gemm_isa.cpp):
//
// - f32: the 6x16 micro-kernel with one 16-wide ZMM vector per row (six accumulators, one B load per
//   k), its 6x32 and 6x48 forms over two and three panels, and 8-row forms (8x16 to 8x48) where A's rows are
//   read in place or packed eight high, B's rows read in place, or the roles swapped (rows_t). Each output is
//   the same chain of fused multiply-adds in ascending k as the AVX2 kernel's, so the paths give the same
//   bits: switching ISA changes no f32 result.
// - bf16 operands (a bf16, b bf16 or f32 read as bf16, or a quantised b read as bf16), with AVX512-BF16:
//   A and B are packed in k pairs (one 32-bit word holds a(i, k) and a(i, k + 1)) and `vdpbf16ps` adds
//   both products of a pair to each fp32 lane. Intel's definition adds the odd element's product first,
//   each step rounded like an FMA (a product of two bf16 values is exact in fp32); the pairs are packed
//   with k in the odd (high) half and k + 1 in the even one, so each lane still adds k in ascending order
//   and the sums equal the widening kernels' (the conformance test checks the bits on the CPU it runs on).
//   The instruction treats denormal inputs as zero and flushes denormal results, which an fp32 FMA does
//   not. An odd K is padded with a zero pair half.
#include <immintrin.h>

#include <algorithm>
#include <chrono>

#include "backend/cpu/gemm_kernel.h"

namespace oomless::gemm_detail {

namespace {

// The tile's C rows fetched ahead of the k loop (the blocked GEMM's C is out of cache): `vectors` 16-float
// lines a row (1, 2 or 3).
template <int M>
__attribute__((target("avx512f"), always_inline)) inline void prefetch_c(const Micro& u, int vectors) {
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < vectors; ++v)
      _mm_prefetch(reinterpret_cast<const char*>(u.c + i * u.ldc + v * kNr), _MM_HINT_T0);
}

// Rows of C (+)= the accumulators: columns [0, u.n) of one 16-wide vector a row ...
template <int M>
__attribute__((target("avx512f"), always_inline)) inline void store_c(const Micro& u, __m512* c) {
  const __mmask16 mask = static_cast<__mmask16>((1u << u.n) - 1u);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    float* ci = u.c + i * u.ldc;
    if (u.acc) c[i] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, ci), c[i]);
    _mm512_mask_storeu_ps(ci, mask, c[i]);
  }
}

// ... or of two (u.n in 17..32).
template <int M>
__attribute__((target("avx512f"), always_inline)) inline void store_c_wide(const Micro& u, __m512* c0, __m512* c1) {
  const __mmask16 m1 = static_cast<__mmask16>((1u << (u.n - kNr)) - 1u);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    float* ci = u.c + i * u.ldc;
    if (u.acc) {
      c0[i] = _mm512_add_ps(_mm512_loadu_ps(ci), c0[i]);
      c1[i] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, ci + kNr), c1[i]);
    }
    _mm512_storeu_ps(ci, c0[i]);
    _mm512_mask_storeu_ps(ci + kNr, m1, c1[i]);
  }
}

// ---- f32 --------------------------------------------------------------------------------------------

// MR: the rows of a packed strip (its k stride), kMr or kMrRows.
template <int M, bool TA, bool PACKED, int MR = kMr>
__attribute__((target("avx512f"))) void micro_avx512(const Micro& u) {
  if constexpr (PACKED) prefetch_c<M>(u, 1);
  __m512 c[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) c[i] = _mm512_setzero_ps();
  const float* b = u.b;
  if constexpr (PACKED) {
    const float* a = u.a;
#pragma GCC unroll 4
    for (int64_t k = 0; k < u.kc; ++k) {
      const __m512 bk = _mm512_loadu_ps(b);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), bk, c[i]);
      a += MR;
      b += kNr;
    }
  } else if constexpr (TA) {
    const float* a = u.a;
    for (int64_t k = 0; k < u.kc; ++k) {
      const __m512 bk = _mm512_loadu_ps(b);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), bk, c[i]);
      a += u.cas;
      b += u.bs;
    }
  } else {
    const float* ar[kMr];
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) ar[i] = u.a + i * u.ras;
    for (int64_t k = 0; k < u.kc; ++k) {
      const __m512 bk = _mm512_loadu_ps(b);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) c[i] = _mm512_fmadd_ps(_mm512_set1_ps(ar[i][k]), bk, c[i]);
      b += u.bs;
    }
  }
  store_c<M>(u, c);
}

// Two adjacent packed panels (32 columns; the second at b + 16 * kc floats) from a packed strip: twelve
// FMA chains in flight (a CPU with two 512-bit FMA pipes needs more than six), each output's chain as in
// micro_avx512.
template <int M, int MR = kMr>
__attribute__((target("avx512f"))) void micro_avx512_wide(const Micro& u) {
  prefetch_c<M>(u, 2);
  __m512 c0[M], c1[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  const float* a = u.a;
  const float* b = u.b;
  const int64_t second = kNr * u.kc;
#pragma GCC unroll 2
  for (int64_t k = 0; k < u.kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + second);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i]);
      c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
    }
    a += MR;
    b += kNr;
  }
  store_c_wide<M>(u, c0, c1);
}

// Rows of C (+)= the accumulators of three 16-wide vectors a row (u.n in 33..48).
template <int M>
__attribute__((target("avx512f"), always_inline)) inline void store_c_wide3(const Micro& u, __m512* c0, __m512* c1,
                                                                          __m512* c2) {
  const __mmask16 m2 = static_cast<__mmask16>((1u << (u.n - 2 * kNr)) - 1u);
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    float* ci = u.c + i * u.ldc;
    if (u.acc) {
      c0[i] = _mm512_add_ps(_mm512_loadu_ps(ci), c0[i]);
      c1[i] = _mm512_add_ps(_mm512_loadu_ps(ci + kNr), c1[i]);
      c2[i] = _mm512_add_ps(_mm512_maskz_loadu_ps(m2, ci + 2 * kNr), c2[i]);
    }
    _mm512_storeu_ps(ci, c0[i]);
    _mm512_storeu_ps(ci + kNr, c1[i]);
    _mm512_mask_storeu_ps(ci + 2 * kNr, m2, c2[i]);
  }
}

// Three adjacent packed panels (48 columns; the k-th at b + 16 * kc * k floats): eighteen FMA chains, three
// B loads and six broadcasts a k step (the two-panel kernel issues eight loads per twelve FMAs), each
// output's chain as in micro_avx512. ROWS: A's rows read where they are (a stored (M, K), row i at
// a + i * ras) instead of a packed strip, up to kMrRows (8) of them as sequential streams: the blocked nest's
// products of an f32 A that is not transposed. Eight rows make twenty-four chains, three B loads and eight
// broadcasts a k step, and a quarter fewer passes of the unit's rows over the three panels (which, at 48 x kc
// floats, come from L2): measured faster than six at most model shapes (docs/BENCHMARKS.md). The same
// chains, so the same bits. MR: the rows of a packed strip (kMr or kMrRows). BROWS: B's rows read where they are,
// b(k, j) = b[k * bs + j], the k-th panel b2 floats after the first (the skinny nest's f32 B stored (K, N)).
template <int M, bool ROWS, int MR = kMr, bool BROWS = false>
__attribute__((target("avx512f"))) void micro_avx512_wide3(const Micro& u) {
  prefetch_c<M>(u, 3);
  __m512 c0[M], c1[M], c2[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) c0[i] = c1[i] = c2[i] = _mm512_setzero_ps();
  const float* a = u.a;
  const float* ar[kMrRows];
  if constexpr (ROWS) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) ar[i] = u.a + i * u.ras;
  }
  const float* b = u.b;
  const int64_t second = BROWS ? u.b2 : kNr * u.kc;
#pragma GCC unroll 2
  for (int64_t k = 0; k < u.kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + second), b2 = _mm512_loadu_ps(b + 2 * second);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(ROWS ? ar[i][k] : a[i]);
      c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
      c2[i] = _mm512_fmadd_ps(ai, b2, c2[i]);
    }
    if constexpr (!ROWS) a += MR;
    b += BROWS ? u.bs : kNr;
  }
  store_c_wide3<M>(u, c0, c1, c2);
}

// The skinny nest's product with B stored (N, K) (x W^T) with the operands' roles swapped: C^T = B A^T, B's
// rows read where they are (row i at a + i * ras, up to kMrRows of them) and A^T packed in P panels of 16 (the k-th
// at b + 16 * kc * k floats), so that B is not transposed into panels by each thread. Output (i, j) is
// C(m = j, n = i), stored at c[j * ldc + i] for j < u.n: each is the chain of fused multiply-adds of
// A(m, k) B(n, k) over k ascending, as in micro_avx512 (a product does not depend on its factors' order), then
// added to C as there, so the bits are the same.
// (GCC 12's AVX-512 headers pass an undefined vector to the extract builtin, which -Wmaybe-uninitialized
// reports once the kernel is inlined: not this code's values.)
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
template <int M, int P>
__attribute__((target("avx512f,avx2,fma"))) void micro_avx512_rows_t(const Micro& u) {
  __m512 acc[P][M] = {};  // zeros
  const float* ar[kMrRows];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) ar[i] = u.a + i * u.ras;
  const float* b = u.b;
  const int64_t second = kNr * u.kc;
#pragma GCC unroll 2
  for (int64_t k = 0; k < u.kc; ++k) {
    __m512 bq[P];
#pragma GCC unroll 3
    for (int q = 0; q < P; ++q) bq[q] = _mm512_loadu_ps(b + q * second);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(ar[i][k]);
#pragma GCC unroll 3
      for (int q = 0; q < P; ++q) acc[q][i] = _mm512_fmadd_ps(ai, bq[q], acc[q][i]);
    }
    b += kNr;
  }
  if constexpr (M == kMrRows) {  // eight rows: each 8 x 16 block stored as two transposed 8 x 8 halves
#pragma GCC unroll 3
    for (int q = 0; q < P; ++q) {
      const int nj = std::min(kNr, u.n - q * kNr);
      for (int h = 0; h < 2 && 8 * h < nj; ++h) {
        __m256 r[8], t8[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i)
          r[i] = h ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[q][i]), 1))
                   : _mm512_castps512_ps256(acc[q][i]);
        transpose8(r, t8);
        const int n8 = std::min(8, nj - 8 * h);
        for (int j = 0; j < n8; ++j) {
          float* cj = u.c + (q * kNr + 8 * h + j) * u.ldc;
          _mm256_storeu_ps(cj, u.acc ? _mm256_add_ps(_mm256_loadu_ps(cj), t8[j]) : t8[j]);
        }
      }
    }
    return;
  }
  alignas(64) float t[kMrRows][kNr];
  for (int q = 0; q < P; ++q) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) _mm512_store_ps(t[i], acc[q][i]);
    const int nj = std::min(kNr, u.n - q * kNr);
    for (int j = 0; j < nj; ++j) {
      float* cj = u.c + (q * kNr + j) * u.ldc;
      if (u.acc) {
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) cj[i] = cj[i] + t[i][j];
      } else {
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) cj[i] = t[i][j];
      }
    }
  }
}
#pragma GCC diagnostic pop

// Unpacked A (Gemm::tile) over two adjacent panels, the second u.b2 floats after the first: twelve FMA chains
// in flight where micro_avx512's six leave one of two 512-bit FMA pipes idle, each output's chain as there.
template <int M, bool TA>
__attribute__((target("avx512f"))) void micro_avx512_tile_wide(const Micro& u) {
  __m512 c0[M], c1[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  // a(i, k) at ar[i][k * ks]: row i of a stored (M, K), or column i of a stored (K, M).
  const float* ar[kMr];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) ar[i] = u.a + i * (TA ? 1 : u.ras);
  const int64_t ks = TA ? u.cas : 1;
  const float* b = u.b;
  for (int64_t k = 0; k < u.kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + u.b2);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      const __m512 ai = _mm512_set1_ps(ar[i][k * ks]);
      c0[i] = _mm512_fmadd_ps(ai, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(ai, b1, c1[i]);
    }
    b += u.bs;
  }
  store_c_wide<M>(u, c0, c1);
}

// ---- bf16 pairs -------------------------------------------------------------------------------------

// A packed pair strip: word (k pair p, row i) at a[p * 6 + i]; a panel: word (p, column j) at b[p * 16 + j].
template <int M>
__attribute__((target("avx512f,avx512bf16"))) void micro_bf16(const Micro& u) {
  prefetch_c<M>(u, 1);
  __m512 c[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) c[i] = _mm512_setzero_ps();
  const int32_t* a = reinterpret_cast<const int32_t*>(u.a);
  const int32_t* b = reinterpret_cast<const int32_t*>(u.b);
#pragma GCC unroll 4
  for (int64_t p = 0; p < u.kc; ++p) {
    const __m512bh bp = (__m512bh)_mm512_loadu_si512(b);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32(a[i]), bp);
    a += kMr;
    b += kNr;
  }
  store_c<M>(u, c);
}

// Two adjacent pair panels (32 columns; the second at b + 16 * kc words): twelve independent sums in
// flight, which the instruction's latency needs (six are not enough to keep it busy).
template <int M>
__attribute__((target("avx512f,avx512bf16"))) void micro_bf16_wide(const Micro& u) {
  prefetch_c<M>(u, 2);
  __m512 c0[M], c1[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  const int32_t* a = reinterpret_cast<const int32_t*>(u.a);
  const int32_t* b = reinterpret_cast<const int32_t*>(u.b);
  const int64_t second = kNr * u.kc;
#pragma GCC unroll 2
  for (int64_t p = 0; p < u.kc; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + second);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(a[i]);
      c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);
    }
    a += kMr;
    b += kNr;
  }
  store_c_wide<M>(u, c0, c1);
}

template <bool TA, bool PACKED, int... M>
void fill_avx512(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_avx512<M + 1, TA, PACKED>), ...);
}
template <int... M>
void fill_avx512_wide(MicroFn* f, MicroFn* f3, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_avx512_wide<M + 1>), ...);
  ((f3[M + 1] = &micro_avx512_wide3<M + 1, false>), ...);
}
template <int... M>
void fill_avx512_rows_t(MicroFn (*f)[kMrRows + 1], std::integer_sequence<int, M...>) {
  ((f[0][M + 1] = &micro_avx512_rows_t<M + 1, 1>), ...);
  ((f[1][M + 1] = &micro_avx512_rows_t<M + 1, 2>), ...);
  ((f[2][M + 1] = &micro_avx512_rows_t<M + 1, 3>), ...);
}
template <int... M>
void fill_avx512_rows(MicroFn* r3, MicroFn* p1, MicroFn* p2, MicroFn* p3, MicroFn* b3,
                      std::integer_sequence<int, M...>) {
  ((r3[M + 1] = &micro_avx512_wide3<M + 1, true>), ...);
  ((p1[M + 1] = &micro_avx512<M + 1, true, true, kMrRows>), ...);
  ((p2[M + 1] = &micro_avx512_wide<M + 1, kMrRows>), ...);
  ((p3[M + 1] = &micro_avx512_wide3<M + 1, false, kMrRows>), ...);
  ((b3[M + 1] = &micro_avx512_wide3<M + 1, false, kMrRows, true>), ...);
}
template <bool TA, int... M>
void fill_avx512_tile_wide(MicroFn* f, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_avx512_tile_wide<M + 1, TA>), ...);
}
template <int... M>
void fill_bf16(MicroFn* f, MicroFn* wide, std::integer_sequence<int, M...>) {
  ((f[M + 1] = &micro_bf16<M + 1>), ...);
  ((wide[M + 1] = &micro_bf16_wide<M + 1>), ...);
}

}  // namespace

namespace {

// n rounds of twelve independent chains of vdpbf16ps (PAIRS) or vfmadd231ps on registers (no memory
// traffic): the seconds.
template <bool PAIRS>
__attribute__((target("avx512f,avx512bf16"))) double time_chains(int64_t n) {
  __m512 c[12];
  for (int i = 0; i < 12; ++i) c[i] = _mm512_set1_ps(static_cast<float>(i));
  __m512 a = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f803f80));  // bf16 pairs of 1.0; as f32 about 1.004
  const __m512 b = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < n; ++r) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) {
      if constexpr (PAIRS) c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)a, (__m512bh)b);
      else c[i] = _mm512_fmadd_ps(a, b, c[i]);
    }
    __asm__ volatile("" : "+v"(a));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int i = 1; i < 12; ++i) c[0] = _mm512_add_ps(c[0], c[i]);
  float out[16];
  _mm512_storeu_ps(out, c[0]);
  volatile float sink = out[0];  // the chains are used
  (void)sink;
  return s;
}

// One row times a B stored (K, N) (row_axpy of gemm_kernel.h): c[j] (+)= the chain fma(x_k, b(k, j), .) from 0
// over k ascending, the chain axpy_rows of gemm_blocked.cpp builds in memory, kept in registers instead: eight
// vectors (128 columns) a block, B's rows read 512 bytes at a time, then the last columns one block of up to eight
// vectors, its last masked. (Fetching the rows eight ahead by hand measured the same: the hardware follows them.)
template <int V>
__attribute__((target("avx512f"), always_inline)) inline void row_block(float* c, const float* x, const float* b,
                                                                       int64_t ldb, int64_t K, __mmask16 last,
                                                                       bool accumulate) {
  __m512 acc[V];
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* r = b + k * ldb;
    const __m512 xv = _mm512_set1_ps(x[k]);
#pragma GCC unroll 8
    for (int v = 0; v < V - 1; ++v) acc[v] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(r + 16 * v), acc[v]);
    acc[V - 1] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(last, r + 16 * (V - 1)), acc[V - 1]);
  }
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v) {
    const __mmask16 m = v == V - 1 ? last : static_cast<__mmask16>(0xffff);
    __m512 o = acc[v];
    if (accumulate) o = _mm512_add_ps(_mm512_maskz_loadu_ps(m, c + 16 * v), o);
    _mm512_mask_storeu_ps(c + 16 * v, m, o);
  }
}

__attribute__((target("avx512f"))) void row_axpy_avx512(float* c, const float* x, const float* b, int64_t ldb,
                                                         int64_t K, int64_t n, bool accumulate) {
  int64_t j = 0;
  for (; j + 128 <= n; j += 128) row_block<8>(c + j, x, b + j, ldb, K, 0xffff, accumulate);
  if (j == n) return;
  const int64_t v = (n - j + 15) / 16, w = n - j - 16 * (v - 1);
  const __mmask16 last = static_cast<__mmask16>((1u << w) - 1u);
  c += j, b += j;
  switch (v) {
    case 1: return row_block<1>(c, x, b, ldb, K, last, accumulate);
    case 2: return row_block<2>(c, x, b, ldb, K, last, accumulate);
    case 3: return row_block<3>(c, x, b, ldb, K, last, accumulate);
    case 4: return row_block<4>(c, x, b, ldb, K, last, accumulate);
    case 5: return row_block<5>(c, x, b, ldb, K, last, accumulate);
    case 6: return row_block<6>(c, x, b, ldb, K, last, accumulate);
    case 7: return row_block<7>(c, x, b, ldb, K, last, accumulate);
    default: return row_block<8>(c, x, b, ldb, K, last, accumulate);
  }
}

}  // namespace

double measure_bf16_pair_speed() {
  // A vdpbf16ps does 64 FLOPs, an FMA 32. Best of five alternating rounds (~0.1 ms each), so a preemption
  // in one round does not decide.
  const int64_t n = 4096;
  double pairs = 1e30, fmas = 1e30;
  for (int r = 0; r < 5; ++r) {
    pairs = std::min(pairs, time_chains<true>(n));
    fmas = std::min(fmas, time_chains<false>(n));
  }
  return (64.0 / std::max(pairs, 1e-12)) / (32.0 / std::max(fmas, 1e-12));
}

void fill_avx512_kernels(Kernels& k, bool bf16) {
  fill_avx512<false, false>(k.micro[0], std::make_integer_sequence<int, kMr>{});
  fill_avx512<true, false>(k.micro[1], std::make_integer_sequence<int, kMr>{});
  fill_avx512<true, true>(k.packed, std::make_integer_sequence<int, kMr>{});
  fill_avx512_wide(k.packed_wide, k.packed_wide3, std::make_integer_sequence<int, kMr>{});
  fill_avx512_rows(k.rows_wide3, k.packed8, k.packed8_wide, k.packed8_wide3, k.packed8_brows3,
                   std::make_integer_sequence<int, kMrRows>{});
  fill_avx512_rows_t(k.rows_t, std::make_integer_sequence<int, kMrRows>{});
  fill_avx512_tile_wide<false>(k.tile_wide[0], std::make_integer_sequence<int, kMr>{});
  fill_avx512_tile_wide<true>(k.tile_wide[1], std::make_integer_sequence<int, kMr>{});
  k.row_axpy = &row_axpy_avx512;
  if (bf16) fill_bf16(k.packed_pairs, k.packed_pairs_wide, std::make_integer_sequence<int, kMr>{});
}

}  // namespace oomless::gemm_detail
