// What the bench/ binaries share: milliseconds per call of a function over a number of calls, the
// median of a set of such figures, and their positional integer arguments.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
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

// argv[i] as an integer, or `fallback` when the command line stops before it.
inline int64_t int_arg(int argc, char** argv, int i, int64_t fallback) {
  return argc > i ? std::atoll(argv[i]) : fallback;
}

}  // namespace memrt::bench
