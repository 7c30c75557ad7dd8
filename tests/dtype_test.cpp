// Scalar float conversions and convert(): hand-picked cases per format (ties both ways, the overflow
// boundary, saturation, subnormals, zeros, infinities, NaN), every code of each 8/16-bit format
// decoded against a field formula and round-tripped, and convert() over every supported pair.
// The exhaustive sweep over all 2^32 floats lives in dtype_slowtest.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace oomless {
namespace {

// Value of a code from its fields: (implicit bit + mantissa) * 2^(exponent - bias - M).
// has_inf: an all-ones exponent means inf/NaN; otherwise only the all-ones code is NaN (e4m3fn).
double field_value(uint32_t code, int E, int M, bool has_inf) {
  const int bias = (1 << (E - 1)) - 1;
  const uint32_t exp = (code >> M) & ((1u << E) - 1), man = code & ((1u << M) - 1);
  const bool neg = (code >> (E + M)) & 1;
  double v;
  if (has_inf && exp == (1u << E) - 1) {
    v = man == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (!has_inf && exp == (1u << E) - 1 && man == (1u << M) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else {
    const double sig = exp == 0 ? man : man + std::ldexp(1.0, M);
    v = std::ldexp(sig, (exp == 0 ? 1 : static_cast<int>(exp)) - bias - M);
  }
  return neg ? -v : v;
}

float p2(int e) { return std::ldexp(1.0f, e); }
float up(float x) { return std::nextafter(x, std::numeric_limits<float>::infinity()); }
float down(float x) { return std::nextafter(x, -std::numeric_limits<float>::infinity()); }
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

struct Case {
  float in;
  uint32_t want;
};

template <class Enc>
void expect_cases(const char* what, Enc enc, std::initializer_list<Case> cases) {
  for (const Case& c : cases) {
    uint32_t got = enc(c.in);
    EXPECT_EQ(got, c.want) << what << " of " << c.in << " (bits 0x" << std::hex << f32_bits(c.in) << ")";
  }
}

// ---- bf16 (inline in the header) ----

TEST(Dtype, Bf16Rounding) {
  auto enc = [](float f) -> uint32_t { return f32_to_bf16(f); };
  expect_cases("bf16", enc,
               {
                   {1.0f, 0x3f80},
                   {1.0f + p2(-8), 0x3f80},               // tie, 1.0 is even: down
                   {up(1.0f + p2(-8)), 0x3f81},           // just above the tie: up
                   {1.0f + 3 * p2(-8), 0x3f82},           // tie, 0x3f81 is odd: up
                   {down(1.0f + 3 * p2(-8)), 0x3f81},
                   {-(1.0f + p2(-8)), 0xbf80},
                   {-(1.0f + 3 * p2(-8)), 0xbf82},
                   {bits_f32(0x7f7f7fff), 0x7f7f},        // largest float below the overflow tie
                   {bits_f32(0x7f7f8000), 0x7f80},        // the tie (max mantissa is odd): inf
                   {bits_f32(0x7f7fffff), 0x7f80},        // FLT_MAX
                   {-bits_f32(0x7f7f8000), 0xff80},
                   {p2(-133), 0x0001},                    // smallest subnormal
                   {p2(-134), 0x0000},                    // half of it: tie to even zero
                   {up(p2(-134)), 0x0001},
                   {-p2(-135), 0x8000},                   // below half: signed zero
                   {127.5f * p2(-133), 0x0080},           // rounds out of the subnormal range
                   {126.5f * p2(-133), 0x007e},
                   {bits_f32(0x00000001), 0x0000},        // f32 subnormal
                   {0.0f, 0x0000},
                   {-0.0f, 0x8000},
                   {kInf, 0x7f80},
                   {-kInf, 0xff80},
               });
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_bf16(bits_f32(nan));
    EXPECT_EQ(h & 0x7fc0, 0x7fc0) << std::hex << nan << " -> " << h << " is not a quiet NaN";
    EXPECT_EQ(h >> 15, nan >> 31) << "NaN sign";
  }
}

// ---- f16 ----

TEST(Dtype, F16Rounding) {
  auto enc = [](float f) -> uint32_t { return f32_to_f16(f); };
  expect_cases("f16", enc,
               {
                   {1.0f, 0x3c00},
                   {1.0f + p2(-11), 0x3c00},              // tie to even: down
                   {up(1.0f + p2(-11)), 0x3c01},
                   {1.0f + 3 * p2(-11), 0x3c02},          // tie to even: up
                   {down(1.0f + 3 * p2(-11)), 0x3c01},
                   {-(1.0f + 3 * p2(-11)), 0xbc02},
                   {65504.0f, 0x7bff},                    // max finite
                   {down(65520.0f), 0x7bff},              // largest value that rounds down
                   {65520.0f, 0x7c00},                    // overflow tie rounds to even = inf
                   {1e10f, 0x7c00},
                   {-65520.0f, 0xfc00},
                   {p2(-24), 0x0001},                     // smallest subnormal
                   {p2(-25), 0x0000},                     // half of it: tie to zero
                   {up(p2(-25)), 0x0001},
                   {1.5f * p2(-24), 0x0002},              // subnormal tie: up to even
                   {2.5f * p2(-24), 0x0002},              // subnormal tie: down to even
                   {1023.5f * p2(-24), 0x0400},           // rounds out of the subnormal range
                   {down(1023.5f * p2(-24)), 0x03ff},
                   {p2(-14), 0x0400},                     // smallest normal
                   {-p2(-26), 0x8000},
                   {bits_f32(0x00000001), 0x0000},
                   {0.0f, 0x0000},
                   {-0.0f, 0x8000},
                   {kInf, 0x7c00},
                   {-kInf, 0xfc00},
               });
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    uint16_t h = f32_to_f16(bits_f32(nan));
    EXPECT_EQ(h & 0x7e00, 0x7e00) << std::hex << nan << " -> " << h << " is not a quiet NaN";
  }
}

// ---- f8_e4m3 (fn) ----

TEST(Dtype, E4m3Rounding) {
  for (bool sat : {true, false}) {
    SCOPED_TRACE(sat ? "saturate" : "no saturate");
    const uint32_t ovf = sat ? 0x7e : 0x7f;
    auto enc = [sat](float f) -> uint32_t { return f32_to_f8e4m3(f, sat); };
    expect_cases("e4m3", enc,
                 {
                     {1.0f, 0x38},
                     {1.0f + p2(-4), 0x38},               // tie to even: down
                     {up(1.0f + p2(-4)), 0x39},
                     {1.0f + 3 * p2(-4), 0x3a},           // tie to even: up
                     {-(1.0f + 3 * p2(-4)), 0xba},
                     {448.0f, 0x7e},                      // max finite
                     {460.0f, 0x7e},
                     {464.0f, 0x7e},                      // midpoint 448/480: 448 is even, stays
                     {up(464.0f), ovf},                   // smallest value out of range
                     {480.0f, ovf},
                     {1e30f, ovf},
                     {-up(464.0f), 0x80 | ovf},
                     {kInf, ovf},
                     {-kInf, 0x80 | ovf},
                     {p2(-9), 0x01},                      // smallest subnormal
                     {p2(-10), 0x00},                     // half: tie to zero
                     {up(p2(-10)), 0x01},
                     {1.5f * p2(-9), 0x02},
                     {2.5f * p2(-9), 0x02},
                     {7.5f * p2(-9), 0x08},               // rounds out of subnormals to 2^-6
                     {down(7.5f * p2(-9)), 0x07},
                     {-p2(-11), 0x80},
                     {0.0f, 0x00},
                     {-0.0f, 0x80},
                 });
    EXPECT_EQ(f32_to_f8e4m3(kNan, sat) & 0x7f, 0x7f);
    EXPECT_EQ(f32_to_f8e4m3(-kNan, sat) & 0x7f, 0x7f);
  }
  EXPECT_EQ(f32_to_f8e4m3(1000.0f), 0x7e) << "saturation is the default";
}

// ---- f8_e5m2 ----

TEST(Dtype, E5m2Rounding) {
  for (bool sat : {false, true}) {
    SCOPED_TRACE(sat ? "saturate" : "no saturate");
    const uint32_t ovf = sat ? 0x7b : 0x7c;
    auto enc = [sat](float f) -> uint32_t { return f32_to_f8e5m2(f, sat); };
    expect_cases("e5m2", enc,
                 {
                     {1.0f, 0x3c},
                     {1.0f + p2(-3), 0x3c},               // tie to even: down
                     {up(1.0f + p2(-3)), 0x3d},
                     {1.0f + 3 * p2(-3), 0x3e},           // tie to even: up
                     {-(1.0f + 3 * p2(-3)), 0xbe},
                     {57344.0f, 0x7b},                    // max finite
                     {down(61440.0f), 0x7b},              // largest value that rounds down
                     {61440.0f, ovf},                     // tie rounds to even = overflow
                     {65536.0f, ovf},
                     {-61440.0f, 0x80 | ovf},
                     {kInf, ovf},
                     {-kInf, 0x80 | ovf},
                     {p2(-16), 0x01},                     // smallest subnormal
                     {p2(-17), 0x00},
                     {up(p2(-17)), 0x01},
                     {1.5f * p2(-16), 0x02},
                     {2.5f * p2(-16), 0x02},
                     {3.5f * p2(-16), 0x04},              // rounds out of subnormals to 2^-14
                     {-p2(-18), 0x80},
                     {0.0f, 0x00},
                     {-0.0f, 0x80},
                 });
    for (float nan : {kNan, -kNan}) {
      uint32_t b = f32_to_f8e5m2(nan, sat);
      EXPECT_EQ(b & 0x7e, 0x7e) << "NaN must stay a quiet NaN, got 0x" << std::hex << b;
    }
  }
  EXPECT_EQ(f32_to_f8e5m2(1e6f), 0x7c) << "no saturation by default";
}

// ---- every code: decode matches the field formula, and encoding the decoded value gives it back ----

// Saturating encoders turn infinities into the largest finite code: sat_inf_to is its magnitude
// (0 when the encoder keeps infinities).
template <class Dec, class Enc>
void check_all_codes(const char* name, uint32_t ncodes, int E, int M, bool has_inf, Dec dec, Enc enc,
                     uint32_t sat_inf_to = 0) {
  int bad = 0;
  for (uint32_t c = 0; c < ncodes && bad < 10; ++c) {
    const float f = dec(c);
    const double want = field_value(c, E, M, has_inf);
    if (std::isnan(want)) {
      if (!std::isnan(f)) ++bad, ADD_FAILURE() << name << " code 0x" << std::hex << c << " should decode to NaN";
      continue;
    }
    if (static_cast<double>(f) != want || std::signbit(f) != std::signbit(want))
      ++bad, ADD_FAILURE() << name << " code 0x" << std::hex << c << " decodes to " << f << ", want " << want;
    const uint32_t back = enc(f);
    const uint32_t sign = c & (1u << (E + M));
    const uint32_t want_back = (std::isinf(f) && sat_inf_to != 0) ? (sign | sat_inf_to) : c;
    if (back != want_back) ++bad, ADD_FAILURE() << name << " code 0x" << std::hex << c << " round-trips to 0x" << back;
  }
}

TEST(Dtype, AllCodesRoundTrip) {
  check_all_codes("bf16", 1u << 16, 8, 7, true, [](uint32_t c) { return bf16_to_f32(static_cast<uint16_t>(c)); },
                  [](float f) -> uint32_t { return f32_to_bf16(f); });
  check_all_codes("f16", 1u << 16, 5, 10, true, [](uint32_t c) { return f16_to_f32(static_cast<uint16_t>(c)); },
                  [](float f) -> uint32_t { return f32_to_f16(f); });
  for (bool sat : {true, false}) {
    check_all_codes("e4m3", 256, 4, 3, false, [](uint32_t c) { return f8e4m3_to_f32(static_cast<uint8_t>(c)); },
                    [sat](float f) -> uint32_t { return f32_to_f8e4m3(f, sat); });
    check_all_codes("e5m2", 256, 5, 2, true, [](uint32_t c) { return f8e5m2_to_f32(static_cast<uint8_t>(c)); },
                    [sat](float f) -> uint32_t { return f32_to_f8e5m2(f, sat); }, sat ? 0x7b : 0);
  }
  // The NaN codes: e4m3 has exactly two.
  int e4m3_nans = 0;
  for (uint32_t c = 0; c < 256; ++c) e4m3_nans += std::isnan(f8e4m3_to_f32(static_cast<uint8_t>(c)));
  EXPECT_EQ(e4m3_nans, 2);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)) && std::isnan(f8e4m3_to_f32(0xff)));
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x7b), 57344.0f);
  EXPECT_EQ(f8e5m2_to_f32(0x7c), kInf);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
}

