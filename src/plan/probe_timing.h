// Timing helper used by probe and bench: median of repetitions after a warm-up.
#pragma once
#include <algorithm>
#include <chrono>
#include <vector>

namespace oomless {

template <class F> double median_seconds(int reps, F&& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    fn();
    auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace oomless
