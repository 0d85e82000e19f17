// Optimizer offload (Optimizer::offload_states, memory.optimizer_offload: cpu): the state
// leaves the device budget and the updates stay bit for bit those of states on the device.
#include <gtest/gtest.h>

#include <optional>

#include <ATen/ATen.h>

#include "runtime/cpu_budget_allocator.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {
namespace {

struct Outcome {
  std::vector<at::Tensor> params;
  int64_t held = 0;  // budget bytes in use after building the optimizer (and offloading)
  int64_t built_peak = 0;  // the budget's peak while building it (and offloading), above the start
  int64_t moved = 0;
};

// Three updates of two parameters (one large enough for 8-bit states) from fixed gradients.
// `made_offloaded`: OptimizerOptions::offloaded, the states made in host memory.
Outcome run(const std::string& optim, bool offload, bool made_offloaded = false) {
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
  o.offloaded = made_offloaded;
  Outcome r;
  std::optional<Optimizer> built;
  {
    ScopedPeakReset peak;
    built.emplace(params, o);
    if (offload) r.moved = built->offload_states();
    r.built_peak = peak.peak() - before;
  }
  Optimizer& opt = *built;
  r.held = cpu_allocated_bytes() - before;
  for (int step = 0; step < 3; ++step) {
    for (auto& [name, p] : params) p.mutable_grad() = at::randn(p.sizes());
    opt.step(1e-2, 0.5);
  }
  for (auto& [name, p] : params) r.params.push_back(p.clone());
  EXPECT_EQ(opt.states_offloaded(), offload || made_offloaded);
  return r;
}

class OptimizerOffload : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerOffload, SameUpdatesWithTheStateOutsideTheBudget) {
  const Outcome kept = run(GetParam(), false), offloaded = run(GetParam(), true);
  for (size_t i = 0; i < kept.params.size(); ++i) EXPECT_TRUE(at::equal(kept.params[i], offloaded.params[i])) << i;
  EXPECT_GT(offloaded.moved, 0);
  EXPECT_EQ(kept.held - offloaded.held, offloaded.moved) << "every moved byte left the budget";
}

// memory.optimizer_offload: cpu configured: the states are made in host memory, so a budget
// that holds the offloaded run need never hold them (made on the device and moved, they were
// all there at once: GPT-2 124M's 949 MiB of AdamW state under a 650 MiB limit).
TEST_P(OptimizerOffload, MadeInHostMemoryTheStateNeverEntersTheBudget) {
  const Outcome kept = run(GetParam(), false), moved = run(GetParam(), true), made = run(GetParam(), false, true);
  for (size_t i = 0; i < kept.params.size(); ++i) EXPECT_TRUE(at::equal(kept.params[i], made.params[i])) << i;
  EXPECT_EQ(moved.built_peak, kept.held) << "moved, the state was on the device first";
  EXPECT_EQ(made.built_peak, 0);
  EXPECT_EQ(made.held, 0);
  EXPECT_EQ(run(GetParam(), true, true).moved, 0) << "nothing left to move";
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
