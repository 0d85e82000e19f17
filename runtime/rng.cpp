#include "runtime/rng.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

namespace memtune {

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

void seed_cpu_rng(uint64_t seed, int64_t step, int rank) {
  // splitmix64 of the three: neighbouring steps and ranks get unrelated streams.
  uint64_t x = seed ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(rank) << 48);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(x ^ (x >> 31));
}

}  // namespace memtune
