// Random GGUF blocks for the quantised-product tests: random codes, with sane f16 scales (and Q4_1's min):
// |d| in [2^-10, 2^-5).
#pragma once
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "io/gguf.h"

namespace oomless::test {

inline std::vector<uint8_t> random_blocks(GgmlType t, int64_t rows, int64_t cols, uint64_t seed) {
  const GgmlTypeInfo* ti = ggml_type_info(static_cast<uint32_t>(t));
  const int64_t nb = cols / ti->block_size;
  std::vector<uint8_t> b(static_cast<size_t>(rows * nb * ti->type_size));
  std::mt19937_64 rng(seed);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  for (int64_t i = 0; i < rows * nb; ++i) {
    uint8_t* blk = b.data() + i * ti->type_size;
    for (int h = 0; h < (t == GgmlType::Q4_1 ? 2 : 1); ++h) {
      const uint16_t f16 = static_cast<uint16_t>(((rng() & 1) << 15) | ((5 + rng() % 5) << 10) | (rng() & 0x3FF));
      std::memcpy(blk + 2 * h, &f16, 2);
    }
  }
  return b;
}

}  // namespace oomless::test