// ---- convert() ----

const DType kFloatTypes[] = {DType::f32, DType::f64, DType::bf16, DType::f16, DType::f8_e4m3, DType::f8_e5m2};

// Stores v (exactly representable in t) as one element of type t.
std::vector<uint8_t> encode_exact(DType t, const std::vector<double>& vals) {
  std::vector<uint8_t> out(static_cast<size_t>(dtype_bytes(t, static_cast<int64_t>(vals.size()))));
  for (size_t i = 0; i < vals.size(); ++i) {
    const float f = static_cast<float>(vals[i]);
    switch (t) {
      case DType::f32: std::memcpy(&out[4 * i], &f, 4); break;
      case DType::f64: std::memcpy(&out[8 * i], &vals[i], 8); break;
      case DType::bf16: { uint16_t h = f32_to_bf16(f); std::memcpy(&out[2 * i], &h, 2); break; }
      case DType::f16: { uint16_t h = f32_to_f16(f); std::memcpy(&out[2 * i], &h, 2); break; }
      case DType::f8_e4m3: out[i] = f32_to_f8e4m3(f); break;
      case DType::f8_e5m2: out[i] = f32_to_f8e5m2(f); break;
      default: ADD_FAILURE() << "not a float type";
    }
  }
  return out;
}

double decode_one(DType t, const uint8_t* p) {
  switch (t) {
    case DType::f32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::f64: { double d; std::memcpy(&d, p, 8); return d; }
    case DType::bf16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); }
    case DType::f16: { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }
    case DType::f8_e4m3: return f8e4m3_to_f32(*p);
    case DType::f8_e5m2: return f8e5m2_to_f32(*p);
    default: ADD_FAILURE() << "not a float type"; return 0;
  }
}

