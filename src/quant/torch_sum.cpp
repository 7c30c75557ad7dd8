// torch's CPU float32 summation order (see torch_sum.h). Written as torch writes it: a "value" is a
// vector of W lanes added lane-wise, so the same code serves the vector rows (W lanes) and the scalar
// rows (W = 1).
#include "quant/torch_sum.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "core/error.h"

namespace oomless {
namespace {

constexpr int kMaxLanes = 16;
constexpr int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE

struct Vec {
  std::array<float, kMaxLanes> v{};  // lanes beyond W stay 0 and are never read
  void add(const Vec& o, int w) {
    for (int l = 0; l < w; ++l) v[l] += o.v[l];
  }
};

// c10::utils::CeilLog2 (1 for x <= 2).
int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t r = 0;
  for (uint64_t y = static_cast<uint64_t>(x - 1); y; y >>= 1) ++r;
  return r;
}

// Loads value i of a row of W-lane values: lanes x[i*W .. i*W + W).
Vec load(const float* x, int64_t i, int w) {
  Vec r;
  std::memcpy(r.v.data(), x + i * w, sizeof(float) * static_cast<size_t>(w));
  return r;
}

// multi_row_sum with nrows = 4: `size` rows of 4 values, value (i, k) = load(x, 4 i + k).
std::array<Vec, 4> multi_row_sum(const float* x, int64_t size, int w) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Vec acc[kLevels][4];
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k].add(load(x, 4 * i + k, w), w);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k].add(acc[j - 1][k], w);
        acc[j - 1][k] = Vec{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k].add(load(x, 4 * i + k, w), w);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k].add(acc[j][k], w);
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

// row_sum: `size` values of W lanes with ilp_factor 4.
Vec row_sum(const float* x, int64_t size, int w) {
  const int64_t size_ilp = size / 4;
  std::array<Vec, 4> partial = multi_row_sum(x, size_ilp, w);
  for (int64_t i = size_ilp * 4; i < size; ++i) partial[0].add(load(x, i, w), w);
  for (int k = 1; k < 4; ++k) partial[0].add(partial[k], w);
  return partial[0];
}

// cascade_sum of one contiguous row (vectorized_inner_sum, or scalar_inner_sum below W elements).
float cascade_sum(const float* x, int64_t n, int lanes) {
  if (n < lanes) return row_sum(x, n, 1).v[0];
  const int64_t n_vec = n / lanes;
  const Vec vacc = row_sum(x, n_vec, lanes);
  float acc = 0.0f;
  for (int64_t k = n_vec * lanes; k < n; ++k) acc += x[k];
  for (int l = 0; l < lanes; ++l) acc += vacc.v[l];
  return acc;
}

}  // namespace

float torch_sum_f32(const float* x, int64_t n, int threads, int lanes) {
  OOM_CHECK(lanes >= 1 && lanes <= kMaxLanes, "[torch_sum] lanes must be 1..", kMaxLanes, ", got ", lanes);
  OOM_CHECK(threads >= 1 && threads <= 4096, "[torch_sum] threads must be 1..4096, got ", threads);
  OOM_CHECK(n >= 0, "[torch_sum] negative length ", n);
  if (n < kGrain || threads == 1) return 0.0f + cascade_sum(x, n, lanes);
  // two_pass_reduction: parallel_for's split (chunks of ceil(n / used) for the first `used` threads).
  const int64_t used = std::min<int64_t>(threads, (n + kGrain - 1) / kGrain);
  const int64_t chunk = (n + used - 1) / used;
  float buf[4096] = {};
  for (int64_t t = 0; t < used; ++t) {
    const int64_t begin = t * chunk;
    if (begin < n) buf[t] = 0.0f + cascade_sum(x + begin, std::min(n, begin + chunk) - begin, lanes);
  }
  return 0.0f + cascade_sum(buf, threads, lanes);
}

float torch_mean_f32(const float* x, int64_t n, int threads, int lanes) {
  const float s = torch_sum_f32(x, n, threads, lanes);
  return s / static_cast<float>(n);
}

}  // namespace oomless
