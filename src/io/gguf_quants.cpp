// Dequantisation of ggml block formats to float32.
//
// Each format is a run of fixed-size blocks; the layouts below are ggml's (ggml-common.h). Every output
// element is produced by the same float operations in the same order as ggml's reference dequantisers
// and gguf-py's numpy versions (which agree), so results are bit-identical. Products are stored into a
// named float before an offset is added so that no compiler fuses them into an FMA, which would round
// once instead of twice and differ from the reference in the last bit.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/cpu_info.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/gguf.h"

namespace oomless {

namespace {

constexpr int QK = 32;    // elements per block of the 32-element formats
constexpr int QK_K = 256; // elements per super-block of the K formats

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// y = d*q - m with the product rounded on its own (see the file comment).
inline float mul_sub(float d, float q, float m) {
  const float p = d * q;
  return p - m;
}
inline float mul_add(float d, float q, float m) {
  const float p = d * q;
  return p + m;
}

// block_q4_0 {f16 d; u8 qs[16]}: x[j] = (lo nibble - 8)*d, x[j+16] = (hi nibble - 8)*d.
void deq_q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + QK / 2] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// block_q4_1 {f16 d; f16 m; u8 qs[16]}: x = q*d + m.
void deq_q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = mul_add(d, static_cast<float>(qs[j] & 0x0F), m);
    y[j + QK / 2] = mul_add(d, static_cast<float>(qs[j] >> 4), m);
  }
}

// 5-bit formats: the fifth bit of element j is bit j of the little-endian u32 qh.
uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

// block_q5_0 {f16 d; u8 qh[4]; u8 qs[16]}: x = (q5 - 16)*d.
void deq_q5_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint32_t qh = load_u32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < QK / 2; ++j) {
    const int x0 = static_cast<int>((qs[j] & 0x0F) | (((qh >> j) & 1u) << 4)) - 16;
    const int x1 = static_cast<int>((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
    y[j] = static_cast<float>(x0) * d;
    y[j + QK / 2] = static_cast<float>(x1) * d;
  }
}

// block_q5_1 {f16 d; f16 m; u8 qh[4]; u8 qs[16]}: x = q5*d + m.
void deq_q5_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint32_t qh = load_u32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < QK / 2; ++j) {
    const uint32_t x0 = (qs[j] & 0x0Fu) | (((qh >> j) & 1u) << 4);
    const uint32_t x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
    y[j] = mul_add(d, static_cast<float>(x0), m);
    y[j + QK / 2] = mul_add(d, static_cast<float>(x1), m);
  }
}

// block_q8_0 {f16 d; i8 qs[32]}: x = q*d.
void deq_q8_0(const uint8_t* b, float* y) {
  const float d = half(b);
  for (int j = 0; j < QK; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
}

// block_q2_K {u8 scales[16]; u8 qs[64]; f16 d; f16 dmin}: 16 groups of 16; group scale byte holds a
// 4-bit scale (low) and 4-bit min (high). Each 128-element half reads 32 qs bytes four times, two bits
// at a time.
void deq_q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int h = 0; h < 2; ++h) {
        const uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0xF);
        const float ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = mul_sub(dl, static_cast<float>((q[l + 16 * h] >> shift) & 3), ml);
      }
    }
    q += 32;
  }
}

// block_q3_K {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d}: 16 six-bit signed scales (stored +32):
// low 4 bits of scale s are nibble s/8 of byte s%8, high 2 bits are bits 2*(s/4).. of byte 8 + s%4.
// An element is its 2 low bits minus 4 unless its hmask bit is set.
void deq_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* sc = b + 96;
  const float d_all = half(b + 108);
  int scale[16];
  for (int s = 0; s < 16; ++s) {
    const int lo = s < 8 ? (sc[s] & 0xF) : (sc[s - 8] >> 4);
    const int hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    scale[s] = (lo | (hi << 4)) - 32;
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int h = 0; h < 2; ++h) {
        const float dl = d_all * static_cast<float>(scale[is++]);
        for (int l = 16 * h; l < 16 * h + 16; ++l) {
          const int v = ((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4);
          *y++ = dl * static_cast<float>(v);
        }
      }
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// Q4_K/Q5_K pack 8 six-bit scales and 8 six-bit mins in 12 bytes (ggml's get_scale_min_k4).
void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// block_q4_K {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: 8 groups of 32; x = d*sc*q - dmin*m.
void deq_q4_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2) {
    uint8_t sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) *y++ = mul_sub(d1, static_cast<float>(q[l] & 0xF), m1);
    for (int l = 0; l < 32; ++l) *y++ = mul_sub(d2, static_cast<float>(q[l] >> 4), m2);
    q += 32;
  }
}

