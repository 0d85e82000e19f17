// One optimizer step's time per option over fp32 parameters (4 tensors of 1M elements),
// median of 20 steps after 3 warm-up steps, relative to memtune's adamw_torch; then two
// yardsticks on the same tensors: torch.optim.AdamW's single-tensor step as PyTorch runs it on
// the CPU (its ATen ops, one tensor at a time), and the pass gradient clipping adds to a step
// (trainer::grad_norm).
//   build/bench/bench_optimizer_step [elements per tensor]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <ATen/ATen.h>

#include "runtime/threads.h"
#include "trainer/optimizer.h"

namespace tr = memtune::trainer;

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);  // as the training binary runs
  char* end = nullptr;
  const int64_t n = argc > 1 ? std::strtoll(argv[1], &end, 10) : (1 << 20);
  if (argc > 2 || (argc > 1 && *end != '\0') || n <= 0 || n % 1024 != 0) {
    std::fprintf(stderr, "usage: bench_optimizer_step [elements per tensor: a positive multiple of 1024, default %d]\n",
                 1 << 20);
    return 2;
  }
  // The training binary's intra-op threads (from the CPU affinity): left to LibTorch 1.13's
  // own default, this VM's parallel regions ran on one thread of two.
  std::printf("%s\n", memtune::configure_threads(0).c_str());
  double base = 0;
  auto median_ms = [](auto&& step) {
    std::vector<double> ms;
    for (int s = 0; s < 23; ++s) {
      auto t0 = std::chrono::steady_clock::now();
      step();
      auto t1 = std::chrono::steady_clock::now();
      if (s >= 3) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  std::vector<std::pair<std::string, at::Tensor>> params;
  for (const char* optim : {"adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor", "sgd"}) {
    params.clear();
    for (int i = 0; i < 4; ++i) {
      at::Tensor p = at::randn({n / 1024, 1024}) * 0.02;
      p.mutable_grad() = at::randn({n / 1024, 1024}) * 1e-3;
      params.emplace_back("layer" + std::to_string(i) + ".weight", p);
    }
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(optim, o);
    o.weight_decay = 0.01;
    tr::Optimizer opt(params, o);
    const double med = median_ms([&] { opt.step(1e-3); });
    if (base == 0) base = med;
    std::printf("%-18s %8.2f ms per step (%lld parameters)  %.2fx adamw_torch's time, state %.3f B/param\n", optim, med,
                static_cast<long long>(4 * n), med / base, static_cast<double>(opt.state_bytes()) / (4.0 * n));
  }
  // torch.optim.AdamW (foreach off, as on the CPU): lr 1e-3, weight decay 0.01, step 1's corrections.
  std::vector<at::Tensor> m, v;
  for (auto& [name, p] : params) m.push_back(at::zeros_like(p)), v.push_back(at::zeros_like(p));
  const double lr = 1e-3, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  const double aten = median_ms([&] {
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor p = params[i].second;
      const at::Tensor& g = p.grad();
      p.mul_(1 - lr * wd);
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      at::Tensor denom = (v[i].sqrt() / std::sqrt(1 - b2)).add_(eps);
      p.addcdiv_(m[i], denom, -lr / (1 - b1));
    }
  });
  std::printf("%-18s %8.2f ms per step  %.2fx adamw_torch's time (torch.optim.AdamW's ATen ops)\n", "torch AdamW", aten,
              aten / base);
  const double norm = median_ms([&] { tr::grad_norm(params); });
  std::printf("%-18s %8.2f ms per step  %.2fx adamw_torch's time (clipping's sum of squares)\n", "grad_norm", norm,
              norm / base);
  return 0;
}
