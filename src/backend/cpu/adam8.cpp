// AdamW8bit's block kernel (adam8.h), portable and AVX2 + FMA. Both do the same float32 operations in the
// same order (every product and sum rounded on its own; the grid index's fused multiply-add in both), so
// they give the same bits; this file is built with -ffp-contract=off so the compiler adds no fusion.
#include "backend/cpu/adam8.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "backend/cpu/gemm.h"
#include "backend/ops.h"
#include "core/cpu_info.h"
#include "core/dynamic8.h"

namespace oomless::cpu {

void adam8_block_generic(const Adam8Scalars& s, float* p, const float* g, uint8_t* mc, float* ma, uint8_t* vc,
                         float* va, int64_t len) {
  const dyn8::Map& sm = dyn8::signed_map();
  const dyn8::Map& um = dyn8::unsigned_map();
  float m[kAdam8Block], v[kAdam8Block];
  const float am = *ma, av = *va;
  for (int64_t k = 0; k < len; ++k) {
    const float gi = g[k];
    if (!std::isfinite(gi)) {
      m[k] = v[k] = 0.0f;
      continue;
    }
    const float mo = sm.values()[mc[k]] * am, vo = um.values()[vc[k]] * av;
    const float mb = mo * s.b1, mg = s.omb1 * gi, vb = vo * s.b2, vg = s.omb2 * gi;
    const float vgg = vg * gi;
    m[k] = mb + mg;
    v[k] = vb + vgg;
    const float denom = std::sqrt(v[k]) / s.c2 + s.eps;
    const float upd = (s.step_size * m[k]) / denom;
    float pi = p[k] + upd;
    if (s.decay) pi = pi * s.keep;
    p[k] = pi;
  }
  *ma = dyn8::encode_block(sm, m, len, mc);
  *va = dyn8::encode_block(um, v, len, vc);
}

namespace {

__attribute__((target("avx2,fma"))) inline float hmax(__m256 x) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

// dynamic8.h's encode of 256 finite values whose scale b (> 0) is known.
__attribute__((target("avx2,fma"))) void encode_avx2(const dyn8::Map& map, const float* x, float b, uint8_t* codes) {
  const float inv = 1.0f / b;
  const __m256 vinv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f), mone = _mm256_set1_ps(-1.0f);
  const __m256 half = _mm256_set1_ps(0.5f), k65535 = _mm256_set1_ps(65535.0f);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF), low8 = _mm256_set1_epi32(0xFF);
  const int* lut = reinterpret_cast<const int*>(map.lut());
  for (int k = 0; k < kAdam8Block; k += 8) {
    __m256 c = _mm256_mul_ps(_mm256_loadu_ps(x + k), vinv);
    c = _mm256_min_ps(_mm256_max_ps(c, mone), one);  // finite c: clamp1
    const __m256 h = _mm256_mul_ps(_mm256_add_ps(one, c), half);
    const __m256 t = _mm256_fmadd_ps(h, k65535, half);
    const __m256i j = _mm256_and_si256(_mm256_cvttps_epi32(t), low16);
    const __m256i code = _mm256_and_si256(_mm256_i32gather_epi32(lut, j, 1), low8);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + k), _mm_packus_epi16(w, w));
  }
}

}  // namespace

__attribute__((target("avx2,fma"))) void adam8_block_avx2(const Adam8Scalars& s, float* p, const float* g, uint8_t* mc,
                                                          float* ma, uint8_t* vc, float* va, int64_t len) {
  if (len != kAdam8Block) return adam8_block_generic(s, p, g, mc, ma, vc, va, len);
  const dyn8::Map& sm = dyn8::signed_map();
  const dyn8::Map& um = dyn8::unsigned_map();
  alignas(32) float m[kAdam8Block], v[kAdam8Block];
  const __m256 am = _mm256_set1_ps(*ma), av = _mm256_set1_ps(*va);
  const __m256 b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2), omb1 = _mm256_set1_ps(s.omb1),
               omb2 = _mm256_set1_ps(s.omb2), zero = _mm256_setzero_ps();
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), inf = _mm256_set1_ps(INFINITY);
  __m256 mmax = zero, vmax = zero, bad = zero;
  for (int k = 0; k < kAdam8Block; k += 8) {
    const __m256 gi = _mm256_loadu_ps(g + k);
    const __m256 finite = _mm256_cmp_ps(_mm256_sub_ps(gi, gi), zero, _CMP_EQ_OQ);
    const __m256i ci = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mc + k)));
    const __m256i cv = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vc + k)));
    const __m256 mo = _mm256_mul_ps(_mm256_i32gather_ps(sm.values(), ci, 4), am);
    const __m256 vo = _mm256_mul_ps(_mm256_i32gather_ps(um.values(), cv, 4), av);
    const __m256 mk = _mm256_and_ps(_mm256_add_ps(_mm256_mul_ps(mo, b1), _mm256_mul_ps(omb1, gi)), finite);
    const __m256 vk = _mm256_and_ps(_mm256_add_ps(_mm256_mul_ps(vo, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi)), finite);
    _mm256_store_ps(m + k, mk);
    _mm256_store_ps(v + k, vk);
    const __m256 amk = _mm256_and_ps(mk, absmask), avk = _mm256_and_ps(vk, absmask);
    // a moment that is not finite (overflow, an infinite scale) goes to the portable kernel's rules
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(amk, inf, _CMP_NLT_UQ));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(avk, inf, _CMP_NLT_UQ));
    mmax = _mm256_max_ps(mmax, amk);
    vmax = _mm256_max_ps(vmax, avk);
  }
  if (_mm256_movemask_ps(bad)) return adam8_block_generic(s, p, g, mc, ma, vc, va, len);
  const __m256 c2 = _mm256_set1_ps(s.c2), eps = _mm256_set1_ps(s.eps), step = _mm256_set1_ps(s.step_size),
               keep = _mm256_set1_ps(s.keep);
  for (int k = 0; k < kAdam8Block; k += 8) {
    const __m256 gi = _mm256_loadu_ps(g + k);
    const __m256 finite = _mm256_cmp_ps(_mm256_sub_ps(gi, gi), zero, _CMP_EQ_OQ);
    const __m256 mk = _mm256_load_ps(m + k), vk = _mm256_load_ps(v + k);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vk), c2), eps);
    const __m256 upd = _mm256_div_ps(_mm256_mul_ps(step, mk), denom);
    const __m256 p0 = _mm256_loadu_ps(p + k);
    __m256 pi = _mm256_add_ps(p0, upd);
    if (s.decay) pi = _mm256_mul_ps(pi, keep);
    _mm256_storeu_ps(p + k, _mm256_blendv_ps(p0, pi, finite));
  }
  const float bm = hmax(mmax), bv = hmax(vmax);
  *ma = bm;
  *va = bv;
  if (bm == 0.0f)
    std::memset(mc, 0, kAdam8Block);
  else
    encode_avx2(sm, m, bm, mc);
  if (bv == 0.0f)
    std::memset(vc, 0, kAdam8Block);
  else
    encode_avx2(um, v, bv, vc);
}

bool adam8_avx2_supported() {
  static const bool ok = [] {
    const CpuInfo c = detect_cpu();
    return c.avx2 && c.fma;
  }();
  return ok;
}

Adam8Block adam8_block() {
  return adam8_avx2_supported() && gemm_isa() != GemmIsa::generic ? adam8_block_avx2 : adam8_block_generic;
}

}  // namespace oomless::cpu