// block_q5_K {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}: as Q4_K with a fifth bit from qh
// (bit 2*(j/64) for the low nibbles, the next bit for the high ones).
void deq_q5_k(const uint8_t* b, float* y) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2) {
    uint8_t sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * static_cast<float>(sc), m2 = dmin * static_cast<float>(m);
    for (int l = 0; l < 32; ++l) *y++ = mul_sub(d1, static_cast<float>((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)), m1);
    for (int l = 0; l < 32; ++l) *y++ = mul_sub(d2, static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)), m2);
    ql += 32;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

// block_q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: 6-bit q - 32, 16 groups of 16;
// x = (d*scale)*q.
void deq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < QK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = (d * static_cast<float>(sc[is + 0])) * static_cast<float>(q1);
      y[l + 32] = (d * static_cast<float>(sc[is + 2])) * static_cast<float>(q2);
      y[l + 64] = (d * static_cast<float>(sc[is + 4])) * static_cast<float>(q3);
      y[l + 96] = (d * static_cast<float>(sc[is + 6])) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// block_q8_K {f32 d; i8 qs[256]; i16 bsums[16]}: x = d*q (bsums only speed up dot products).
void deq_q8_k(const uint8_t* b, float* y) {
  float d;
  std::memcpy(&d, b, 4);
  for (int j = 0; j < QK_K; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(b[4 + j]));
}

// AVX2 forms of the commonest 32-element formats: the same products and sums per element as the loops
// above (exact integer-to-float conversions, a multiply rounded, then the add rounded: the target has no
// FMA, so nothing is contracted), eight elements at a time.
#define OOMLESS_DEQ_TARGET __attribute__((target("avx2,f16c")))

template <bool Signed, int Bias, bool Min>
OOMLESS_DEQ_TARGET inline void store_scaled(float* y, __m128i q8, __m256 d, __m256 m) {
  for (int h = 0; h < 2; ++h) {
    const __m128i part = h ? _mm_srli_si128(q8, 8) : q8;
    __m256i qi = Signed ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    if (Bias) qi = _mm256_sub_epi32(qi, _mm256_set1_epi32(Bias));
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d);
    if (Min) v = _mm256_add_ps(v, m);
    _mm256_storeu_ps(y + 8 * h, v);
  }
}

// f16 -> f32 by the F16C instruction (exact, as f16_to_f32).
OOMLESS_DEQ_TARGET inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

OOMLESS_DEQ_TARGET void deq_q4_0_avx2(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(half_f16c(b));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), nib = _mm_set1_epi8(0x0F);
  store_scaled<false, 8, false>(y, _mm_and_si128(q, nib), d, d);
  store_scaled<false, 8, false>(y + 16, _mm_and_si128(_mm_srli_epi16(q, 4), nib), d, d);
}

OOMLESS_DEQ_TARGET void deq_q4_1_avx2(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(half_f16c(b)), m = _mm256_set1_ps(half_f16c(b + 2));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)), nib = _mm_set1_epi8(0x0F);
  store_scaled<false, 0, true>(y, _mm_and_si128(q, nib), d, m);
  store_scaled<false, 0, true>(y + 16, _mm_and_si128(_mm_srli_epi16(q, 4), nib), d, m);
}

