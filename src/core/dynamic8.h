// bitsandbytes' 8-bit dynamic quantisation maps and its CPU blockwise quantiser, shared by NF4's double
// quantisation (the signed map on the block scales) and AdamW8bit's state (m with the signed map, v with
// the unsigned one).
//
// A map is 256 sorted float32 values in [-1, 1] (signed: create_dynamic_map(signed=True), entry 127 is 0;
// unsigned: create_dynamic_map(signed=False), values in [0, 1], entry 0 is 0), taken as bitsandbytes 0.50.2
// stores them (tests/golden/optim holds its tables). The quantiser is the one bitsandbytes' CPU library runs
// (quantize_cpu_impl): for a block of values
//   b = max |x| with NaN ignored (0 when none); b == 0 gives every code 0;
//   else c = clamp(x * (1 / b), -1, 1), j = (int32) fmaf((1 + c) * 0.5f, 65535, 0.5f) (NaN: j = 0) and
//   code = L[j], L[j] = number of midpoints (d_k + d_{k+1}) * 0.5f below the grid point (2j) / 65535.0f - 1:
// a 65536-point grid over [-1, 1], so the code is the one nearest the grid point, not nearest c itself.
// A value decodes as map[code] * b (one float32 product).
#pragma once
#include <cstdint>

namespace oomless::dyn8 {

extern const float kSigned[256];
extern const float kUnsigned[256];

class Map {
 public:
  explicit Map(const float* values);
  const float* values() const { return values_; }
  // The 65536-entry lookup, followed by 3 readable bytes (so a 32-bit gather may read at any index).
  const uint8_t* lut() const { return lut_; }
  uint8_t code(float c) const {  // c = x / b, already scaled
    const float h = (1.0f + clamp1(c)) * 0.5f;
    const float t = __builtin_fmaf(h, 65535.0f, 0.5f);
    const int j = t != t ? 0 : (static_cast<int>(t) & 0xFFFF);
    return lut_[j];
  }

 private:
  static float clamp1(float v) { return v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v); }
  const float* values_;
  uint8_t lut_[65536];
  uint8_t pad_[4] = {0, 0, 0, 0};
};

const Map& signed_map();
const Map& unsigned_map();

// One block of n values (x may be unaligned): writes codes (n) and returns the block's scale b.
float encode_block(const Map& map, const float* x, int64_t n, uint8_t* codes);

}  // namespace oomless::dyn8
