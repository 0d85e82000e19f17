#pragma once
// The benchmarks' timer: a function's median wall time over `repeats` runs, after one
// warm-up run, in milliseconds.
#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace memtune::bench {

inline double median_ms(int repeats, const std::function<void()>& fn) {
  fn();  // warm-up
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace memtune::bench
