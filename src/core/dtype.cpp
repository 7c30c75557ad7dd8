// Scalar float conversions and the element-wise convert().
//
// Encoding works on the magnitude bits of the source (f32 or f64) and one generic rounding routine,
// round_magnitude(), serves every narrow format: it rounds to the target's precision with the
// target's subnormals but no upper exponent limit, so the caller sees a code one past the largest
// finite one exactly when IEEE rounding overflows, and applies the format's overflow rule:
//   f16, bf16 (from f64): inf.   f8_e5m2: inf, or +-57344 when saturating.
//   f8_e4m3 (fn): NaN (0x7f), or +-448 when saturating. Since 448 = 1.110b x 2^8 has an even
//   mantissa, the midpoint 464 rounds to 448 and only values above 464 are out of range.
// Rounding f64 sources directly (not through f32) avoids double rounding.
//
// Decoding assembles f32 bits field by field; every narrow value is exact in f32.
#include "core/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "core/clones.h"
#include "core/error.h"

namespace oomless {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f8_e4m3: return "f8_e4m3";
    case DType::f8_e5m2: return "f8_e5m2";
    case DType::i8: return "i8";
    case DType::nf4: return "nf4";
    case DType::i32: return "i32";
    case DType::u8: return "u8";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  if (s == "f32" || s == "fp32" || s == "float32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "f16" || s == "fp16" || s == "float16") return DType::f16;
  fail("[dtype] unknown dtype '", s, "': use f32 (fp32, float32), bf16 (bfloat16) or f16 (fp16, float16)");
}

namespace {

// Source formats: unsigned bits type, mantissa bits, exponent bias.
struct F32Src {
  using U = uint32_t;
  static constexpr int kMant = 23, kBias = 127;
  static constexpr U kSign = 0x80000000u, kInf = 0x7f800000u;
  static U bits(float f) { return f32_bits(f); }
};
struct F64Src {
  using U = uint64_t;
  static constexpr int kMant = 52, kBias = 1023;
  static constexpr U kSign = 0x8000000000000000ull, kInf = 0x7ff0000000000000ull;
  static U bits(double d) { U u; std::memcpy(&u, &d, 8); return u; }
};

// Rounds a finite, non-negative source magnitude `a` (bits without the sign) to a format with M
// mantissa bits and exponent bias B, to nearest even. The result is the target magnitude code
// ((biased exponent << M) | mantissa) as if the exponent range had no upper end.
//
// With m the significand (implicit bit included) and e the unbiased exponent, a = m * 2^(e - SM).
// Normal targets keep the top M+1 bits of m; below the target's smallest normal exponent 1-B the
// kept bits shrink by one per step (subnormals). Once SM+2 bits are dropped, m < 2^(SM+1) is below
// half a unit and rounds to zero, so the shift stops there. Round to nearest even is
// (m + half - 1 + lsb) >> shift, lsb being the last kept bit. Adding the rounded q to
// (biased exponent - 1) << M lets a carry out of the mantissa bump the exponent (and a subnormal
// become the smallest normal). The rounding has no data-dependent branches, which keeps the
// convert() loops fast on mixed data.
template <class Src, int M, int B>
inline uint64_t round_magnitude(typename Src::U a) {
  using U = typename Src::U;
  constexpr int SM = Src::kMant;
  static_assert(SM > M, "target must be narrower than the source");
  const int se = static_cast<int>(a >> SM);
  const U m = (a & ((U(1) << SM) - 1)) | (se != 0 ? U(1) << SM : U(0));
  const int e = (se != 0 ? se : 1) - Src::kBias;
  const int below = (1 - B) - e;  // > 0: steps below the smallest normal exponent
  const int shift = std::min(SM - M + std::max(below, 0), SM + 2);
  const uint64_t base = static_cast<uint64_t>(std::max(e + B - 1, 0));
  const U half = U(1) << (shift - 1);
  const U q = (m + (half - 1) + ((m >> shift) & 1)) >> shift;
  return (base << M) + static_cast<uint64_t>(q);
}

// IEEE-style format with E exponent bits, M mantissa bits and infinities (f16, bf16, f8_e5m2).
template <int E, int M, class Src>
inline uint32_t encode_ieee(typename Src::U u, bool saturate) {
  constexpr int B = (1 << (E - 1)) - 1;
  constexpr uint32_t kInf = ((1u << E) - 1) << M;
  constexpr uint32_t kMax = kInf - 1;
  constexpr uint32_t kQuietNan = kInf | (1u << (M - 1));
  const uint32_t sign = (u & Src::kSign) ? (1u << (E + M)) : 0u;
  const auto a = u & ~Src::kSign;
  if (a > Src::kInf) return sign | kQuietNan;
  if (a == Src::kInf) return sign | (saturate ? kMax : kInf);
  const uint64_t code = round_magnitude<Src, M, B>(a);
  if (code > kMax) return sign | (saturate ? kMax : kInf);
  return sign | static_cast<uint32_t>(code);
}

// OCP f8_e4m3 "fn": bias 7, no infinities, 0x7f is NaN, 0x7e = 448 the largest finite value.
template <class Src>
inline uint8_t encode_e4m3(typename Src::U u, bool saturate) {
  constexpr uint32_t kMax = 0x7e, kNan = 0x7f;
  const uint32_t sign = (u & Src::kSign) ? 0x80u : 0u;
  const auto a = u & ~Src::kSign;
  if (a > Src::kInf) return static_cast<uint8_t>(sign | kNan);
  if (a == Src::kInf) return static_cast<uint8_t>(sign | (saturate ? kMax : kNan));
  const uint64_t code = round_magnitude<Src, 3, 7>(a);
  if (code > kMax) return static_cast<uint8_t>(sign | (saturate ? kMax : kNan));
  return static_cast<uint8_t>(sign | code);
}

// f32 bits of a code with E exponent bits and M mantissa bits. has_inf: all-ones exponent means
// inf/NaN (IEEE); otherwise only the all-ones code is NaN (e4m3fn). NaNs come out quiet.
template <int E, int M, bool has_inf>
constexpr uint32_t decode_bits(uint32_t code) {
  constexpr int B = (1 << (E - 1)) - 1;
  constexpr uint32_t kExpMask = (1u << E) - 1, kManMask = (1u << M) - 1;
  const uint32_t sign = ((code >> (E + M)) & 1u) << 31;
  const uint32_t exp = (code >> M) & kExpMask;
  const uint32_t man = code & kManMask;
  if (has_inf && exp == kExpMask) return sign | 0x7f800000u | (man != 0 ? 0x400000u | (man << (23 - M)) : 0u);
  if (!has_inf && exp == kExpMask && man == kManMask) return sign | 0x7fc00000u;
  if (exp == 0) {
    if (man == 0) return sign;
    // man * 2^(1-B-M): normalise on the leading bit p.
    const int p = std::bit_width(man) - 1;
    const uint32_t fexp = static_cast<uint32_t>(p + 1 - B - M + 127);
    return sign | (fexp << 23) | ((man ^ (1u << p)) << (23 - p));
  }
  return sign | ((exp - B + 127) << 23) | (man << (23 - M));
}

template <int E, int M, bool has_inf>
constexpr std::array<float, 256> decode_table() {
  std::array<float, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) t[c] = std::bit_cast<float>(decode_bits<E, M, has_inf>(c));
  return t;
}
constexpr std::array<float, 256> kE4m3 = decode_table<4, 3, false>();
constexpr std::array<float, 256> kE5m2 = decode_table<5, 2, true>();

}  // namespace

