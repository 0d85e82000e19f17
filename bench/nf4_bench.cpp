// NF4 figures, each beside its yardstick measured in the same run (2 intra-op threads):
//  - dequantize throughput (GB/s of fp32 output) vs memcpy bandwidth of the same bytes, and
//    FP4's beside it;
//  - Linear4bit forward+backward(grad_x) vs a dense fp32 Linear, 512 tokens; beside them the
//    LLM.int8 layer (load_in_8bit): its CPU training product (the dequantized weight's) and
//    its mixed int8 product (a CPU's evaluation, a GPU's every product).
// With --cuda (a CUDA build on a GPU): the CUDA kernels' dequantize bandwidth (bytes read and
// written) against the same GPU's device-to-device copy, and quantize, instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <vector>

#include "models/layers/linear4bit.h"
#include "models/layers/linear8bit.h"
#include "runtime/int8.h"
#include "runtime/nf4.h"
#include "runtime/threads.h"

#ifdef MEMTUNE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

// Median seconds of `reps` runs after one warm-up.
double time_median(const std::function<void()>& fn, int reps) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto a = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void bench_dequantize() {
  const int64_t rows = 4096, cols = 11008, n = rows * cols;  // 180 MB of fp32 output
  memtune::NF4Tensor q = memtune::nf4_quantize(at::randn({rows, cols}), 64, true);
  at::Tensor out = at::empty({n}, at::kFloat);
  at::Tensor src = at::randn({n});
  at::Tensor dst = at::empty({n});
  const double bytes = 4.0 * n;
  // memcpy split over the same threads as the dequantize kernel.
  double t_copy = time_median([&] {
    at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
      std::memcpy(dst.data_ptr<float>() + a, src.data_ptr<float>() + a, 4 * (b - a));
    });
  }, 9);
  double t_deq = time_median([&] { memtune::nf4_dequantize_range_into(q, 0, n, out); }, 9);
  at::Tensor out_bf16 = at::empty({n}, at::kBFloat16);
  double t_bf16 = time_median([&] { memtune::nf4_dequantize_range_into(q, 0, n, out_bf16); }, 5);
  std::printf("dequantize %lldx%lld (double quant, blocksize 64), %d threads\n", (long long)rows, (long long)cols,
              at::get_num_threads());
  std::printf("  memcpy                 %7.2f GB/s\n", bytes / t_copy / 1e9);
  std::printf("  nf4 -> fp32            %7.2f GB/s of output  (%.0f %% of memcpy)\n", bytes / t_deq / 1e9,
              100.0 * t_copy / t_deq);
  std::printf("  nf4 -> bf16            %7.2f GB/s of output  (%.2f Gelem/s)\n", bytes / 2 / t_bf16 / 1e9,
              n / t_bf16 / 1e9);
  double t_quant = time_median([&] { memtune::nf4_quantize(src.view({rows, cols}), 64, true); }, 3);
  std::printf("  quantize fp32 -> nf4   %7.2f Gelem/s (%.2f s for this tensor)\n", n / t_quant / 1e9, t_quant);
  // FP4 (bitsandbytes' default code): the same unpacking with another table, and a sign bit
  // plus 7 pivots of |x| where NF4 compares against 15 midpoints.
  const memtune::NF4Tensor q4 = memtune::nf4_quantize(src.view({rows, cols}), 64, true, "", memtune::QuantType::kFP4);
  const double t_deq4 = time_median([&] { memtune::nf4_dequantize_range_into(q4, 0, n, out); }, 9);
  std::printf("  fp4 -> fp32            %7.2f GB/s of output  (%.0f %% of memcpy)\n", bytes / t_deq4 / 1e9,
              100.0 * t_copy / t_deq4);
  const double t_quant4 = time_median(
      [&] { memtune::nf4_quantize(src.view({rows, cols}), 64, true, "", memtune::QuantType::kFP4); }, 3);
  std::printf("  quantize fp32 -> fp4   %7.2f Gelem/s (%.2f s for this tensor)\n", n / t_quant4 / 1e9, t_quant4);
}

