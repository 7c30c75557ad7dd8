// The one-row products of Q4_0, Q4_1 and Q8_0 blocks with an activation row quantised to 8 bits
// (core/q8_act.h), in integers (io/gguf.h: ggml_row_dot_q8). Every form follows one order of operations,
// so that all give the same bits:
//   for each block b, ascending: eight int32 lanes, lane l the exact sum of the products of the weight
//     codes and activation codes of elements 4l .. 4l + 3 (Q4_0 and Q4_1: the nibble 0..15; Q8_0: the
//     signed byte);
//     sc = d_w * d_a[b] (f32);  acc[l] = fma(float(lane[l]), sc, acc[l]);
//     the offset term: Q4_1 off = off + m_w * s_a[b]; Q4_0 off = off + d_w * s_a[b] (each product rounded,
//     then the sum);
//   out = (((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7))) + (Q4_1: off; Q4_0: -8 off).
// (Q4_0's element is (nibble - 8) d_w: -8 times the sum of d_w s_a is the offset, exactly.) The file is
// built without contracting a * b + c into fused multiply-adds (CMakeLists.txt), so only the written ones
// are fused. The lanes are exact: |lane| <= 4 * 128 * 127 < 2^24, so float(lane) is too. AVX2 forms them
// with vpmaddubsw (unsigned weight bytes times signed activation bytes, pairs summed in int16: at most
// 2 * 128 * 127 < 2^15, no saturation; Q8_0's signed weights enter as |w| with the sign moved to the
// activation) and vpmaddwd; AVX512-VNNI with one vpdpbusd on the same pairs of operands. Four rows at a
// time, the rows' f16 scales (and Q4_1's mins) are widened and multiplied by the activation's in one
// vector.
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/cpu_info.h"
#include "core/dtype.h"
#include "io/gguf.h"

namespace oomless {

namespace {

constexpr int QK = 32;

// The three block layouts: bytes a block, where the codes start, whether they are nibbles.
template <GgmlType T> struct Layout;
// rows: how many rows a kernel call interleaves (measured once, in a microbenchmark not kept: Q8_0's 34-byte
// blocks stream faster one row at a time, 31 against 15 GB/s over two threads on an AMD EPYC with AVX-512;
// the nibble types four at a time, 27 against 22).
template <> struct Layout<GgmlType::Q4_0> {
  static constexpr int bytes = 18, codes = 2, rows = 4;
  static constexpr bool nibbles = true;
};
template <> struct Layout<GgmlType::Q4_1> {
  static constexpr int bytes = 20, codes = 4, rows = 4;
  static constexpr bool nibbles = true;
};
template <> struct Layout<GgmlType::Q8_0> {
  static constexpr int bytes = 34, codes = 2, rows = 1;
  static constexpr bool nibbles = false;
};

float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// The offset term of a row from its running sum (see the file comment).
template <GgmlType T> inline float final_offset(float off) {
  if constexpr (T == GgmlType::Q4_0) return -8.0f * off;
  else if constexpr (T == GgmlType::Q4_1) return off;
  else return 0.0f;
}

// The element's integer code (Q4: the nibble; Q8_0: the signed byte).
template <GgmlType T> inline int code(const uint8_t* b, int k) {
  const uint8_t* q = b + Layout<T>::codes;
  if constexpr (Layout<T>::nibbles) return k < QK / 2 ? (q[k] & 0x0F) : (q[k - QK / 2] >> 4);
  else return static_cast<int8_t>(q[k]);
}

inline float lanes_sum(const float* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <GgmlType T>
float dot_scalar(const uint8_t* row, int64_t blocks, const Q8Act& a) {
  float acc[8] = {}, off = 0.0f;
  for (int64_t k = 0; k < blocks; ++k) {
    const uint8_t* b = row + k * Layout<T>::bytes;
    const int8_t* q = a.q + k * QK;
    const float d = f16_at(b), sc = d * a.d[k];
    for (int l = 0; l < 8; ++l) {
      int lane = 0;
      for (int j = 4 * l; j < 4 * l + 4; ++j) lane += code<T>(b, j) * q[j];
      acc[l] = std::fma(static_cast<float>(lane), sc, acc[l]);
    }
    if constexpr (T == GgmlType::Q4_1) off = off + f16_at(b + 2) * a.s[k];
    if constexpr (T == GgmlType::Q4_0) off = off + d * a.s[k];
  }
  return lanes_sum(acc) + final_offset<T>(off);
}

// ---- vector forms ------------------------------------------------------------------------------------

#define OOMLESS_Q8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define OOMLESS_Q8_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

OOMLESS_Q8_AVX2 inline float f16_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A block's 32 weight codes in element order (the low nibbles of its 16 bytes, then the high ones) as the
// unsigned operand of the pair products: the 16 bytes in both halves, the upper half shifted by 4.
OOMLESS_Q8_AVX2 inline __m256i nibbles_avx2(const uint8_t* qs) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0), _mm256_set1_epi8(0x0F));
}
OOMLESS_Q8_VNNI inline __m256i nibbles_vnni(const uint8_t* qs) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i shift = _mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  return _mm256_and_si256(_mm256_srlv_epi16(q, shift), _mm256_set1_epi8(0x0F));
}

