// The attention tiles of bf16 products on AMX: see attention_amx.h. Every function here is compiled for
// AMX-BF16 / AVX512-BF16 by attribute and runs only where gemm_isa() is amx (a CPU with both).
#include "backend/cpu/attention_amx.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "backend/cpu/gemm_kernel.h"
#include "core/dtype.h"

// GCC 12's AVX-512 intrinsics start some results from an undefined vector, which it then reports as maybe
// uninitialized once inlined here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace oomless::attn_amx {

namespace {

#define OOMLESS_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define OOMLESS_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define OOMLESS_BF16_INLINE __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma"), always_inline)) inline

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// A row keeps its running max over a key tile unless one of the sixteen lanes of its sum there (at most
// eight terms) passes 2^12, and is then taken again with the tile's max: its terms stay below 2^12 and are
// summed against the max it holds (as exactly: l and O are kept relative to whatever max the row holds),
// and no separate pass finds each tile's max.
constexpr float kLaneCap = 4096.0f;

// Two rows' sixteen floats as sixteen pair words (a's in the low halves), rounded to nearest even by the
// hardware (denormals to zero, as the tile products read them anyway).
OOMLESS_BF16_INLINE __m512i pairs16(__m512 a, __m512 b) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                       21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Sixteen floats to bf16, stored.
OOMLESS_BF16_INLINE void store_bf16(uint16_t* d, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), (__m256i)_mm512_cvtneps_pbh(v));
}

// 2^x, relative error under 3e-6 (the products read it in bf16, whose rounding is 4e-3): x = n + f with
// n = round(x), 2^f by its degree-4 minimax polynomial on [-1/2, 1/2], 2^n applied by vscalefps (0 far
// below, NaN kept).
OOMLESS_BF16_INLINE __m512 exp2_512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.57008637e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.59178218e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93121791e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999285e-1f));
  return _mm512_scalef_ps(p, n);
}

OOMLESS_BF16_INLINE float exp2_1(float x) { return _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(x))); }

OOMLESS_BF16_INLINE __mmask16 first(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1u);
}

// One row's y = 2^(c s - shift) for j < n, 0 to npad (a multiple of 16), in bf16 to h; returns their sum
// over sixteen lanes.
OOMLESS_BF16_INLINE __m512 exp_row(const float* s, int64_t n, int64_t npad, float c, float shift, uint16_t* h) {
  const __m512 vc = _mm512_set1_ps(c), vs = _mm512_set1_ps(-shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(s + j);
    const __m512 y = exp2_512(_mm512_fmadd_ps(v, vc, vs));
    sum = _mm512_add_ps(sum, y);
    store_bf16(h + j, y);
  }
  if (j < n) {
    const __mmask16 k = first(n - j);
    const __m512 v = _mm512_maskz_loadu_ps(k, s + j);
    const __m512 y = _mm512_maskz_mov_ps(k, exp2_512(_mm512_fmadd_ps(v, vc, vs)));
    sum = _mm512_add_ps(sum, y);
    store_bf16(h + j, y);
    j += 16;
  }
  for (; j < npad; j += 16) store_bf16(h + j, _mm512_setzero_ps());
  return sum;
}

