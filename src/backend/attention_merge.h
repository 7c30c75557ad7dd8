// The arithmetic of Ops::attention_merge, shared by the backends (Elem = double for ref, float for cpu).
// Weights are computed in double; each (query, head) row is independent, so any thread count gives the
// same bits.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

namespace oomless::detail {

// o (T, H, D), lse (H, T) rows [row0, row0 + n) merged with o2 (n, H, D), lse2 (H, n).
template <class Elem>
void attention_merge_rows(Elem* o, Elem* lse, const Elem* o2, const Elem* lse2, int64_t T, int64_t n, int64_t row0,
                          int64_t H, int64_t D) {
  const double ninf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = row0 + i;
    for (int64_t h = 0; h < H; ++h) {
      const double a = lse[h * T + t], b = lse2[h * n + i];
      Elem* row = o + (t * H + h) * D;
      const Elem* row2 = o2 + (i * H + h) * D;
      if (b == ninf) continue;  // the second part saw no key: nothing changes
      if (a == ninf) {
        for (int64_t d = 0; d < D; ++d) row[d] = row2[d];
        lse[h * T + t] = static_cast<Elem>(b);
        continue;
      }
      const double m = a > b ? a : b;
      const double wa = std::exp(a - m), wb = std::exp(b - m), s = wa + wb;
      const Elem ca = static_cast<Elem>(wa / s), cb = static_cast<Elem>(wb / s);
      for (int64_t d = 0; d < D; ++d) row[d] = ca * row[d] + cb * row2[d];
      lse[h * T + t] = static_cast<Elem>(m + std::log(s));
    }
  }
}

}  // namespace oomless::detail
