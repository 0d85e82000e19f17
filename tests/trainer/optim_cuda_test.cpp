// The optimizer step's multi-tensor passes on CUDA (trainer/cuda/optim_cuda.h) against the
// CPU's kernels (trainer/optim_kernels.h, which tests/trainer/optim_kernels_test.cpp holds to
// AdamW's formula, ATen's op chain and the exact sum of squares): after 20 steps the GPU's
// parameters, states and scaled gradients must be the CPU's, every bit, with nothing
// allocated by the update; gradient clipping's sum of squares must be the CPU's to double
// rounding without an fp64 copy of any gradient.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/memory.h"
#include "test_util.h"
#include "trainer/optim_kernels.h"
#include "trainer/optimizer.h"

#ifdef MEMTUNE_CUDA
#include "trainer/cuda/optim_cuda.h"
#endif

namespace {

namespace tr = memtune::trainer;
using Params = std::vector<std::pair<std::string, at::Tensor>>;

// More tensors than one launch takes (optim_cuda::kMaxTensors is 40), of sizes around the
// kernel's 4096-element chunks and one of many chunks, matrices (weight decay) and vectors
// (none): LoRA's A and B of seven projections over several layers, and norms.
Params make_params(const c10::Device& device) {
  at::Generator gen = at::detail::createCPUGenerator(5);
  Params ps;
  const std::vector<std::vector<int64_t>> shapes = {{16, 256}, {4096, 1}, {4097, 1}, {1, 1},
                                                    {3, 5},    {16, 683}, {70001}};
  for (int layer = 0; layer < 13; ++layer)
    for (size_t k = 0; k < shapes.size(); ++k) {
      const bool vector = shapes[k].size() == 1;
      const std::string name = "layers." + std::to_string(layer) +
                               (vector ? ".input_layernorm.weight" : ".self_attn.q_proj.lora_A" + std::to_string(k));
      ps.emplace_back(name, at::randn(shapes[k], gen));
    }
  for (auto& [name, t] : ps) t = t.to(device).requires_grad_(true);
  return ps;
}

// The same gradients wherever the parameters are, their magnitudes spread over six decades.
void set_grads(Params& ps, at::Generator& gen, int step) {
  for (auto& [name, p] : ps) {
    const at::Tensor g = at::randn(p.sizes(), gen) * std::pow(10.0, (step % 6) - 4);
    p.mutable_grad() = g.to(p.device());
  }
}

double lr_of(int step) { return step % 2 ? 1e-3 : 3e-3; }
double scale_of(int step) { return step % 3 ? 1.0 : 0.37; }  // 1: the gradient is read only

TEST(TorchAdamWCuda, ManyTensorsOnTheGpuEqualTheCpuBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  tr::OptimizerOptions o;
  tr::set_optimizer_kind("adamw_torch", o);
  o.weight_decay = 0.1;
  Params cpu = make_params(c10::kCPU), gpu = make_params(cuda);
  tr::Optimizer want(cpu, o), got(gpu, o);
  memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
  at::Generator gen_cpu = at::detail::createCPUGenerator(23), gen_gpu = at::detail::createCPUGenerator(23);
  for (int step = 1; step <= 20; ++step) {
    SCOPED_TRACE(step);
    set_grads(cpu, gen_cpu, step);
    set_grads(gpu, gen_gpu, step);
    want.step(lr_of(step), scale_of(step));
    const int64_t before = memory.stats().allocated;
    memory.reset_peak();
    got.step(lr_of(step), scale_of(step));
    // The states were made with the optimizer; the update allocates nothing (no workspace).
    EXPECT_EQ(memory.stats().peak - before, 0) << "the update allocated on the device";
    for (size_t i = 0; i < cpu.size(); ++i)
      ASSERT_TRUE(at::equal(gpu[i].second.grad().cpu(), cpu[i].second.grad()))
          << cpu[i].first << ": the gradient, scaled in place when the scale is not 1";
  }
  std::map<std::string, at::Tensor> ws, gs;
  for (auto& [k, t] : want.state_tensors()) ws[k] = t;
  for (auto& [k, t] : got.state_tensors()) gs[k] = t;
  ASSERT_EQ(ws.size(), gs.size());
  for (auto& [k, t] : ws) {
    ASSERT_TRUE(gs.count(k)) << k;
    EXPECT_TRUE(gs[k].is_cuda()) << k;
    EXPECT_TRUE(at::equal(gs[k].cpu(), t)) << k << " differs";
  }
  for (size_t i = 0; i < cpu.size(); ++i)
    EXPECT_TRUE(at::equal(gpu[i].second.detach().cpu(), cpu[i].second.detach())) << cpu[i].first << " differs";
  EXPECT_EQ(got.state_bytes(), want.state_bytes()) << "a workspace beside the states";
}

// The kernel on its own: a launch of tensors whose chunks are uneven (empty tensors among
// them) updates each tensor as the CPU's scalar kernel does.
TEST(TorchAdamWCuda, OneLaunchOverUnevenTensorsIsTheScalarKernel_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
#ifdef MEMTUNE_CUDA
  const c10::Device cuda(c10::kCUDA, 0);
  at::Generator gen = at::detail::createCPUGenerator(9);
  const tr::TorchAdamW s{0.5f, 1.0f, 0.9f, 0.1f, 0.999f, 0.001f, 0.03f, 1e-8f, -2e-3f};
  std::vector<at::Tensor> host[4], dev[4];
  std::vector<tr::AdamWCudaTensor> list;
  const std::vector<int64_t> sizes = {0, 1, 4095, 0, 4096, 4097, 12289, 33, 0};
  for (size_t k = 0; k < sizes.size(); ++k) {
    for (int j = 0; j < 4; ++j) {
      at::Tensor t = at::randn({sizes[k]}, gen);
      if (j == 3) t = t.abs();  // v >= 0
      host[j].push_back(t);
      dev[j].push_back(t.to(cuda));
    }
    list.push_back({dev[0][k], dev[1][k], dev[2][k], dev[3][k], k % 2 ? 0.99f : 1.0f});
  }
  tr::torch_adamw_cuda(s, list);
  for (size_t k = 0; k < sizes.size(); ++k) {
    tr::TorchAdamW sk = s;
    sk.decay = list[k].decay;
    tr::torch_adamw_scalar(sk, host[0][k].data_ptr<float>(), host[1][k].data_ptr<float>(),
                           host[2][k].data_ptr<float>(), host[3][k].data_ptr<float>(), sizes[k]);
    for (int j = 0; j < 4; ++j)
      EXPECT_TRUE(at::equal(dev[j][k].cpu(), host[j][k])) << "tensor " << k << " (" << sizes[k] << "), array " << j;
  }
#endif
}

}  // namespace