TEST(Dtype, ConvertEveryFloatPair) {
  // Exact in every float type (the last is the e4m3 max and exact in e5m2 too).
  const std::vector<double> vals = {0.0, -0.0, 1.0, -2.0, 0.5, 1.5, -0.125, 3.0, 448.0, -448.0, 0.0078125};
  for (DType st : kFloatTypes) {
    for (DType dt : kFloatTypes) {
      SCOPED_TRACE(std::string(dtype_name(st)) + " -> " + dtype_name(dt));
      const std::vector<uint8_t> src = encode_exact(st, vals);
      std::vector<uint8_t> dst(static_cast<size_t>(dtype_bytes(dt, static_cast<int64_t>(vals.size()))), 0xAB);
      convert(dst.data(), dt, src.data(), st, static_cast<int64_t>(vals.size()));
      for (size_t i = 0; i < vals.size(); ++i) {
        const double got = decode_one(dt, dst.data() + dtype_bytes(dt, static_cast<int64_t>(i)));
        EXPECT_EQ(got, vals[i]) << "element " << i;
        EXPECT_EQ(std::signbit(got), std::signbit(vals[i])) << "element " << i;
      }
      // Specials survive wherever the target can hold them.
      const std::vector<uint8_t> nan = encode_exact(st, {std::nan("")});
      std::vector<uint8_t> out(8);
      convert(out.data(), dt, nan.data(), st, 1);
      EXPECT_TRUE(std::isnan(decode_one(dt, out.data())));
    }
  }
}