// C tiles: MT 16-row tiles (1 or 2) by two 16-column ones.
template <int MT>
OOMLESS_AMX void micro(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                       int64_t K, bool acc) {
  const int64_t cs = ldc * 4, as = lda * 2, bs = ldb * 4;
  gemm_detail::tile_barrier();
  if (acc) {
    _tile_loadd(0, c, cs);
    _tile_loadd(1, c + 16, cs);
    if constexpr (MT == 2) {
      _tile_loadd(2, c + 16 * ldc, cs);
      _tile_loadd(3, c + 16 * ldc + 16, cs);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (MT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t k = 0; k < K; k += 32) {
    const uint32_t* bk = b + (k / 2) * ldb;
    _tile_loadd(4, a + k, as);
    _tile_loadd(6, bk, bs);
    _tile_loadd(7, bk + 16, bs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, a + 16 * lda + k, as);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, cs);
  _tile_stored(1, c + 16, cs);
  if constexpr (MT == 2) {
    _tile_stored(2, c + 16 * ldc, cs);
    _tile_stored(3, c + 16 * ldc + 16, cs);
  }
  gemm_detail::tile_barrier();
}

// C = A B over K = 64 (two k steps), MT 16-row tiles (1 or 2) by N columns (a multiple of 16), not
// accumulated: the strip's A tiles stay loaded (tmm4..7) while it walks the columns sixteen at a time, so four
// tile products take two B tile loads (micro: two A and two B) and two stores of C. Each output is
// the same two tile products in the same order as micro's.
template <int MT>
OOMLESS_AMX void strip64(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                         int64_t N) {
  const int64_t cs = ldc * 4, as = lda * 2, bs = ldb * 4;
  gemm_detail::tile_barrier();
  _tile_loadd(4, a, as);
  _tile_loadd(5, a + 32, as);
  if constexpr (MT == 2) {
    _tile_loadd(6, a + 16 * lda, as);
    _tile_loadd(7, a + 16 * lda + 32, as);
  }
  for (int64_t j = 0; j < N; j += 16) {
    _tile_zero(0);
    _tile_loadd(2, b + j, bs);
    _tile_loadd(3, b + 16 * ldb + j, bs);
    _tile_dpbf16ps(0, 4, 2);
    if constexpr (MT == 2) {
      _tile_zero(1);
      _tile_dpbf16ps(1, 6, 2);
    }
    _tile_dpbf16ps(0, 5, 3);
    if constexpr (MT == 2) _tile_dpbf16ps(1, 7, 3);
    _tile_stored(0, c + j, cs);
    if constexpr (MT == 2) _tile_stored(1, c + 16 * ldc + j, cs);
  }
  gemm_detail::tile_barrier();
}

}  // namespace

// Row x's D values as D / 2 pair words in w (bf16 as they are, f32 rounded).
OOMLESS_BF16_INLINE const uint32_t* row_words(const uint16_t* x, int64_t, uint16_t*) {
  return reinterpret_cast<const uint32_t*>(x);
}
OOMLESS_BF16_INLINE const uint32_t* row_words(const float* x, int64_t D, uint16_t* w) {
  for (int64_t d = 0; d < D; d += 16) store_bf16(w + d, _mm512_loadu_ps(x + d));
  return reinterpret_cast<const uint32_t*>(w);
}

template <class T>
OOMLESS_BF16_INLINE void pack_t_of(const T* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out,
                                   int64_t ldo) {
  const int64_t W = D / 2;
  for (int64_t p = 0; p < W; ++p) std::memset(out + p * ldo + n, 0, sizeof(uint32_t) * (npad - n));
  alignas(64) uint16_t buf[512];
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* w = row_words(x + j * ld, D, buf);
    for (int64_t p = 0; p < W; ++p) out[p * ldo + j] = w[p];
  }
}

OOMLESS_BF16 void pack_t(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out, int64_t ldo) {
  pack_t_of(x, ld, n, D, npad, out, ldo);
}
OOMLESS_BF16 void pack_t(const float* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out, int64_t ldo) {
  pack_t_of(x, ld, n, D, npad, out, ldo);
}

// The pair words of 32 columns of two rows a and b (null: a row of zeros), into o[0, 32).
OOMLESS_BF16_INLINE void pair32(uint32_t* o, const uint16_t* a, const uint16_t* b) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i x = a ? _mm512_loadu_si512(a) : _mm512_setzero_si512(), y = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
  _mm512_storeu_si512(o, _mm512_permutex2var_epi16(x, lo, y));
  _mm512_storeu_si512(o + 16, _mm512_permutex2var_epi16(x, hi, y));
}
OOMLESS_BF16_INLINE void pair32(uint32_t* o, const float* a, const float* b) {
  for (int h = 0; h < 32; h += 16)
    _mm512_storeu_si512(o + h, pairs16(a ? _mm512_loadu_ps(a + h) : _mm512_setzero_ps(),
                                       b ? _mm512_loadu_ps(b + h) : _mm512_setzero_ps()));
}

