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

#include "runtime/memory.h"
#include "test_util.h"
#include "trainer/optimizer.h"

#ifdef MEMTUNE_CUDA
#include "trainer/bnb_scalars.h"
#include "trainer/cuda/adamw_bnb_cuda.h"
#endif

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

// The same gradients wherever the parameters are: widely spread magnitudes, and at step 7 an
// inf in each tensor (bitsandbytes' 32-bit kernel has no guard: that element's states become
// inf and the parameter NaN, on both devices).
void set_grads(Params& ps, at::Generator& gen, int step) {
  for (auto& [name, p] : ps) {
    at::Tensor g = at::randn(p.sizes(), gen) * std::pow(10.0, (step % 5) - 3);
    if (step == 7) g.view({-1})[3] = std::numeric_limits<float>::infinity();
    p.mutable_grad() = g.to(p.device());
  }
}

double lr_of(int step) { return step % 2 ? 1e-3 : 3e-3; }
double scale_of(int step) { return step % 3 ? 1.0 : 0.5; }

std::unique_ptr<tr::Optimizer> run(const tr::OptimizerOptions& o, Params& ps, int steps) {
  auto opt = std::make_unique<tr::Optimizer>(ps, o);
  at::Generator gen = at::detail::createCPUGenerator(23);
  for (int step = 1; step <= steps; ++step) {
    set_grads(ps, gen, step);
    opt->step(lr_of(step), scale_of(step));
  }
  return opt;
}

void expect_equal_runs(tr::Optimizer& want, const Params& cpu, tr::Optimizer& got, const Params& gpu) {
  std::map<std::string, at::Tensor> ws, gs;
  for (auto& [k, t] : want.state_tensors()) ws[k] = t.cpu();
  for (auto& [k, t] : got.state_tensors()) gs[k] = t.cpu();
  ASSERT_EQ(ws.size(), gs.size());
  for (auto& [k, t] : ws) {
    ASSERT_TRUE(gs.count(k)) << k;
    EXPECT_TRUE(at::equal(gs[k], t)) << k << " differs";
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(gpu[i].second.is_cuda());
    // Equal values, and NaN exactly where the other side has NaN (whose bits the two
    // devices spell differently).
    const at::Tensor g = gpu[i].second.detach().cpu(), c = cpu[i].second.detach();
    const at::Tensor same = (g == c).logical_or(g.isnan().logical_and(c.isnan()));
    EXPECT_TRUE(same.all().item<bool>())
        << cpu[i].first << ": " << same.logical_not().sum().item<int64_t>() << " elements differ, NaN on the GPU "
        << g.isnan().sum().item<int64_t>() << ", on the CPU " << c.isnan().sum().item<int64_t>();
  }
}

TEST(AdamWBnbCuda, TwentyStepsOnTheGpuEqualTheCpuBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  // adamw_8bit with its states on the device; adamw_32bit (bitsandbytes' 32-bit kernel, the
  // unpaged twin of paged_adamw_32bit); the paged kinds, whose states stay in host memory
  // and pass through the device per tensor (trainer::PagedStates).
  for (const std::string optim : {"adamw_8bit", "adamw_32bit", "paged_adamw_8bit", "paged_adamw_32bit"}) {
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
    expect_equal_runs(*want, cpu, *got, gpu);
  }
}

