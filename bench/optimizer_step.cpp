// One optimizer step's time per option over fp32 parameters (4 tensors of 1M elements),
// median of 20 steps after 3 warm-up steps: torch AdamW (fused CPU kernel) as the yardstick.
//   build/bench/bench_optimizer_step [elements per tensor]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>

#include "trainer/optimizer.h"

namespace tr = memtune::trainer;

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : (1 << 20);
  double base = 0;
  for (const char* optim : {"adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "sgd"}) {
    std::vector<std::pair<std::string, at::Tensor>> params;
    for (int i = 0; i < 4; ++i) {
      at::Tensor p = at::randn({n / 1024, 1024}) * 0.02;
      p.mutable_grad() = at::randn({n / 1024, 1024}) * 1e-3;
      params.emplace_back("layer" + std::to_string(i) + ".weight", p);
    }
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(optim, o);
    o.weight_decay = 0.01;
    tr::Optimizer opt(params, o);
    std::vector<double> ms;
    for (int s = 0; s < 23; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      opt.step(1e-3);
      auto t1 = std::chrono::steady_clock::now();
      if (s >= 3) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    if (base == 0) base = med;
    std::printf("%-18s %8.2f ms per step (%lld parameters)  %.2fx adamw_torch's time, state %.3f B/param\n", optim, med,
                static_cast<long long>(4 * n), med / base, static_cast<double>(opt.state_bytes()) / (4.0 * n));
  }
  return 0;
}
