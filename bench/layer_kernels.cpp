// memtune's fused layer nodes (RMSNorm, SwiGLU, rotary: one autograd node each, and on
// CUDA one kernel each way; a LoRA projection; the chunked head + loss) against the same
// math written as Hugging Face's modules (and PEFT) write it, ATen ops under autograd, in
// one run on one device: median milliseconds of forward + backward and the ratio.
//   bench_layer_kernels           the CPU, fp32, a Llama-3.2-1B-shaped layer at 512 tokens
//   bench_layer_kernels --cuda    cuda:0, bf16, a Llama-3-8B-shaped layer at 4096 tokens
// The loss line compares the chunked head + loss with ATen's linear + cross_entropy over
// the whole logits (the memory the chunking saves is its point; the time is here); on CUDA
// two more lines set its bf16 kernel against the fp32 route it replaced, and its default
// chunk against 1024 rows (the left column the first named).
#include <ATen/ATen.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>

#include "bench/median_ms.h"
#include "models/layers/cross_entropy.h"
#include "models/layers/lora_linear.h"
#include "models/layers/norm_act.h"
#include "models/layers/rotary.h"
#include "runtime/threads.h"

#ifdef MEMTUNE_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace {

namespace mm = memtune::models;

struct Shape {
  int64_t tokens, hidden, intermediate, heads, head_dim, vocab;
};

at::Tensor hf_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

at::Tensor hf_rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.slice(-1, h), x.slice(-1, 0, h)}, -1);
}

void row(const char* what, double ours, double theirs) {
  std::printf("  %-34s %9.3f ms %9.3f ms   %5.2fx\n", what, ours, theirs, theirs / ours);
}