OOMLESS_DEQ_TARGET void deq_q8_0_avx2(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(half_f16c(b));
  store_scaled<true, 0, false>(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), d, d);
  store_scaled<true, 0, false>(y + 16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), d, d);
}

// AVX-512 forms, whole runs of blocks in one loop: sixteen elements at a time, the same operations (the
// compiler may fuse d * q + m into one FMA: d is an f16 and q a 4- or 8-bit integer, so d * q is exact in
// f32 and the fused form rounds the same). The weights stream once per product (decode): a prefetch about
// a kilobyte ahead, one per cache line.
#define OOMLESS_DEQ512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))

template <bool Signed, int Bias, bool Min>
OOMLESS_DEQ512_TARGET inline void store16(float* y, __m128i q8, __m512 d, __m512 m) {
  __m512i qi = Signed ? _mm512_cvtepi8_epi32(q8) : _mm512_cvtepu8_epi32(q8);
  if (Bias) qi = _mm512_sub_epi32(qi, _mm512_set1_epi32(Bias));
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(qi), d);
  if (Min) v = _mm512_add_ps(v, m);
  _mm512_storeu_ps(y, v);
}

OOMLESS_DEQ512_TARGET inline float half_512(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

OOMLESS_DEQ512_TARGET void run_q4_0_512(const uint8_t* b, int64_t n, float* y) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t k = 0; k < n; ++k, b += 18, y += QK) {
    if (k % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + 1152, _MM_HINT_T0);
    const __m512 d = _mm512_set1_ps(half_512(b));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    store16<false, 8, false>(y, _mm_and_si128(q, nib), d, d);
    store16<false, 8, false>(y + 16, _mm_and_si128(_mm_srli_epi16(q, 4), nib), d, d);
  }
}

OOMLESS_DEQ512_TARGET void run_q4_1_512(const uint8_t* b, int64_t n, float* y) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  for (int64_t k = 0; k < n; ++k, b += 20, y += QK) {
    if (k % 3 == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + 1280, _MM_HINT_T0);
    const __m512 d = _mm512_set1_ps(half_512(b)), m = _mm512_set1_ps(half_512(b + 2));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    store16<false, 0, true>(y, _mm_and_si128(q, nib), d, m);
    store16<false, 0, true>(y + 16, _mm_and_si128(_mm_srli_epi16(q, 4), nib), d, m);
  }
}

OOMLESS_DEQ512_TARGET void run_q8_0_512(const uint8_t* b, int64_t n, float* y) {
  for (int64_t k = 0; k < n; ++k, b += 34, y += QK) {
    if (k % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + 1088, _MM_HINT_T0);
    const __m512 d = _mm512_set1_ps(half_512(b));
    store16<true, 0, false>(y, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), d, d);
    store16<true, 0, false>(y + 16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18)), d, d);
  }
}

// The one-row product's kernels (ggml_row_dot): a block's four eight-element chunks made in registers by the
// operations of the AVX2 decoders above (d * q is exact in f32, so the fused d * q + m of Q4_1 rounds as the
// decoder's product and sum do), each chunk fused-multiply-added into its row's eight lanes.
#define OOMLESS_DOT_TARGET __attribute__((target("avx2,fma,f16c")))

OOMLESS_DOT_TARGET inline __m256 widen_u8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
OOMLESS_DOT_TARGET inline __m256 widen_i8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

OOMLESS_DOT_TARGET inline void chunks_q4_0(const uint8_t* b, __m256* x) {
  const __m256 d = _mm256_set1_ps(half_f16c(b));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), nib = _mm_set1_epi8(0x0F);
  const __m128i eight = _mm_set1_epi8(8);
  const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, nib), eight), hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), nib), eight);
  x[0] = _mm256_mul_ps(widen_i8(lo), d);
  x[1] = _mm256_mul_ps(widen_i8(_mm_srli_si128(lo, 8)), d);
  x[2] = _mm256_mul_ps(widen_i8(hi), d);
  x[3] = _mm256_mul_ps(widen_i8(_mm_srli_si128(hi, 8)), d);
}

