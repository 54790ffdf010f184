// What the bench/ binaries share for timing: milliseconds per call of a function over a number of
// calls, and the median of a set of such figures.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace memrt::bench {

inline double ms_per_call(const std::function<void()>& f, int calls) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / calls;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace memrt::bench
