// Element types and scalar conversions.
//
// Every float conversion rounds to nearest, ties to even. NaN stays NaN (payload not kept).
// f8_e4m3 is the "fn" variant (no infinities, max finite 448, one NaN code 0x7f/0xff): values beyond
// the range saturate to +-448 by default (the usual choice for FP8 training with scales).
// f8_e5m2 has infinities (max finite 57344): overflow gives +-inf, as IEEE rounding does, unless
// saturate is asked for. f64 exists for the float64 reference backend.
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

namespace oomless {

enum class DType : uint8_t { f32, f64, bf16, f16, f8_e4m3, f8_e5m2, i8, nf4, i32, u8 };

// Storage bits per element (nf4 packs two elements per byte).
constexpr int dtype_bits(DType t) {
  switch (t) {
    case DType::f64: return 64;
    case DType::f32: case DType::i32: return 32;
    case DType::bf16: case DType::f16: return 16;
    case DType::f8_e4m3: case DType::f8_e5m2: case DType::i8: case DType::u8: return 8;
    case DType::nf4: return 4;
  }
  return 0;
}
constexpr bool dtype_is_float(DType t) {
  return t != DType::i8 && t != DType::u8 && t != DType::i32 && t != DType::nf4;
}
// Bytes needed for n elements (nf4 rounds up to whole bytes).
constexpr int64_t dtype_bytes(DType t, int64_t n) { return (n * dtype_bits(t) + 7) / 8; }
const char* dtype_name(DType t);
// Parses "f32", "bf16", "fp32", ... ; throws oomless::Error naming the accepted spellings.
DType parse_dtype(std::string_view s);

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bf16 is the top half of an f32: round the dropped 16 bits to nearest even; keep NaN quiet.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
// f rounded to the nearest bf16 value, as an f32.
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint8_t f32_to_f8e4m3(float f, bool saturate = true);
float f8e4m3_to_f32(uint8_t b);
uint8_t f32_to_f8e5m2(float f, bool saturate = false);
float f8e5m2_to_f32(uint8_t b);

// Element-wise conversion between any two float types (f32, f64, bf16, f16, f8_*), plus i32->i32 and
// i8->i8 copies. Narrowing rounds once, to nearest even (f64 sources are not rounded through f32),
// with the scalar defaults for overflow: f8_e4m3 saturates, f8_e5m2, f16 and bf16 give inf. Same-type
// pairs are byte copies. Throws for pairs without a meaning (e.g. nf4, which needs scales: see the
// quantization ops).
void convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n);

}  // namespace oomless
