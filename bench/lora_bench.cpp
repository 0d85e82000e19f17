// What a LoRA adapter adds to a frozen projection's forward + backward, at the M benchmark
// model's shapes (512 rows: micro-batch 2 x 256 tokens; r 16; 768 -> 768, 768 -> 2048,
// 2048 -> 768), in one run, three ways:
//   base     the frozen dense projection alone: y = x W^T, and dx = g W in backward;
//   memtune  models::lora_linear (its fused autograd node: y, dx, dA, dB);
//   autograd the same math as ATen ops under autograd, as PEFT's Linear runs it
//            (x W^T + scaling * (x A^T) B^T).
// Prints milliseconds per forward + backward (median of the repeats), what the adapter adds
// over the base, the adapter's share of the FLOPs (3 r (in + out) / (2 in out)) and the
// GFLOP/s its products ran at.
//
//   bench_lora_bench [--repeats N] [--rows N] [--shape IN:OUT]...
// --rows and --shape (repeatable) pick other shapes: the S benchmark model's are
// --rows 1024 --shape 256:256 --shape 256:688 --shape 688:256.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "bench/median_ms.h"
#include "models/layers/lora_linear.h"
#include "runtime/threads.h"

using memtune::bench::median_ms;

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);
  std::printf("# %s\n", memtune::configure_threads(0).c_str());
  int repeats = 21;
  int64_t rows = 512;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int i = 1; i + 1 < argc; i += 2) {
    long long in = 0, out = 0;
    if (std::strcmp(argv[i], "--repeats") == 0) {
      repeats = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--rows") == 0) {
      rows = std::atoll(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--shape") == 0 && std::sscanf(argv[i + 1], "%lld:%lld", &in, &out) == 2 &&
               in > 0 && out > 0) {
      shapes.emplace_back(in, out);
    } else {
      std::fprintf(stderr, "bench_lora_bench: unknown or malformed argument '%s %s' (see the file's header)\n",
                   argv[i], argv[i + 1]);
      return 2;
    }
  }
  if (repeats < 1 || rows < 1) {
    std::fprintf(stderr, "bench_lora_bench: --repeats and --rows take a positive number\n");
    return 2;
  }
  if (shapes.empty()) shapes = {{768, 768}, {768, 2048}, {2048, 768}};
  const int64_t r = 16;
  const double scaling = 2.0;
  std::printf("# LoRA r %lld on a frozen fp32 projection, %lld rows, forward + backward, median of %d\n",
              static_cast<long long>(r), static_cast<long long>(rows), repeats);
  std::printf("| in -> out | base ms | memtune ms | adds | autograd ms | adds | adapter FLOPs | memtune adapter GFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  for (auto [in, out] : shapes) {
    at::manual_seed(0);
    const at::Tensor W = at::randn({out, in}) * 0.02;
    const at::Tensor A = (at::randn({r, in}) * 0.02).requires_grad_();
    const at::Tensor B = (at::randn({out, r}) * 0.02).requires_grad_();
    const at::Tensor x = at::randn({rows, in}).requires_grad_();
    const at::Tensor g = at::randn({rows, out});
    memtune::models::FrozenWeight w;
    w.dense = W;

    const double base = median_ms(repeats, [&] {
      at::NoGradGuard no_grad;
      at::Tensor y = at::mm(x, W.t());
      at::Tensor dx = at::mm(g, W);
    });
    const double fused = median_ms(repeats, [&] {
      at::Tensor y = memtune::models::lora_linear(x, at::Tensor(), w, at::Tensor(), A, B, scaling);
      torch::autograd::backward({y}, {g});
      x.mutable_grad() = A.mutable_grad() = B.mutable_grad() = at::Tensor();
    });
    const double peft = median_ms(repeats, [&] {
      at::Tensor y = at::mm(x, W.t()) + scaling * at::mm(at::mm(x, A.t()), B.t());
      torch::autograd::backward({y}, {g});
      x.mutable_grad() = A.mutable_grad() = B.mutable_grad() = at::Tensor();
    });
    const double adapter_flops = 2.0 * 3.0 * static_cast<double>(rows * r * (in + out));
    const double share = static_cast<double>(3 * r * (in + out)) / static_cast<double>(2 * in * out);
    std::printf("| %lld -> %lld | %.3f | %.3f | +%.0f%% | %.3f | +%.0f%% | %.1f%% | %.0f |\n",
                static_cast<long long>(in), static_cast<long long>(out), base, fused, 100 * (fused - base) / base,
                peft, 100 * (peft - base) / base, 100 * share, adapter_flops / std::max(1e-9, fused - base) / 1e6);
  }
  return 0;
}
