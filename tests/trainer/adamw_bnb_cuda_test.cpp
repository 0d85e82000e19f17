// bitsandbytes' AdamW kernels on CUDA (trainer/cuda/adamw_bnb_cuda.h) against the CPU
// kernels, which tests/trainer/adamw8bit_test.cpp holds to bitsandbytes' own bytes: after
// 20 steps the GPU's states and parameters must be the CPU's, every bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "test_util.h"
#include "trainer/optimizer.h"

namespace {

namespace tr = memtune::trainer;
using Params = std::vector<std::pair<std::string, at::Tensor>>;

// A matrix on the 8-bit path with a partial last block (70000 = 273 x 256 + 112), one under
// kMin8bitSize (the 32-bit kernel even for adamw_8bit), and a norm weight (no decay).
Params make_params(const c10::Device& device) {
  at::Generator gen = at::detail::createCPUGenerator(11);
  Params ps = {{"layers.0.mlp.up_proj.weight", at::randn({700, 100}, gen)},
               {"layers.0.self_attn.q_proj.lora_A.weight", at::randn({16, 200}, gen)},
               {"layers.0.input_layernorm.weight", at::randn({300}, gen)}};
  for (auto& [name, t] : ps) t = t.to(device).requires_grad_(true);
  return ps;
}

// Runs `steps` updates with the same gradients wherever the parameters are: gradients of
// widely spread magnitudes, and at step 7 an inf in each tensor (its element keeps its value
// and its states go to zero).
std::unique_ptr<tr::Optimizer> run(const tr::OptimizerOptions& o, Params& ps, int steps) {
  auto opt = std::make_unique<tr::Optimizer>(ps, o);
  at::Generator gen = at::detail::createCPUGenerator(23);
  for (int step = 1; step <= steps; ++step) {
    for (auto& [name, p] : ps) {
      at::Tensor g = at::randn(p.sizes(), gen) * std::pow(10.0, (step % 5) - 3);
      if (step == 7) g.view({-1})[3] = std::numeric_limits<float>::infinity();
      p.mutable_grad() = g.to(p.device());
    }
    opt->step(step % 2 ? 1e-3 : 3e-3, step % 3 ? 1.0 : 0.5);
  }
  return opt;
}

TEST(AdamWBnbCuda, TwentyStepsOnTheGpuEqualTheCpuBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  // adamw_8bit with its states on the device; adamw_32bit (bitsandbytes' 32-bit kernel, the
  // unpaged twin of paged_adamw_32bit); paged_adamw_8bit, whose states stay in host memory
  // and whose update streams a GPU parameter through the host.
  for (const std::string optim : {"adamw_8bit", "adamw_32bit", "paged_adamw_8bit"}) {
    SCOPED_TRACE(optim);
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(optim == "adamw_32bit" ? "paged_adamw_32bit" : optim, o);
    if (optim == "adamw_32bit") o.paged = false;
    o.weight_decay = 0.1;
    Params cpu = make_params(c10::kCPU), gpu = make_params(cuda);
    auto want = run(o, cpu, 20);
    auto got = run(o, gpu, 20);
    for (auto& [k, t] : got->state_tensors())
      EXPECT_EQ(t.is_cuda(), !o.paged) << k << ": the states live on the device unless paged";
    std::map<std::string, at::Tensor> ws, gs;
    for (auto& [k, t] : want->state_tensors()) ws[k] = t.cpu();
    for (auto& [k, t] : got->state_tensors()) gs[k] = t.cpu();
    ASSERT_EQ(ws.size(), gs.size());
    for (auto& [k, t] : ws) {
      ASSERT_TRUE(gs.count(k)) << k;
      EXPECT_TRUE(at::equal(gs[k], t)) << k << " differs";
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(gpu[i].second.is_cuda());
      EXPECT_TRUE(at::equal(gpu[i].second.detach().cpu(), cpu[i].second.detach()))
          << cpu[i].first << ": max |diff| "
          << (gpu[i].second.detach().cpu() - cpu[i].second.detach()).abs().max().item<float>();
    }
  }
}

}  // namespace