OOMLESS_Q8_AVX2 inline __m256i lanes_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
OOMLESS_Q8_VNNI inline __m256i lanes_vnni(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

OOMLESS_Q8_AVX2 inline float finish(__m256 acc, float off) {
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  return lanes_sum(l) + off;
}

// Block k's scale products of four rows: sc[i] = d_i * d_a in lanes 2i (Q4_1: m_i * s_a in lanes 2i + 1,
// from one widening of the four rows' (d, m) pairs); offset products for Q4_0 as d_i * s_a in lanes 2i + 1.
template <GgmlType T>
OOMLESS_Q8_AVX2 inline __m256 scales4(const uint8_t* const* b, float da, float sa) {
  __m128i h;
  if constexpr (T == GgmlType::Q4_1) {  // (d, m) of each row: 32 bits at the block's start
    int32_t w[4];
    for (int i = 0; i < 4; ++i) std::memcpy(&w[i], b[i], 4);
    h = _mm_setr_epi32(w[0], w[1], w[2], w[3]);
  } else {  // (d, d)
    uint16_t d[4];
    for (int i = 0; i < 4; ++i) std::memcpy(&d[i], b[i], 2);
    h = _mm_setr_epi16(static_cast<int16_t>(d[0]), static_cast<int16_t>(d[0]), static_cast<int16_t>(d[1]),
                       static_cast<int16_t>(d[1]), static_cast<int16_t>(d[2]), static_cast<int16_t>(d[2]),
                       static_cast<int16_t>(d[3]), static_cast<int16_t>(d[3]));
  }
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_setr_ps(da, sa, da, sa, da, sa, da, sa));
}

// G (1 or 4) rows at once (each activation block loaded once for all of them), blocks ascending; `ahead`
// bytes past each row's block prefetched a line at a time (where the next group of rows lies). One kernel a
// form: NIBBLES and LANES are the form's unpacking and lane products, TARGET its instruction set.
#define OOMLESS_Q8_ROWS(NAME, TARGET, NIBBLES, LANES)                                                       \
  template <GgmlType T, int G>                                                                              \
  TARGET void NAME(const uint8_t* const* rows, int64_t blocks, const Q8Act& a, float* out, int64_t ahead) { \
    constexpr int kBytes = Layout<T>::bytes, kEvery = 64 / kBytes;                                          \
    static_assert(G == 1 || (G == 4 && Layout<T>::nibbles));                                                \
    __m256 acc[G];                                                                                          \
    for (int i = 0; i < G; ++i) acc[i] = _mm256_setzero_ps();                                               \
    __m256 offs = _mm256_setzero_ps(); /* G = 4: the offset sums in the odd lanes */                        \
    float off = 0.0f;                  /* G = 1 */                                                          \
    for (int64_t k = 0; k < blocks; ++k) {                                                                  \
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + k * QK));               \
      const float da = a.d[k], sa = a.s[k];                                                                 \
      const uint8_t* b[G];                                                                                  \
      for (int i = 0; i < G; ++i) {                                                                         \
        b[i] = rows[i] + k * kBytes;                                                                        \
        if (ahead && k % kEvery == 0) _mm_prefetch(reinterpret_cast<const char*>(b[i]) + ahead, _MM_HINT_T0); \
      }                                                                                                     \
      if constexpr (G == 4) {                                                                               \
        const __m256 sc = scales4<T>(b, da, sa);                                                            \
        offs = _mm256_add_ps(offs, sc);                                                                     \
        for (int i = 0; i < 4; ++i) {                                                                       \
          const __m256 s = _mm256_permutevar8x32_ps(sc, _mm256_set1_epi32(2 * i));                          \
          const __m256i l = LANES(NIBBLES(b[i] + Layout<T>::codes), qa);                                    \
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), s, acc[i]);                                       \
        }                                                                                                   \
      } else {                                                                                              \
        const float d = f16_f16c(b[0]);                                                                     \
        __m256i l;                                                                                          \
        if constexpr (Layout<T>::nibbles) {                                                                 \
          l = LANES(NIBBLES(b[0] + Layout<T>::codes), qa);                                                  \
        } else {                                                                                            \
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b[0] + Layout<T>::codes)); \
          l = LANES(_mm256_abs_epi8(w), _mm256_sign_epi8(qa, w));                                           \
        }                                                                                                   \
        acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_set1_ps(d * da), acc[0]);                    \
        if constexpr (T == GgmlType::Q4_1) off = off + f16_f16c(b[0] + 2) * sa;                             \
        if constexpr (T == GgmlType::Q4_0) off = off + d * sa;                                              \
      }                                                                                                     \
    }                                                                                                       \
    if constexpr (G == 4) {                                                                                 \
      alignas(32) float o[8];                                                                               \
      _mm256_store_ps(o, offs);                                                                             \
      for (int i = 0; i < 4; ++i) out[i] = finish(acc[i], final_offset<T>(o[2 * i + 1]));                  \
    } else {                                                                                                \
      out[0] = finish(acc[0], final_offset<T>(off));                                                        \
    }                                                                                                       \
  }

