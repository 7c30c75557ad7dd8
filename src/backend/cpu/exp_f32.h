// exp(x) in f32, branch-free so that loops over it vectorise (the row loops of cross-entropy and SwiGLU). The
// files that use it are compiled with -ffp-contract=off (CMakeLists.txt): their AVX2 and AVX-512 clones then
// compute the same operations as the baseline build, and every machine gets the same bits.
#pragma once

#include <bit>
#include <cstdint>

namespace oomless {

// exp(x) in f32 to within 1.4 ulp (checked over every float in [-87, 88]). Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for exp(r) and the exponent bits of 2^n. Below -87
// it returns 0 (the true value is under 2^-125, invisible next to a sum >= 1), above 88 inf, NaN for NaN.
// The range tests are integer compares on the bits and masks, not float branches, so that loops over
// it vectorise (float compares may trap, which keeps the compiler from if-converting them).
inline float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const uint32_t ux = std::bit_cast<uint32_t>(x);
  const uint32_t lo = 0u - static_cast<uint32_t>(ux > std::bit_cast<uint32_t>(-87.0f));  // x < -87, -NaN
  const uint32_t hi = 0u - static_cast<uint32_t>(static_cast<int32_t>(ux) > std::bit_cast<int32_t>(88.0f));
  const uint32_t nan = 0u - static_cast<uint32_t>((ux & 0x7fffffffu) > 0x7f800000u);
  const float xs = std::bit_cast<float>(ux & ~(lo | hi));  // out-of-range inputs computed as 0
  const float t = xs * kLog2e + kRound;
  const float n = t - kRound;
  const uint32_t ni = std::bit_cast<uint32_t>(t) - std::bit_cast<uint32_t>(kRound);
  float r = xs - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  uint32_t uy = std::bit_cast<uint32_t>(p * std::bit_cast<float>((ni + 127u) << 23));
  uy = (uy & ~(lo | hi)) | (hi & 0x7f800000u);
  uy = (uy & ~nan) | (nan & 0x7fc00000u);
  return std::bit_cast<float>(uy);
}

}  // namespace oomless