uint16_t f32_to_f16(float f) {
  return static_cast<uint16_t>(encode_ieee<5, 10, F32Src>(F32Src::bits(f), false));
}
float f16_to_f32(uint16_t h) { return bits_f32(decode_bits<5, 10, true>(h)); }
uint8_t f32_to_f8e4m3(float f, bool saturate) { return encode_e4m3<F32Src>(F32Src::bits(f), saturate); }
float f8e4m3_to_f32(uint8_t b) { return kE4m3[b]; }
uint8_t f32_to_f8e5m2(float f, bool saturate) {
  return static_cast<uint8_t>(encode_ieee<5, 2, F32Src>(F32Src::bits(f), saturate));
}
float f8e5m2_to_f32(uint8_t b) { return kE5m2[b]; }

namespace {

// One tight loop per (source, destination) pair; the fixed-type bodies let the compiler vectorise
// the simple ones (f32 <-> bf16, f32 <-> f64).
template <class D, class S, class Fn>
void convert_loop(void* dst, const void* src, int64_t n, Fn fn) {
  D* d = static_cast<D*>(dst);
  const S* s = static_cast<const S*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = fn(s[i]);
}

// f32 -> bf16 (f32_to_bf16's bits, NaN kept quiet) and bf16 -> f32 without a branch, cloned for AVX2 and
// AVX-512 so that the loops vectorise (the bf16 operands of bf16 compute are converted every step).
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void f32_to_bf16_n(uint16_t* d, const float* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + i, 4);
    const uint32_t quiet = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}
OOMLESS_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
void bf16_to_f32_n(float* d, const uint16_t* s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &u, 4);
  }
}

