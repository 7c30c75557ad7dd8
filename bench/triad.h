// The memory bound the benchmarks compare bandwidth-bound kernels with: a[i] = b[i] + s c[i] over three 64 MiB
// arrays (STREAM's triad), bytes read and written per second, the median of 5 after a warm-up, on the threads
// OpenMP gives.
#pragma once

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

namespace oomless::bench {

inline double triad_bytes_per_s() {
  auto now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  const int64_t n = int64_t{16} << 20;
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.0f), c(static_cast<size_t>(n), 2.0f);
  std::vector<double> t;
  for (int r = 0; r < 6; ++r) {
    const double t0 = now();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) a[static_cast<size_t>(i)] = b[static_cast<size_t>(i)] + 0.5f * c[static_cast<size_t>(i)];
    if (r > 0) t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return 3.0 * 4.0 * static_cast<double>(n) / t[t.size() / 2];
}

}  // namespace oomless::bench