// Paged states on the device: two slots of the largest tensor's states, allocated in the
// first step and reused after (nothing more is allocated), far less than the states of six
// tensors; the host states pinned (the copies run asynchronously); the parameters and states
// after 9 steps the CPU's to the bit, which they would not be if a slot were refilled before
// its kernel had read it or copied back before it was written.
TEST(AdamWBnbCuda, PagedStatesPassThroughTwoDeviceSlots_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  auto many = [](const c10::Device& device) {
    at::Generator gen = at::detail::createCPUGenerator(31);
    Params ps;
    for (int i = 0; i < 6; ++i)
      ps.emplace_back("layers." + std::to_string(i) + ".mlp.up_proj.weight", at::randn({700, 100 - 7 * i}, gen));
    for (auto& [name, t] : ps) t = t.to(device).requires_grad_(true);
    return ps;
  };
  for (const std::string optim : {"paged_adamw_8bit", "paged_adamw_32bit"}) {
    SCOPED_TRACE(optim);
    tr::OptimizerOptions o;
    tr::set_optimizer_kind(optim, o);
    o.weight_decay = 0.1;
    Params cpu = many(c10::kCPU), gpu = many(cuda);
    auto want = run(o, cpu, 9);
    auto got = std::make_unique<tr::Optimizer>(gpu, o);
    int64_t states = 0;
    for (auto& [k, t] : got->state_tensors()) {
      EXPECT_TRUE(t.is_pinned()) << k;
      states += t.numel() * static_cast<int64_t>(t.element_size());
    }
    // The largest tensor (70000 elements): 8-bit: two 70000-byte code arrays and two 274-block
    // fp32 absmax arrays, each at a 256-byte boundary; 32-bit: two fp32 arrays.
    const int64_t slot = optim == "paged_adamw_8bit" ? 2 * 70144 + 2 * 1280 : 2 * 280064;
    memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
    at::Generator gen = at::detail::createCPUGenerator(23);
    for (int step = 1; step <= 9; ++step) {
      set_grads(gpu, gen, step);
      const int64_t before = memory.stats().allocated;
      memory.reset_peak();
      got->step(lr_of(step), scale_of(step));
      const int64_t grew = memory.stats().peak - before;
      if (step == 1) {
        EXPECT_GE(grew, 2 * slot) << "the two slots";
        EXPECT_LE(grew, 2 * slot + 4 * 1024 * 1024) << "more than the two slots";
        EXPECT_LT(grew, states / 2) << "the states are on the device";
      } else {
        EXPECT_EQ(grew, 0) << "step " << step << " allocated on the device";
      }
    }
    expect_equal_runs(*want, cpu, *got, gpu);
  }
}

// A tensor larger than a slot passes through in runs of whole blocks: 70000 elements through
// slots of 8 KiB (runs of 13 blocks of 8-bit states, 3 of 32-bit ones: dozens of runs, the
// last one partial, the two slots alternating) for three steps equal bitsandbytes' kernels
// run on the whole tensor with its states on the device, every bit.
TEST(AdamWBnbCuda, PagedRunsThroughSmallSlotsEqualTheWholeTensorsKernel_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
#ifdef MEMTUNE_CUDA
  const c10::Device cuda(c10::kCUDA, 0);
  const int64_t n = 70000, blocks = (n + 255) / 256;
  for (bool eight : {true, false}) {
    SCOPED_TRACE(eight ? "8-bit states" : "32-bit states");
    at::Generator gen = at::detail::createCPUGenerator(41);
    const at::Tensor p0 = at::randn({n}, gen);
    std::vector<at::Tensor> host;  // states as some earlier steps left them
    if (eight) {
      host = {at::randint(256, {n}, gen, at::kByte), at::randint(256, {n}, gen, at::kByte),
              at::rand({blocks}, gen) * 0.1, at::rand({blocks}, gen) * 0.01};
    } else {
      host = {at::randn({n}, gen) * 0.1, at::rand({n}, gen) * 0.01};
    }
    std::vector<at::Tensor> device;
    for (at::Tensor& t : host) {
      device.push_back(t.to(cuda));
      t = t.pin_memory();
    }
    const at::Tensor paged = p0.to(cuda), whole = p0.to(cuda);
    tr::PagedStates ps(cuda, 8192);
    EXPECT_EQ(tr::PagedStates::run_elements(8192, eight), eight ? 13 * 256 : 3 * 256);
    for (int step = 1; step <= 3; ++step) {
      const at::Tensor g = (at::randn({n}, gen) * 0.01).to(cuda);
      const memtune::trainer::BnbScalars s(step, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0);
      ps.update(s, paged, g, host);
      ps.finish();
      if (eight)
        tr::bnb_adam8_cuda(s, whole, g, device[0], device[1], device[2], device[3]);
      else
        tr::bnb_adam32_cuda(s, whole, g, device[0], device[1]);
    }
    EXPECT_TRUE(at::equal(paged.cpu(), whole.cpu())) << "parameters";
    for (size_t k = 0; k < host.size(); ++k) EXPECT_TRUE(at::equal(host[k], device[k].cpu())) << "state " << k;
  }
#endif
}

}  // namespace
