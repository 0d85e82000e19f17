// Optimizer offload (Optimizer::offload_states, memory.optimizer_offload: cpu): the state
// leaves the device budget and the updates stay bit for bit those of states on the device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/cpu_budget_allocator.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {
namespace {

struct Outcome {
  std::vector<at::Tensor> params;
  int64_t held = 0;  // budget bytes in use after building the optimizer (and offloading)
  int64_t moved = 0;
};

// Three updates of two parameters (one large enough for 8-bit states) from fixed gradients.
Outcome run(const std::string& optim, bool offload) {
  install_cpu_budget_allocator();
  at::manual_seed(1);
  std::vector<std::pair<std::string, at::Tensor>> params = {{"a.weight", at::randn({96, 64})},
                                                           {"b.weight", at::randn({16, 8})}};
  dynamic_map(true);  // 8-bit AdamW's code maps, built once per process (not state)
  dynamic_map(false);
  const int64_t before = cpu_allocated_bytes();
  OptimizerOptions o;
  set_optimizer_kind(optim, o);
  o.weight_decay = 0.01;
  o.momentum = 0.9;
  Optimizer opt(params, o);
  Outcome r;
  if (offload) r.moved = opt.offload_states();
  r.held = cpu_allocated_bytes() - before;
  for (int step = 0; step < 3; ++step) {
    for (auto& [name, p] : params) p.mutable_grad() = at::randn(p.sizes());
    opt.step(1e-2, 0.5);
  }
  for (auto& [name, p] : params) r.params.push_back(p.clone());
  EXPECT_EQ(opt.states_offloaded(), offload);
  return r;
}

class OptimizerOffload : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerOffload, SameUpdatesWithTheStateOutsideTheBudget) {
  const Outcome kept = run(GetParam(), false), offloaded = run(GetParam(), true);
  for (size_t i = 0; i < kept.params.size(); ++i) EXPECT_TRUE(at::equal(kept.params[i], offloaded.params[i])) << i;
  EXPECT_GT(offloaded.moved, 0);
  EXPECT_EQ(kept.held - offloaded.held, offloaded.moved) << "every moved byte left the budget";
}

INSTANTIATE_TEST_SUITE_P(Kinds, OptimizerOffload, ::testing::Values("adamw_torch", "sgd", "adamw_8bit"));

// On the CPU torch's AdamW runs the fused kernel, which needs no denominator workspace: after
// three steps the optimizer holds its two fp32 states and nothing else (a workspace the size
// of the largest parameter was allocated, and never used, before), and nothing once they are
// offloaded.
TEST(OptimizerOffload, TheCpuAdamWHoldsItsStatesAndNoWorkspace) {
  install_cpu_budget_allocator();
  for (bool offload : {false, true}) {
    std::vector<std::pair<std::string, at::Tensor>> params = {{"a.weight", at::randn({96, 64})},
                                                             {"b.weight", at::randn({16, 8})}};
    const int64_t before = cpu_allocated_bytes();
    OptimizerOptions o;
    set_optimizer_kind("adamw_torch", o);
    Optimizer opt(params, o);
    if (offload) opt.offload_states();
    for (int step = 0; step < 3; ++step) {
      for (auto& [name, p] : params) p.mutable_grad() = at::randn(p.sizes());
      opt.step(1e-2);
    }
    opt.zero_grad();
    EXPECT_EQ(cpu_allocated_bytes() - before, offload ? 0 : 2 * (96 * 64 + 16 * 8) * 4) << "offload " << offload;
  }
}

}  // namespace
}  // namespace memtune::trainer