template <class T>
OOMLESS_BF16_INLINE void pack_rows_of(const T* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out) {
  for (int64_t p = 0; p < npad / 2; ++p) {
    const T* a = 2 * p < n ? x + 2 * p * ld : nullptr;
    const T* b = 2 * p + 1 < n ? x + (2 * p + 1) * ld : nullptr;
    for (int64_t d = 0; d < D; d += 32) pair32(out + p * D + d, a ? a + d : nullptr, b ? b + d : nullptr);
  }
}

OOMLESS_BF16 void pack_rows(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out) {
  pack_rows_of(x, ld, n, D, npad, out);
}
OOMLESS_BF16 void pack_rows(const float* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint32_t* out) {
  pack_rows_of(x, ld, n, D, npad, out);
}

// Sixteen rows at a time: one gather takes columns d and d + 1 of each (a pair word a row), one permute
// parts them into the two output rows.
OOMLESS_BF16 void transpose(const uint16_t* x, int64_t ld, int64_t n, int64_t D, int64_t npad, uint16_t* out,
                            int64_t ldo) {
  const __m512i parts = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24, 22,
                                         20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int>(ld / 2)));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const uint32_t* base = reinterpret_cast<const uint32_t*>(x + i * ld);
    for (int64_t d = 0; d < D; d += 2) {
      const __m512i w = _mm512_permutexvar_epi16(parts, _mm512_i32gather_epi32(rows, base + d / 2, 4));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d * ldo + i), _mm512_castsi512_si256(w));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (d + 1) * ldo + i), _mm512_extracti64x4_epi64(w, 1));
    }
  }
  for (; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) out[d * ldo + i] = x[i * ld + d];
  for (int64_t d = 0; d < D; ++d) std::memset(out + d * ldo + n, 0, sizeof(uint16_t) * (npad - n));
}

void begin() { gemm_detail::amx_begin(); }
void end() { gemm_detail::amx_end(); }

OOMLESS_AMX void product(const uint16_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c, int64_t ldc,
                         int64_t M, int64_t N, int64_t K, bool acc) {
  if (K == 64 && !acc) {  // S = Q K^T and dP = dO V^T at D = 64
    int64_t i = 0;
    for (; i + 32 <= M; i += 32) strip64<2>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, N);
    if (i < M) strip64<1>(a + i * lda, lda, b, ldb, c + i * ldc, ldc, N);
    return;
  }
  for (int64_t j = 0; j < N; j += 32) {
    int64_t i = 0;
    for (; i + 32 <= M; i += 32) micro<2>(a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, K, acc);
    if (i < M) micro<1>(a + i * lda, lda, b + j, ldb, c + i * ldc + j, ldc, K, acc);
  }
}

// The largest of s[0, n), n > 0.
OOMLESS_BF16_INLINE float row_max(const float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t j = 0; j < n; j += 16) mx = _mm512_mask_max_ps(mx, first(n - j), mx, _mm512_loadu_ps(s + j));
  return _mm512_reduce_max_ps(mx);
}

