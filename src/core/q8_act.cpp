// Activation rows quantised to 8 bits (q8_act.h). The vector form computes each block with the operations
// of the plain one in the same order: the largest |x| (exact in any order), 127 / amax and amax / 127
// rounded once each, x * (127 / amax) rounded once and converted to the nearest integer with ties to even
// (the default MXCSR mode, as std::nearbyint in the default rounding mode), the sum of the codes exact.
#include "core/q8_act.h"

#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/cpu_info.h"

namespace oomless {

namespace {
// 127 / amax, or 0 for a block of zeros or one so small that the quotient overflows (its codes are 0).
inline float inverse_step(float amax) {
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  return std::isfinite(id) ? id : 0.0f;
}
}  // namespace

size_t q8_act_bytes(int64_t n) {
  const int64_t blocks = n / kQ8Block;
  return static_cast<size_t>(n + 8 * blocks + 3) / 4 * 4;
}

Q8Act q8_act_at(void* mem, int64_t n) {
  Q8Act a;
  a.blocks = n / kQ8Block;
  // the scales first (4-byte aligned), then the codes
  a.d = static_cast<float*>(mem);
  a.s = a.d + a.blocks;
  a.q = reinterpret_cast<int8_t*>(a.s + a.blocks);
  return a;
}

void quantise_q8_act_scalar(const float* x, Q8Act a) {
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* xb = x + b * kQ8Block;
    int8_t* q = a.q + b * kQ8Block;
    float amax = 0.0f;
    bool finite = true;
    for (int k = 0; k < kQ8Block; ++k) {
      finite = finite && std::isfinite(xb[k]);
      amax = std::max(amax, std::fabs(xb[k]));
    }
    if (!finite) {
      std::memset(q, 0, kQ8Block);
      a.d[b] = a.s[b] = NAN;
      continue;
    }
    const float d = amax / 127.0f, id = inverse_step(amax);
    int sum = 0;
    for (int k = 0; k < kQ8Block; ++k) {
      const float v = xb[k] * id;
      const int c = static_cast<int>(std::nearbyint(v));
      q[k] = static_cast<int8_t>(c);
      sum += c;
    }
    a.d[b] = d;
    a.s[b] = d * static_cast<float>(sum);
  }
}

namespace {

__attribute__((target("avx2"))) void quantise_avx2(const float* x, Q8Act a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 inf = _mm256_set1_ps(INFINITY);
  for (int64_t b = 0; b < a.blocks; ++b) {
    const float* xb = x + b * kQ8Block;
    __m256 v[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 ab = _mm256_andnot_ps(sign, v[i]);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(ab, inf, _CMP_NLT_UQ));  // |x| >= inf, or NaN
      m = _mm256_max_ps(m, ab);
    }
    int8_t* q = a.q + b * kQ8Block;
    if (_mm256_movemask_ps(bad)) {
      std::memset(q, 0, kQ8Block);
      a.d[b] = a.s[b] = NAN;
      continue;
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h);
    const float d = amax / 127.0f, id = inverse_step(amax);
    const __m256 vid = _mm256_set1_ps(id);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
    // 32-bit codes to bytes in element order: packs interleave the 128-bit lanes, the permute restores them.
    const __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
    const __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    a.d[b] = d;
    a.s[b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

bool use_avx2() {
  static const bool yes = [] {
    const char* env = std::getenv("OOMLESS_ISA");
    if (env && std::strcmp(env, "generic") == 0) return false;
    return detect_cpu().avx2;
  }();
  return yes;
}

}  // namespace

void quantise_q8_act(const float* x, Q8Act a) {
  if (use_avx2()) quantise_avx2(x, a);
  else quantise_q8_act_scalar(x, a);
}

}  // namespace oomless