OOMLESS_DOT_TARGET inline void chunks_q4_1(const uint8_t* b, __m256* x) {
  const __m256 d = _mm256_set1_ps(half_f16c(b)), m = _mm256_set1_ps(half_f16c(b + 2));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)), nib = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(q, nib), hi = _mm_and_si128(_mm_srli_epi16(q, 4), nib);
  x[0] = _mm256_fmadd_ps(widen_u8(lo), d, m);
  x[1] = _mm256_fmadd_ps(widen_u8(_mm_srli_si128(lo, 8)), d, m);
  x[2] = _mm256_fmadd_ps(widen_u8(hi), d, m);
  x[3] = _mm256_fmadd_ps(widen_u8(_mm_srli_si128(hi, 8)), d, m);
}

OOMLESS_DOT_TARGET inline void chunks_q8_0(const uint8_t* b, __m256* x) {
  const __m256 d = _mm256_set1_ps(half_f16c(b));
  const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
  const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
  x[0] = _mm256_mul_ps(widen_i8(q0), d);
  x[1] = _mm256_mul_ps(widen_i8(_mm_srli_si128(q0, 8)), d);
  x[2] = _mm256_mul_ps(widen_i8(q1), d);
  x[3] = _mm256_mul_ps(widen_i8(_mm_srli_si128(q1, 8)), d);
}

// A block's four chunks x[0..3] times a0..a3 fused-multiply-added into the sum s, in chunk order (k ascending).
#define OOMLESS_DOT_CHUNKS(FMA, s) FMA(a3, x[3], FMA(a2, x[2], FMA(a1, x[1], FMA(a0, x[0], s))))

// G rows at once (a read once per block for all of them), k ascending within each lane.
// ahead: bytes past each row's blocks to prefetch, a line at a time (where the next group of rows lies).
template <void (*Chunks)(const uint8_t*, __m256*), int Bytes, int G>
OOMLESS_DOT_TARGET inline void dot_rows_g(const uint8_t* const* rows, int64_t blocks, const float* a, float* acc,
                                          int64_t ahead) {
  constexpr int kEvery = 64 / Bytes;  // blocks a cache line
  __m256 s[G];
  for (int i = 0; i < G; ++i) s[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t k = 0; k < blocks; ++k) {
    const float* ak = a + 32 * k;
    const __m256 a0 = _mm256_loadu_ps(ak), a1 = _mm256_loadu_ps(ak + 8), a2 = _mm256_loadu_ps(ak + 16),
                 a3 = _mm256_loadu_ps(ak + 24);
    for (int i = 0; i < G; ++i) {
      const uint8_t* b = rows[i] + k * Bytes;
      if (k % kEvery == 0) _mm_prefetch(reinterpret_cast<const char*>(b) + ahead, _MM_HINT_T0);
      __m256 x[4];
      Chunks(b, x);
      s[i] = OOMLESS_DOT_CHUNKS(_mm256_fmadd_ps, s[i]);
    }
  }
  for (int i = 0; i < G; ++i) _mm256_storeu_ps(acc + 8 * i, s[i]);
}

template <void (*Chunks)(const uint8_t*, __m256*), int Bytes>
OOMLESS_DOT_TARGET void dot_rows(const uint8_t* const* rows, int g, int64_t blocks, const float* a, float* acc,
                                 int64_t ahead) {
  int i = 0;
  for (; i + 4 <= g; i += 4) dot_rows_g<Chunks, Bytes, 4>(rows + i, blocks, a, acc + 8 * i, ahead);
  for (; i < g; ++i) dot_rows_g<Chunks, Bytes, 1>(rows + i, blocks, a, acc + 8 * i, ahead);
}

