// Causal attention forward + backward at the benchmark models' shapes, the fused CPU kernel
// (models/layers/attention_cpu.h) against the blocked ATen implementation and the textbook
// one (scores, mask, softmax, weighted sum with autograd), in one run. Prints a table:
// milliseconds per forward + backward (median of the repeats) and GFLOP/s counting the
// causal half of the products (5 matrix products of T*T/2*D multiply-adds: 2 forward, 3
// backward; the fused kernel does a sixth, the recomputed scores, not counted). "capped": the
// fused kernel with Gemma 2's soft-capping of the scores (50 tanh(s / 50)), at the same count.
//
//   bench_attention_bench [--repeats N]
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "bench/median_ms.h"
#include "models/layers/attention.h"
#include "runtime/threads.h"

namespace {

using memtune::bench::median_ms;
using memtune::models::AttentionOptions;
using memtune::models::causal_segment_attention;

at::Tensor textbook(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t T = q.size(3);
  at::Tensor s = at::matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale;
  at::Tensor mask = at::ones({T, T}, at::kBool).triu(1);
  s = s.masked_fill(mask, -std::numeric_limits<float>::infinity());
  return at::matmul(at::softmax(s, -1), v.unsqueeze(2));
}

}  // namespace

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  memtune::configure_threads(0);
  int repeats = 9;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::atoi(argv[i + 1]);

  struct Shape {
    const char* name;
    int64_t B, H, T, D;
  };
  const Shape shapes[] = {{"S", 4, 4, 256, 64}, {"M", 2, 12, 256, 64}, {"long", 1, 4, 2048, 64}};
  std::printf("%-5s %4s %3s %5s %3s | %10s %8s | %10s %8s | %10s %8s | %10s %8s\n", "shape", "B", "H", "T", "D",
              "fused ms", "GFLOP/s", "capped ms", "GFLOP/s", "blocked ms", "GFLOP/s", "textbook", "GFLOP/s");
  for (const Shape& s : shapes) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.D));
    at::Tensor q = at::randn({s.B, s.H, 1, s.T, s.D}).requires_grad_(true);
    at::Tensor k = at::randn({s.B, s.H, s.T, s.D}).requires_grad_(true);
    at::Tensor v = at::randn({s.B, s.H, s.T, s.D}).requires_grad_(true);
    at::Tensor seg = at::zeros({s.B, s.T}, at::kLong);
    at::Tensor g = at::randn({s.B, s.H, 1, s.T, s.D});
    auto run = [&](const std::function<at::Tensor()>& f) {
      return median_ms(repeats, [&] { torch::autograd::grad({f()}, {q, k, v}, {g}); });
    };
    AttentionOptions blocked;
    blocked.kernel = AttentionOptions::Kernel::kEager;
    AttentionOptions softcapped;
    softcapped.softcap = 50.0;
    const double fused = run([&] { return causal_segment_attention(q, k, v, seg, scale); });
    const double capped = run([&] { return causal_segment_attention(q, k, v, seg, scale, 0, softcapped); });
    const double block = run([&] { return causal_segment_attention(q, k, v, seg, scale, 0, blocked); });
    const double naive = s.T <= 512 ? run([&] { return textbook(q, k, v, scale); }) : 0.0;
    const double gflop = 5.0 * 2.0 * s.B * s.H * (s.T * s.T / 2.0) * s.D / 1e9;
    std::printf("%-5s %4lld %3lld %5lld %3lld | %10.2f %8.1f | %10.2f %8.1f | %10.2f %8.1f | %10.2f %8.1f\n",
                s.name, static_cast<long long>(s.B), static_cast<long long>(s.H), static_cast<long long>(s.T),
                static_cast<long long>(s.D), fused, gflop / fused * 1e3, capped, gflop / capped * 1e3, block,
                gflop / block * 1e3, naive,
                naive > 0 ? gflop / naive * 1e3 : 0.0);
  }
  return 0;
}