// Rounding inside convert: f64 sources are rounded once, straight to the target. Each input lies
// just above a tie of the target, but rounding through f32 first would land exactly on the tie
// and then round to even (down).
TEST(Dtype, ConvertF64RoundsOnce) {
  struct Row {
    DType t;
    double in;
    double want;
  };
  const Row rows[] = {
      {DType::bf16, 1.0 + 0x1p-8 + 0x1p-40, 1.0 + 0x1p-7},
      {DType::f16, 1.0 + 0x1p-11 + 0x1p-40, 1.0 + 0x1p-10},
      {DType::f16, 0x1p-25 + 0x1p-60, 0x1p-24},  // subnormal: f32 would give the tie 2^-25 -> 0
      {DType::f8_e4m3, 1.0 + 0x1p-4 + 0x1p-40, 1.0 + 0x1p-3},
      {DType::f8_e5m2, 1.0 + 0x1p-3 + 0x1p-40, 1.0 + 0x1p-2},
      {DType::f8_e4m3, 464.0 + 0x1p-30, 448.0},  // out of range: saturates by default
      {DType::f8_e4m3, 464.0, 448.0},
      {DType::f8_e5m2, 61440.0 - 0x1p-30, 57344.0},
      {DType::f8_e5m2, 61440.0, HUGE_VAL},       // overflow to inf by default
      {DType::f16, 65520.0 - 0x1p-30, 65504.0},
      {DType::f16, 1e300, HUGE_VAL},
      {DType::bf16, -1e300, -HUGE_VAL},
      {DType::f32, 1e300, HUGE_VAL},
      {DType::f32, 1.0 + 0x1p-24 + 0x1p-40, 1.0 + 0x1p-23},
      {DType::bf16, 1e-300, 0.0},
      {DType::f16, -1e-300, -0.0},
      {DType::f8_e4m3, 0x1p-10 + 0x1p-50, 0x1p-9},
  };
  for (const Row& r : rows) {
    uint8_t out[8] = {};
    convert(out, r.t, &r.in, DType::f64, 1);
    const double got = decode_one(r.t, out);
    EXPECT_EQ(got, r.want) << dtype_name(r.t) << " from f64 " << r.in;
    EXPECT_EQ(std::signbit(got), std::signbit(r.want)) << dtype_name(r.t) << " from f64 " << r.in;
  }
  // And the same through the scalar f32 path, where the input is exactly the tie.
  EXPECT_EQ(f32_to_bf16(1.0f + p2(-8)), 0x3f80);
}

