// Helpers shared by the `terse bench` commands: pre-touched buffers and medians of timed runs.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace terse::tools {

// A buffer whose pages are touched once before timing, so figures exclude first-touch faults
// (about 10 µs per 4 KiB page on the machines we target; see shared/CLUSTER.md).
template <typename T>
std::vector<T> touched(std::size_t n) {
  std::vector<T> v(n);
  if (n * sizeof(T) >= (2u << 20)) madvise(v.data(), n * sizeof(T), MADV_HUGEPAGE);
  std::memset(static_cast<void*>(v.data()), 0, n * sizeof(T));
  return v;
}

// The median of a sample (the upper middle one for an even count); 0 for an empty sample.
inline double median(std::vector<double> t) {
  if (t.empty()) return 0;
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Runs f once to warm up, then `reps` timed times; returns the median in seconds.
template <typename F>
double median_seconds(int reps, F&& f) {
  std::vector<double> t;
  f();
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(std::move(t));
}

}  // namespace terse::tools