// A form's GgmlRowDotQ8: the rows four at a time where the type interleaves them, then one at a time.
#define OOMLESS_Q8_DOT(NAME, ROWS, TARGET)                                                                  \
  template <GgmlType T>                                                                                     \
  TARGET void NAME(const uint8_t* const* rows, int g, int64_t blocks, const Q8Act& a, float* out, int64_t ahead) { \
    int i = 0;                                                                                              \
    if constexpr (Layout<T>::rows == 4)                                                                     \
      for (; i + 4 <= g; i += 4) ROWS<T, 4>(rows + i, blocks, a, out + i, ahead);                           \
    for (; i < g; ++i) ROWS<T, 1>(rows + i, blocks, a, out + i, Layout<T>::rows == 1 ? 0 : ahead);          \
  }

OOMLESS_Q8_ROWS(rows_avx2, OOMLESS_Q8_AVX2, nibbles_avx2, lanes_avx2)
OOMLESS_Q8_ROWS(rows_vnni, OOMLESS_Q8_VNNI, nibbles_vnni, lanes_vnni)
OOMLESS_Q8_DOT(dot_avx2, rows_avx2, OOMLESS_Q8_AVX2)
OOMLESS_Q8_DOT(dot_vnni, rows_vnni, OOMLESS_Q8_VNNI)
#undef OOMLESS_Q8_ROWS
#undef OOMLESS_Q8_DOT


// OOMLESS_ISA lowers the form as it does the GEMM's and the block decoders' (generic: none, avx2: no AVX-512).
bool allowed(const char* level) {
  const char* env = std::getenv("OOMLESS_ISA");
  if (!env || !*env) return true;
  if (std::strcmp(env, "generic") == 0) return false;
  return !(std::strcmp(env, "avx2") == 0 && std::strcmp(level, "avx512") == 0);
}

template <template <GgmlType> class F>
GgmlRowDotQ8 pick(GgmlType t) {
  switch (t) {
    case GgmlType::Q4_0: return F<GgmlType::Q4_0>::fn;
    case GgmlType::Q4_1: return F<GgmlType::Q4_1>::fn;
    case GgmlType::Q8_0: return F<GgmlType::Q8_0>::fn;
    default: return nullptr;
  }
}
template <GgmlType T> struct Avx2 { static constexpr GgmlRowDotQ8 fn = dot_avx2<T>; };
template <GgmlType T> struct Vnni { static constexpr GgmlRowDotQ8 fn = dot_vnni<T>; };

}  // namespace

GgmlRowDotQ8 ggml_row_dot_q8(GgmlType t) {
  static const CpuInfo c = detect_cpu();
  if (!(c.avx2 && c.fma && c.f16c) || !allowed("avx2")) return nullptr;
  if (c.avx512_vnni && c.avx512vl && c.avx512bw && allowed("avx512")) return pick<Vnni>(t);
  return pick<Avx2>(t);
}

const char* ggml_row_dot_q8_form() {
  static const CpuInfo c = detect_cpu();
  if (!(c.avx2 && c.fma && c.f16c) || !allowed("avx2")) return "none";
  return c.avx512_vnni && c.avx512vl && c.avx512bw && allowed("avx512") ? "avx512-vnni" : "avx2";
}

float ggml_row_dot_q8_scalar(GgmlType t, const uint8_t* row, int64_t blocks, const Q8Act& a) {
  switch (t) {
    case GgmlType::Q4_0: return dot_scalar<GgmlType::Q4_0>(row, blocks, a);
    case GgmlType::Q4_1: return dot_scalar<GgmlType::Q4_1>(row, blocks, a);
    case GgmlType::Q8_0: return dot_scalar<GgmlType::Q8_0>(row, blocks, a);
    default: return NAN;
  }
}

}  // namespace oomless