OOMLESS_BF16 void softmax_rows(const float* S, uint16_t* P, int64_t nq, int64_t rows, int64_t npad, int64_t nk,
                               float c, const int32_t* qpos, int64_t klo, float* m, float* l16, float* O, int64_t ldo,
                               int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = S + r * npad;
    uint16_t* p = P + r * npad;
    float* l = l16 + 16 * r;
    const int64_t n = r < nq ? std::clamp<int64_t>(qpos[r] - klo + 1, 0, nk) : 0;
    if (n == 0) {  // nothing new: P's row 0, the sums as they are
      std::memset(p, 0, sizeof(uint16_t) * npad);
      continue;
    }
    float mn = m[r];
    __m512 sum;
    if (mn != kNegInf) {  // with the running max as it is, unless a lane of the sum passes kLaneCap
      sum = exp_row(s, n, npad, c, mn, p);
      if (!_mm512_cmp_ps_mask(sum, _mm512_set1_ps(kLaneCap), _CMP_GT_OQ)) {
        _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), sum));
        continue;
      }
      mn = std::max(mn, row_max(s, n) * c);
    } else {
      mn = row_max(s, n) * c;
    }
    const bool had = m[r] != kNegInf;
    const __m512 alpha = _mm512_set1_ps(had ? exp2_1(m[r] - mn) : 0.0f);
    sum = exp_row(s, n, npad, c, mn, p);
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, sum));
    m[r] = mn;
    if (had) {
      float* o = O + r * ldo;
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), alpha));
    }
  }
}

OOMLESS_BF16 void fold_sums(const float* l16, int64_t rows, float* l) {
  for (int64_t r = 0; r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(l16 + 16 * r));
}

OOMLESS_BF16 void grad_rows(const float* S, const float* dP, uint32_t* Ppairs, uint16_t* dS, uint32_t* dSpairs,
                            int64_t nq, int64_t rows, int64_t npad, int64_t nk, float c, const int32_t* qpos,
                            int64_t klo, const float* lse2, const float* dsum, float scale) {
  const __m512 vs = _mm512_set1_ps(scale), vc = _mm512_set1_ps(c);
  for (int64_t r = 0; r < rows; r += 2) {  // two rows at a time, P and dS in registers
    int64_t n[2];
    __m512 shift[2], d[2];
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t q = r + i;
      const bool seen = q < nq && lse2[q] != kNegInf;
      n[i] = seen ? std::clamp<int64_t>(qpos[q] - klo + 1, 0, nk) : 0;
      shift[i] = _mm512_set1_ps(seen ? -lse2[q] : 0.0f);
      d[i] = _mm512_set1_ps(q < nq ? dsum[q] : 0.0f);
    }
    const float* s0 = S + r * npad;
    const float* g0 = dP + r * npad;
    uint32_t* pp = Ppairs + (r / 2) * npad;
    uint32_t* sp = dSpairs + (r / 2) * npad;
    for (int64_t j = 0; j < npad; j += 16) {  // P (and so dS) 0 past each row's seen keys and on rows past nq
      const __mmask16 k0 = first(n[0] - j), k1 = first(n[1] - j);
      const __m512 a = _mm512_maskz_mov_ps(k0, exp2_512(_mm512_fmadd_ps(_mm512_loadu_ps(s0 + j), vc, shift[0])));
      const __m512 b = _mm512_maskz_mov_ps(k1, exp2_512(_mm512_fmadd_ps(_mm512_loadu_ps(s0 + npad + j), vc, shift[1])));
      const __m512 ga = _mm512_mul_ps(_mm512_mul_ps(vs, a), _mm512_sub_ps(_mm512_loadu_ps(g0 + j), d[0]));
      const __m512 gb = _mm512_mul_ps(_mm512_mul_ps(vs, b), _mm512_sub_ps(_mm512_loadu_ps(g0 + npad + j), d[1]));
      _mm512_storeu_si512(pp + j, pairs16(a, b));
      store_bf16(dS + r * npad + j, ga);
      store_bf16(dS + (r + 1) * npad + j, gb);
      _mm512_storeu_si512(sp + j, pairs16(ga, gb));
    }
  }
}

OOMLESS_BF16 void to_bf16(uint16_t* d, const float* s, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(d + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + i + 16), _mm512_loadu_ps(s + i)));
  for (; i < n; i += 16) {
    const __mmask16 k = first(n - i);
    _mm256_mask_storeu_epi16(d + i, k, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, s + i)));
  }
}

OOMLESS_BF16 float dot(const float* a, const float* b, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

}  // namespace oomless::attn_amx