// The AVX-512 form: two rows a vector, lanes 0-7 the first row's eight lanes and 8-15 the second's, every lane's
// operations those of the chunks above (the same d * q [+ m], the same fused multiply-add into the same lane of
// its row's sum), so the bits are the eight-lane form's; half the instructions a block.
#define OOMLESS_DOT512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
// GCC 12's AVX-512 intrinsics trip -Wmaybe-uninitialized on their own undefined operand.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// Eight bytes at a, then eight at b.
OOMLESS_DOT512_TARGET inline __m128i pair8(const uint8_t* a, const uint8_t* b) {
  return _mm_castpd_si128(
      _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a))), reinterpret_cast<const double*>(b)));
}
// The f16 pairs (d, m) at a and at b as f32 [d_a, m_a, d_b, m_b] (m: whatever follows d where there is none).
OOMLESS_DOT512_TARGET inline __m128 scales4(const uint8_t* a, const uint8_t* b) {
  int32_t x, y;
  std::memcpy(&x, a, 4);
  std::memcpy(&y, b, 4);
  return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(x), y, 1));
}
// Lane 0 of s4 in lanes 0-7 and lane 2 in lanes 8-15 (Off 0: the d's), or lanes 1 and 3 (Off 1: the m's).
template <int Off>
OOMLESS_DOT512_TARGET inline __m512 spread(__m128 s4) {
  const __m512i idx = _mm512_set_epi32(2 + Off, 2 + Off, 2 + Off, 2 + Off, 2 + Off, 2 + Off, 2 + Off, 2 + Off, Off, Off,
                                       Off, Off, Off, Off, Off, Off);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s4));
}
OOMLESS_DOT512_TARGET inline __m512 wide_u8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }
OOMLESS_DOT512_TARGET inline __m512 wide_i8(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
// Eight floats at p in both halves.
OOMLESS_DOT512_TARGET inline __m512 twice(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// The chunks: the bytes of both rows' chunk c side by side as they are loaded ([a 0-7 | b 0-7] for chunks 0
// and 2 of the nibble types, [a 8-15 | b 8-15] for 1 and 3), so the only shuffles are the widenings and the
// scales' spreading.
OOMLESS_DOT512_TARGET inline void chunks2_q4_0(const uint8_t* a, const uint8_t* b, __m512* x) {
  const __m512 d = spread<0>(scales4(a, b));
  const __m128i nib = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  const __m128i q0 = pair8(a + 2, b + 2), q1 = pair8(a + 10, b + 10);
  x[0] = _mm512_mul_ps(wide_i8(_mm_sub_epi8(_mm_and_si128(q0, nib), eight)), d);
  x[1] = _mm512_mul_ps(wide_i8(_mm_sub_epi8(_mm_and_si128(q1, nib), eight)), d);
  x[2] = _mm512_mul_ps(wide_i8(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q0, 4), nib), eight)), d);
  x[3] = _mm512_mul_ps(wide_i8(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q1, 4), nib), eight)), d);
}

OOMLESS_DOT512_TARGET inline void chunks2_q4_1(const uint8_t* a, const uint8_t* b, __m512* x) {
  const __m128 s4 = scales4(a, b);
  const __m512 d = spread<0>(s4), m = spread<1>(s4);
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i q0 = pair8(a + 4, b + 4), q1 = pair8(a + 12, b + 12);
  x[0] = _mm512_fmadd_ps(wide_u8(_mm_and_si128(q0, nib)), d, m);
  x[1] = _mm512_fmadd_ps(wide_u8(_mm_and_si128(q1, nib)), d, m);
  x[2] = _mm512_fmadd_ps(wide_u8(_mm_and_si128(_mm_srli_epi16(q0, 4), nib)), d, m);
  x[3] = _mm512_fmadd_ps(wide_u8(_mm_and_si128(_mm_srli_epi16(q1, 4), nib)), d, m);
}

OOMLESS_DOT512_TARGET inline void chunks2_q8_0(const uint8_t* a, const uint8_t* b, __m512* x) {
  const __m512 d = spread<0>(scales4(a, b));
  x[0] = _mm512_mul_ps(wide_i8(pair8(a + 2, b + 2)), d);
  x[1] = _mm512_mul_ps(wide_i8(pair8(a + 10, b + 10)), d);
  x[2] = _mm512_mul_ps(wide_i8(pair8(a + 18, b + 18)), d);
  x[3] = _mm512_mul_ps(wide_i8(pair8(a + 26, b + 26)), d);
}