void bench_linear(int64_t out, int64_t in, int64_t tokens) {
  using memtune::models::Nf4MatmulPath;
  torch::manual_seed(0);
  at::Tensor w = at::randn({out, in}) * 0.02;
  auto q = std::make_shared<const memtune::NF4Tensor>(memtune::nf4_quantize(w, 64, true));
  at::Tensor x = at::randn({tokens, in}).requires_grad_(true);
  at::Tensor gy = at::randn({tokens, out});
  at::Tensor dense_w = memtune::nf4_dequantize(*q, at::kFloat);  // frozen, like the base weight
  auto dense = [&] {
    x.mutable_grad() = at::Tensor();
    at::linear(x, dense_w).backward(gy);
  };
  auto nf4 = [&](Nf4MatmulPath path) {
    return [&, path] {
      x.mutable_grad() = at::Tensor();
      memtune::models::linear4bit(x, q, at::Tensor(), at::kFloat, path).backward(gy);
    };
  };
  const memtune::Int8Rows rows8 = memtune::int8_quantize_rows(w, "w");
  const memtune::models::Int8Weight w8{rows8.codes, rows8.absmax, 6.0};
  auto int8 = [&](memtune::models::Int8Product product) {
    return [&, product] {
      x.mutable_grad() = at::Tensor();
      memtune::models::linear8bit(x, w8, at::Tensor(), true, at::ScalarType::Undefined, product).backward(gy);
    };
  };
  // Rounds interleave them so that load from other processes on a shared machine falls on
  // all of them alike; medians of wall time and of this process's CPU time.
  std::vector<std::function<void()>> fns = {dense, nf4(Nf4MatmulPath::kDequantizeThenMatmul),
                                            nf4(Nf4MatmulPath::kPanels),
                                            int8(memtune::models::Int8Product::kDequantize),
                                            int8(memtune::models::Int8Product::kMixed)};
  const char* names[] = {"dense fp32 Linear           ", "Linear4bit dequantize+matmul",
                         "Linear4bit panels           ", "LLM.int8 training (panels)  ",
                         "LLM.int8 mixed int8 product "};
  const size_t kinds = fns.size();
  const int rounds = 7;
  std::vector<std::vector<double>> wall(kinds), cpu(kinds);
  for (auto& f : fns) f();  // warm-up
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
  };
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < kinds; ++k) {
      auto a = std::chrono::steady_clock::now();
      double c = cpu_now();
      fns[k]();
      cpu[k].push_back(cpu_now() - c);
      wall[k].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("linear %lld tokens x [%lld -> %lld], forward + backward(grad_x), median of %d rounds\n",
              (long long)tokens, (long long)in, (long long)out, rounds);
  for (size_t k = 0; k < kinds; ++k) {
    std::printf("  %s  wall %8.1f ms (%.2fx dense)   cpu %8.1f ms (%.2fx dense)\n", names[k],
                1e3 * median(wall[k]), median(wall[k]) / median(wall[0]), 1e3 * median(cpu[k]),
                median(cpu[k]) / median(cpu[0]));
  }
}

#ifdef MEMTUNE_CUDA
// Issue 24's yardstick: dequantize at >= 70 % of the device-to-device copy's bandwidth,
// both counted as bytes read plus bytes written. Shapes of Llama-3-8B's projections.
// A call's time is that of 10 calls back to back, then one wait for the device, over 10: a
// launch and a wait per call (several microseconds on the host) would count against a 4096 x
// 4096 dequantize's 15 or so microseconds more than against a copy's 25.
void bench_cuda() {
  const c10::Device cuda(c10::kCUDA, 0);
  auto timed = [](const std::function<void()>& fn, int reps) {
    constexpr int kBackToBack = 10;
    return time_median([&] {
      for (int i = 0; i < kBackToBack; ++i) fn();
      c10::cuda::device_synchronize();
    }, reps) / kBackToBack;
  };
  std::printf("CUDA: NF4 kernels against a device-to-device copy (GB/s = bytes read + written)\n");
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{4096, 4096}, {14336, 4096}}) {
    const int64_t n = rows * cols;
    const at::Tensor w = at::randn({rows, cols}, at::TensorOptions(at::kFloat).device(cuda)).to(at::kBFloat16);
    const memtune::NF4Tensor q = memtune::nf4_quantize(w, 64, true);
    const double state = static_cast<double>(q.storage_bytes());
    at::Tensor src = at::empty({n}, w.options()), dst = at::empty({n}, w.options());
    const double t_copy = timed([&] { dst.copy_(src); }, 21);
    const double copy_gbs = 2.0 * 2 * n / t_copy / 1e9;
    std::printf("  %lldx%lld  copy bf16          %8.1f GB/s\n", (long long)rows, (long long)cols, copy_gbs);
    for (at::ScalarType out : {at::kBFloat16, at::kFloat}) {
      const double t = timed([&] { memtune::nf4_dequantize(q, out); }, 21);
      const double gbs = (state + static_cast<double>(n) * c10::elementSize(out)) / t / 1e9;
      std::printf("  %lldx%lld  nf4 -> %-11s %8.1f GB/s (%.0f %% of copy), %.1f us\n", (long long)rows,
                  (long long)cols, c10::toString(out), gbs, 100.0 * gbs / copy_gbs, 1e6 * t);
    }
    const double t_generic = timed([&] { memtune::nf4_dequantize_generic(q, at::kBFloat16); }, 5);
    std::printf("  %lldx%lld  tensor-op dequantize (before the kernel): %.1f us\n", (long long)rows,
                (long long)cols, 1e6 * t_generic);
    const double t_quant = timed([&] { memtune::nf4_quantize(w, 64, true); }, 5);
    std::printf("  %lldx%lld  quantize bf16 -> nf4 (double quant on the host): %.2f ms\n", (long long)rows,
                (long long)cols, 1e3 * t_quant);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  // The training binary's OpenMP and OpenBLAS wait policies: with spin-waiting the two pools
  // fight over the cores between a dequantize or a kernel and its GEMM (panels of 4096 x 11008:
  // 1.47x a dense Linear spinning, 1.06x passive).
  memtune::reexec_with_passive_omp_wait(argv);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // figures appear as they are measured
  if (argc > 1 && std::strcmp(argv[1], "--cuda") == 0) {
#ifdef MEMTUNE_CUDA
    bench_cuda();
    return 0;
#else
    std::fprintf(stderr, "bench_nf4_bench --cuda: built without CUDA (MEMTUNE_CUDA)\n");
    return 2;
#endif
  }
  at::set_num_threads(2);
  bench_dequantize();
  bench_linear(4096, 4096, 512);
  bench_linear(11008, 4096, 512);
  return 0;
}