// Source already decoded to f32 (exact for every float source but f64).
template <class S, class Load>
void convert_from(void* dst, DType dt, const void* src, DType st, int64_t n, Load load) {
  switch (dt) {
    case DType::f32: return convert_loop<float, S>(dst, src, n, [&](S x) { return load(x); });
    case DType::f64:
      return convert_loop<double, S>(dst, src, n, [&](S x) { return static_cast<double>(load(x)); });
    case DType::bf16: return convert_loop<uint16_t, S>(dst, src, n, [&](S x) { return f32_to_bf16(load(x)); });
    case DType::f16: return convert_loop<uint16_t, S>(dst, src, n, [&](S x) { return f32_to_f16(load(x)); });
    case DType::f8_e4m3:
      return convert_loop<uint8_t, S>(dst, src, n, [&](S x) { return f32_to_f8e4m3(load(x)); });
    case DType::f8_e5m2:
      return convert_loop<uint8_t, S>(dst, src, n, [&](S x) { return f32_to_f8e5m2(load(x)); });
    default: break;
  }
  fail("[convert] no conversion from ", dtype_name(st), " to ", dtype_name(dt));
}

// f64 source: each target rounds the double directly.
void convert_from_f64(void* dst, DType dt, const void* src, int64_t n) {
  auto b = [](double x) { return F64Src::bits(x); };
  switch (dt) {
    case DType::f32:  // the hardware conversion rounds to nearest even and overflows to inf
      return convert_loop<float, double>(dst, src, n, [](double x) { return static_cast<float>(x); });
    case DType::bf16:
      return convert_loop<uint16_t, double>(
          dst, src, n, [&](double x) { return static_cast<uint16_t>(encode_ieee<8, 7, F64Src>(b(x), false)); });
    case DType::f16:
      return convert_loop<uint16_t, double>(
          dst, src, n, [&](double x) { return static_cast<uint16_t>(encode_ieee<5, 10, F64Src>(b(x), false)); });
    case DType::f8_e4m3:
      return convert_loop<uint8_t, double>(dst, src, n, [&](double x) { return encode_e4m3<F64Src>(b(x), true); });
    case DType::f8_e5m2:
      return convert_loop<uint8_t, double>(
          dst, src, n, [&](double x) { return static_cast<uint8_t>(encode_ieee<5, 2, F64Src>(b(x), false)); });
    default: break;
  }
  fail("[convert] no conversion from f64 to ", dtype_name(dt));
}

bool convertible_float(DType t) {
  switch (t) {
    case DType::f32: case DType::f64: case DType::bf16: case DType::f16: case DType::f8_e4m3: case DType::f8_e5m2:
      return true;
    default: return false;
  }
}

}  // namespace

void convert(void* dst, DType dt, const void* src, DType st, int64_t n) {
  const bool same_int = dt == st && (dt == DType::i32 || dt == DType::i8 || dt == DType::u8);
  if (!same_int && !(convertible_float(dt) && convertible_float(st)))
    fail("[convert] no conversion from ", dtype_name(st), " to ", dtype_name(dt),
         ": convert takes f32, f64, bf16, f16, f8_e4m3, f8_e5m2 (any pair) or i32->i32, i8->i8, u8->u8");
  OOM_CHECK(n >= 0, "[convert] negative element count ", n);
  if (n == 0) return;
  // Same type: a plain copy (keeps NaN payloads); memmove tolerates dst == src.
  if (dt == st) {
    std::memmove(dst, src, static_cast<size_t>(dtype_bytes(dt, n)));
    return;
  }
  if (st == DType::f32 && dt == DType::bf16)
    return f32_to_bf16_n(static_cast<uint16_t*>(dst), static_cast<const float*>(src), n);
  if (st == DType::bf16 && dt == DType::f32)
    return bf16_to_f32_n(static_cast<float*>(dst), static_cast<const uint16_t*>(src), n);
  switch (st) {
    case DType::f32: return convert_from<float>(dst, dt, src, st, n, [](float x) { return x; });
    case DType::f64: return convert_from_f64(dst, dt, src, n);
    case DType::bf16: return convert_from<uint16_t>(dst, dt, src, st, n, [](uint16_t x) { return bf16_to_f32(x); });
    case DType::f16: return convert_from<uint16_t>(dst, dt, src, st, n, [](uint16_t x) { return f16_to_f32(x); });
    case DType::f8_e4m3:
      return convert_from<uint8_t>(dst, dt, src, st, n, [](uint8_t x) { return f8e4m3_to_f32(x); });
    case DType::f8_e5m2:
      return convert_from<uint8_t>(dst, dt, src, st, n, [](uint8_t x) { return f8e5m2_to_f32(x); });
    default: break;
  }
  fail("[convert] no conversion from ", dtype_name(st), " to ", dtype_name(dt));
}

}  // namespace oomless