// 2 P rows at once, as dot_rows_g (acc's rows are eight floats apart, so a pair's sums are sixteen in a row).
template <void (*Chunks2)(const uint8_t*, const uint8_t*, __m512*), int Bytes, int P>
OOMLESS_DOT512_TARGET inline void dot_pairs_g(const uint8_t* const* rows, int64_t blocks, const float* a, float* acc,
                                              int64_t ahead) {
  constexpr int kEvery = 64 / Bytes;  // blocks a cache line
  __m512 s[P];
  for (int i = 0; i < P; ++i) s[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t k = 0; k < blocks; ++k) {
    const float* ak = a + 32 * k;
    const __m512 a0 = twice(ak), a1 = twice(ak + 8), a2 = twice(ak + 16), a3 = twice(ak + 24);
    for (int i = 0; i < P; ++i) {
      const uint8_t* b0 = rows[2 * i] + k * Bytes;
      const uint8_t* b1 = rows[2 * i + 1] + k * Bytes;
      if (k % kEvery == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(b0) + ahead, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(b1) + ahead, _MM_HINT_T0);
      }
      __m512 x[4];
      Chunks2(b0, b1, x);
      s[i] = OOMLESS_DOT_CHUNKS(_mm512_fmadd_ps, s[i]);
    }
  }
  for (int i = 0; i < P; ++i) _mm512_storeu_ps(acc + 16 * i, s[i]);
}

template <void (*Chunks)(const uint8_t*, __m256*), void (*Chunks2)(const uint8_t*, const uint8_t*, __m512*), int Bytes>
OOMLESS_DOT512_TARGET void dot_rows512(const uint8_t* const* rows, int g, int64_t blocks, const float* a, float* acc,
                                       int64_t ahead) {
  int i = 0;
  for (; i + 8 <= g; i += 8) dot_pairs_g<Chunks2, Bytes, 4>(rows + i, blocks, a, acc + 8 * i, ahead);
  for (; i + 2 <= g; i += 2) dot_pairs_g<Chunks2, Bytes, 1>(rows + i, blocks, a, acc + 8 * i, ahead);
  if (i < g) dot_rows_g<Chunks, Bytes, 1>(rows + i, blocks, a, acc + 8 * i, ahead);
}

using BlockFn = void (*)(const uint8_t*, float*);

// The vector forms this CPU has, lowered by OOMLESS_ISA as the GEMM's are (generic: none, avx2: no AVX-512),
// so that a machine with AVX-512 tests every form.
bool isa_allows(const char* level) {
  const char* env = std::getenv("OOMLESS_ISA");
  if (!env || !*env) return true;
  const std::string e(env);
  if (e == "generic") return false;
  return !(e == "avx2" && std::strcmp(level, "avx512") == 0);
}

bool have_avx512() {
  static const CpuInfo c = detect_cpu();
  static const bool yes = isa_allows("avx512") && c.avx512f && c.avx512bw && c.avx512vl && c.f16c;
  return yes;
}

bool have_avx2() {
  static const CpuInfo c = detect_cpu();
  static const bool yes = isa_allows("avx2") && c.avx2 && c.f16c;
  return yes;
}

// A run of blocks through one block function (the function's bytes and elements per block from the type).
template <BlockFn F, int Bytes, int Elems>
void run_blocks(const uint8_t* b, int64_t n, float* y) {
  for (int64_t k = 0; k < n; ++k) F(b + k * Bytes, y + k * Elems);
}

// The one-element "blocks" of the float types.
void run_f32(const uint8_t* b, int64_t n, float* y) { std::memcpy(y, b, static_cast<size_t>(n) * 4); }
void run_f16(const uint8_t* b, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = half(b + 2 * i);
}
void run_bf16(const uint8_t* b, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, b + 2 * i, 2);
    y[i] = bf16_to_f32(h);
  }
}
void run_f64(const uint8_t* b, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    double v;
    std::memcpy(&v, b + 8 * i, 8);
    y[i] = static_cast<float>(v);
  }
}