// The long loops (what training uses) agree with the scalar functions, NaN and inf included, and
// stay inside their buffers.
TEST(Dtype, ConvertLongF32Bf16) {
  const int64_t n = 1003;
  std::vector<float> src(n);
  uint32_t s = 12345;
  for (int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    src[i] = bits_f32(s);
  }
  src[5] = kInf, src[6] = -kInf, src[7] = kNan, src[8] = -0.0f, src[9] = bits_f32(0x7f7f8000);
  std::vector<uint16_t> bf(n + 2, 0xDEAD);
  convert(bf.data() + 1, DType::bf16, src.data(), DType::f32, n);
  EXPECT_EQ(bf[0], 0xDEAD);
  EXPECT_EQ(bf[n + 1], 0xDEAD);
  std::vector<float> back(n);
  convert(back.data(), DType::f32, bf.data() + 1, DType::bf16, n);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(bf[i + 1], f32_to_bf16(src[i])) << "element " << i;
    ASSERT_EQ(f32_bits(back[i]), static_cast<uint32_t>(bf[i + 1]) << 16) << "element " << i;
  }
  std::vector<uint16_t> h(n);
  convert(h.data(), DType::f16, src.data(), DType::f32, n);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(h[i], f32_to_f16(src[i])) << "element " << i;
}

TEST(Dtype, ConvertIntegerCopiesAndErrors) {
  const int32_t a[3] = {-7, 0, 2147483647};
  int32_t b[3] = {};
  convert(b, DType::i32, a, DType::i32, 3);
  EXPECT_EQ(b[0], -7);
  EXPECT_EQ(b[2], 2147483647);
  const int8_t c[2] = {-128, 5};
  int8_t d[2] = {};
  convert(d, DType::i8, c, DType::i8, 2);
  EXPECT_EQ(d[0], -128);
  EXPECT_EQ(d[1], 5);
  convert(nullptr, DType::f32, nullptr, DType::bf16, 0);  // nothing to do

  uint8_t buf[16] = {};
  const std::pair<DType, DType> bad[] = {{DType::f32, DType::i32}, {DType::i32, DType::f32}, {DType::nf4, DType::f32},
                                         {DType::f32, DType::nf4}, {DType::i8, DType::i32},  {DType::bf16, DType::i8},
                                         {DType::nf4, DType::nf4}};
  for (auto [dt, st] : bad) {
    EXPECT_THROW(convert(buf, dt, buf, st, 1), Error) << dtype_name(st) << " -> " << dtype_name(dt);
    try {
      convert(buf, dt, buf, st, 1);
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("[convert]", 0), 0u) << msg;
      EXPECT_NE(msg.find(std::string(dtype_name(st)) + " to " + dtype_name(dt)), std::string::npos) << msg;
    }
  }
}

TEST(Dtype, NamesAndParse) {
  for (const char* s : {"f32", "fp32", "float32"}) EXPECT_EQ(parse_dtype(s), DType::f32) << s;
  for (const char* s : {"bf16", "bfloat16"}) EXPECT_EQ(parse_dtype(s), DType::bf16) << s;
  for (const char* s : {"f16", "fp16", "float16"}) EXPECT_EQ(parse_dtype(s), DType::f16) << s;
  EXPECT_THROW(parse_dtype("f33"), Error);
  try {
    parse_dtype("half");
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* s : {"[dtype]", "half", "f32", "bf16", "f16"}) EXPECT_NE(msg.find(s), std::string::npos) << msg;
  }
  EXPECT_STREQ(dtype_name(DType::f8_e4m3), "f8_e4m3");
  EXPECT_STREQ(dtype_name(DType::f8_e5m2), "f8_e5m2");
  EXPECT_EQ(dtype_bytes(DType::nf4, 3), 2);
}

}  // namespace
}  // namespace oomless