void run(const c10::Device& device, at::ScalarType dtype, const Shape& s, int repeats) {
  const bool cuda = device.is_cuda();
  auto sync = [cuda] {
#ifdef MEMTUNE_CUDA
    if (cuda) c10::cuda::device_synchronize();
#else
    (void)cuda;
#endif
  };
  // Forward and backward of f on fresh leaves, the gradient of ones-like weights.
  auto timed = [&](const std::function<at::Tensor()>& f) {
    return memtune::bench::median_ms(repeats, [&] {
      at::Tensor y = f();
      y.backward(at::ones_like(y));
      sync();
    });
  };
  const auto opt = at::TensorOptions(dtype).device(device);
  std::printf("%s, %s: %lld tokens, hidden %lld, intermediate %lld, %lld heads of %lld, vocab %lld\n",
              device.str().c_str(), c10::toString(dtype), (long long)s.tokens, (long long)s.hidden,
              (long long)s.intermediate, (long long)s.heads, (long long)s.head_dim, (long long)s.vocab);
  std::printf("  %-34s %12s %12s %8s\n", "forward + backward", "memtune", "ATen ops", "ratio");

  const at::Tensor x = at::randn({s.tokens, s.hidden}, opt).requires_grad_(true);
  const at::Tensor w = (at::rand({s.hidden}, opt) + 0.5).requires_grad_(true);
  row("RMSNorm (weight trained)", timed([&] { return mm::rms_norm(x, w, 1e-5); }),
      timed([&] { return hf_rms_norm(x, w, 1e-5); }));

  const at::Tensor gate = at::randn({s.tokens, s.intermediate}, opt).requires_grad_(true);
  const at::Tensor up = at::randn({s.tokens, s.intermediate}, opt).requires_grad_(true);
  row("SwiGLU", timed([&] { return mm::swiglu(gate, up); }), timed([&] { return at::silu(gate) * up; }));

  const at::Tensor q = at::randn({1, s.tokens, s.heads, s.head_dim}, opt).requires_grad_(true);
  const at::Tensor cos = at::randn({1, s.tokens, 1, s.head_dim}, opt.dtype(at::kFloat));
  const at::Tensor sin = at::randn({1, s.tokens, 1, s.head_dim}, opt.dtype(at::kFloat));
  row("rotary (q)", timed([&] { return mm::apply_rotary(q, cos, sin); }), timed([&] {
        const at::Tensor c = cos.to(dtype), sn = sin.to(dtype);
        return q * c + hf_rotate_half(q) * sn;
      }));

  // A LoRA adapter (r 16, fp32 A and B) on a frozen up_proj: the fused node, under the
  // Trainer's autocast on a 16-bit device, against PEFT's forward written as ATen ops
  // (autocast's casts written out: the products on 16-bit copies of A and B).
  const at::Tensor W = at::randn({s.intermediate, s.hidden}, opt).div_(64);
  const at::Tensor A = (at::randn({16, s.hidden}, opt.dtype(at::kFloat)) / 64).requires_grad_(true);
  const at::Tensor B = (at::randn({s.intermediate, 16}, opt.dtype(at::kFloat)) / 4).requires_grad_(true);
  const bool autocast = dtype != at::kFloat;
  row("LoRA up_proj (r 16, frozen W)", timed([&] {
        return mm::lora_linear(x, {}, mm::FrozenWeight{W, nullptr}, {}, A, B, 2.0, mm::Nf4MatmulPath::kAuto, autocast);
      }),
      timed([&] {
        return at::linear(x, W) + at::linear(at::linear(x, A.to(dtype)), B.to(dtype)) * 2.0;
      }));

  // The head in the activations' dtype; its products in the run's compute dtype (bf16 on the
  // GPU: models::loss_matmul_dtype), the softmax in fp32, as a model runs them.
  const at::Tensor h = at::randn({s.tokens, s.hidden}, opt).div_(8).requires_grad_(true);
  const at::Tensor head = at::randn({s.vocab, s.hidden}, opt).div_(8);
  const at::Tensor targets = at::randint(s.vocab, {s.tokens}, opt.dtype(at::kLong));
  row("head + loss (frozen head)",
      timed([&] {
        return mm::linear_cross_entropy_sum(h, head, targets, mm::loss_chunk_rows(s.vocab), nullptr, dtype);
      }),
      timed([&] {
        const at::Tensor logits = at::matmul(h, head.t()).to(at::kFloat);
        return at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100);
      }));
  if (!cuda || dtype != at::kBFloat16) return;
  // On CUDA in bf16: the one-pass kernel over bf16 logits against the route it replaced (an
  // fp32 copy of each chunk's logits, the fp32 softmax pass, ATen's scaling and rounding),
  // and chunks of 1024 rows against the default (fewer, larger products; 4x the logits).
  const auto loss_with = [&](int64_t chunk) {
    return timed([&] { return mm::linear_cross_entropy_sum(h, head, targets, chunk, nullptr, dtype); });
  };
  const int64_t chunk = mm::loss_chunk_rows(s.vocab);
  const double fused = loss_with(chunk);
  mm::detail::use_fused_bf16_softmax(false);
  const double fp32_route = loss_with(chunk);
  mm::detail::use_fused_bf16_softmax(true);
  row("  loss: bf16 kernel vs fp32 route", fused, fp32_route);
  const std::string wide = "  loss: 1024-row vs " + std::to_string(chunk) + "-row chunks";
  row(wide.c_str(), loss_with(1024), fused);
}

}  // namespace

int main(int argc, char** argv) {
  memtune::reexec_with_passive_omp_wait(argv);  // as the training binary runs
  if (argc > 1 && std::strcmp(argv[1], "--cuda") == 0) {
#ifdef MEMTUNE_CUDA
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr, "bench_layer_kernels --cuda: no CUDA device\n");
      return 1;
    }
    run(c10::Device(c10::kCUDA, 0), at::kBFloat16, {4096, 4096, 14336, 32, 128, 128256}, 20);
    return 0;
#else
    std::fprintf(stderr, "bench_layer_kernels --cuda: built without CUDA (MEMTUNE_CUDA)\n");
    return 1;
#endif
  }
  at::set_num_threads(2);
  run(c10::kCPU, at::kFloat, {512, 2048, 8192, 32, 64, 128256}, 5);
  return 0;
}