GgmlBlockDecoder block_decoder(GgmlType t) {
  const bool v512 = have_avx512(), v2 = have_avx2();
  switch (t) {
    case GgmlType::F32: return run_f32;
    case GgmlType::F16: return run_f16;
    case GgmlType::BF16: return run_bf16;
    case GgmlType::F64: return run_f64;
    case GgmlType::Q4_0: return v512 ? run_q4_0_512 : v2 ? run_blocks<deq_q4_0_avx2, 18, QK> : run_blocks<deq_q4_0, 18, QK>;
    case GgmlType::Q4_1: return v512 ? run_q4_1_512 : v2 ? run_blocks<deq_q4_1_avx2, 20, QK> : run_blocks<deq_q4_1, 20, QK>;
    case GgmlType::Q8_0: return v512 ? run_q8_0_512 : v2 ? run_blocks<deq_q8_0_avx2, 34, QK> : run_blocks<deq_q8_0, 34, QK>;
    case GgmlType::Q5_0: return run_blocks<deq_q5_0, 22, QK>;
    case GgmlType::Q5_1: return run_blocks<deq_q5_1, 24, QK>;
    case GgmlType::Q2_K: return run_blocks<deq_q2_k, 84, QK_K>;
    case GgmlType::Q3_K: return run_blocks<deq_q3_k, 110, QK_K>;
    case GgmlType::Q4_K: return run_blocks<deq_q4_k, 144, QK_K>;
    case GgmlType::Q5_K: return run_blocks<deq_q5_k, 176, QK_K>;
    case GgmlType::Q6_K: return run_blocks<deq_q6_k, 210, QK_K>;
    case GgmlType::Q8_K: return run_blocks<deq_q8_k, 292, QK_K>;
    default: return nullptr;
  }
}

}  // namespace

GgmlBlockDecoder ggml_block_decoder(GgmlType t) { return block_decoder(t); }

GgmlRowDot ggml_row_dot(GgmlType t) {
  static const bool fma = detect_cpu().fma;
  if (!have_avx2() || !fma) return nullptr;
  if (have_avx512()) switch (t) {
      case GgmlType::Q4_0: return dot_rows512<chunks_q4_0, chunks2_q4_0, 18>;
      case GgmlType::Q4_1: return dot_rows512<chunks_q4_1, chunks2_q4_1, 20>;
      case GgmlType::Q8_0: return dot_rows512<chunks_q8_0, chunks2_q8_0, 34>;
      default: return nullptr;
    }
  switch (t) {
    case GgmlType::Q4_0: return dot_rows<chunks_q4_0, 18>;
    case GgmlType::Q4_1: return dot_rows<chunks_q4_1, 20>;
    case GgmlType::Q8_0: return dot_rows<chunks_q8_0, 34>;
    default: return nullptr;
  }
}
#pragma GCC diagnostic pop  // (from the AVX-512 one-row kernels, instantiated above)

bool ggml_can_dequantize(GgmlType t) {
  return block_decoder(t) != nullptr;
}

void dequantize(GgmlType t, const void* src, int64_t n, float* dst) {
  const GgmlTypeInfo* info = ggml_type_info(static_cast<uint32_t>(t));
  OOM_CHECK(info, "[gguf] dequantize: ", ggml_type_name(t), " is not a ggml type");
  OOM_CHECK(ggml_can_dequantize(t), "[gguf] dequantize: ggml type ", info->name,
            " is not supported (supported: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, "
            "Q5_K, Q6_K, Q8_K); re-quantize the model to one of these");
  OOM_CHECK(n >= 0 && n % info->block_size == 0, "[gguf] dequantize: ", n, " elements of ", info->name,
            " is not a whole number of ", info->block_size, "-element blocks");
  if (n == 0) return;  // empty tensors have no data pointer
  block_decoder(t)(static_cast<const uint8_t*>(src), n / info->block_size, dst);
}

}  // namespace oomless