namespace {

// Gradient clipping's sum of squares over GPU gradients: the CPU's sum to double rounding
// (the two add the same exact squares in different orders), the same bits on a second run,
// and no fp64 copy of a gradient: the device holds one double per 4096 elements of each.
TEST(SquareSumCuda, ManyGradientsOnTheGpuSumAsTheCpu_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  Params cpu = make_params(c10::kCPU), gpu = make_params(cuda);
  at::Generator gen_cpu = at::detail::createCPUGenerator(41), gen_gpu = at::detail::createCPUGenerator(41);
  set_grads(cpu, gen_cpu, 3);
  set_grads(gpu, gen_gpu, 3);
  // A gradient of 10^6 elements: the old path's fp64 copy and square alone were 16 MB.
  at::Tensor big = at::randn({1000, 1000}, gen_cpu);
  cpu.emplace_back("embed_tokens.weight", at::zeros({1000, 1000}).requires_grad_(true));
  cpu.back().second.mutable_grad() = big;
  gpu.emplace_back("embed_tokens.weight", at::zeros({1000, 1000}, cuda).requires_grad_(true));
  gpu.back().second.mutable_grad() = big.to(cuda);
  const double want = tr::grad_square_sum(cpu);
  memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
  const int64_t before = memory.stats().allocated;
  memory.reset_peak();
  const double got = tr::grad_square_sum(gpu);
  const int64_t grew = memory.stats().peak - before;
  int64_t scratch = 0;
  for (auto& [name, p] : gpu) scratch += tr::square_sum_cuda_scratch(p.numel());
  EXPECT_LE(grew, scratch + 64 * 1024) << "more than the partial sums (" << scratch << " bytes)";
  EXPECT_NEAR(got, want, want * 1e-13);
  EXPECT_EQ(tr::grad_square_sum(gpu), got) << "the same gradients summed again";
  // The sum is of the gradients themselves: one element changed moves it by its square's change.
  gpu.back().second.grad().view({-1})[7] = 1000.0f;
  const double moved = tr::grad_square_sum(gpu) - got;
  const double old7 = big.view({-1})[7].item<double>();
  EXPECT_NEAR(moved, 1e6 - old7 * old7, 1e-6);
}

}  // namespace
