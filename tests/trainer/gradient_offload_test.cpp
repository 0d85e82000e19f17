// Gradient offload (trainer/gradient_offload.h, memory.optimizer_offload: cpu): gradients
// leave the device budget as backward produces them and accumulate in host memory to the
// same bits as AccumulateGrad's on the device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "runtime/activation_checkpoint.h"
#include "runtime/cpu_budget_allocator.h"
#include "trainer/gradient_offload.h"

namespace memtune::trainer {
namespace {

constexpr int64_t kH = 192;  // three [kH, kH] weights and a [kH] bias: 3 * 192^2 + 192 parameters
constexpr int64_t kParams = 3 * kH * kH + kH;

struct Outcome {
  std::vector<at::Tensor> grads;  // after the step's micro-batches
  int64_t held = 0;               // budget bytes held by the gradients after the step
  int64_t peak = 0;               // the budget's peak over the later micro-batches, above the weights
  bool on_budget = false;         // a gradient's bytes are counted by the budget
};

// Three micro-batches of a small MLP (its middle weight used twice, as tied weights are; the
// last block checkpointed), gradients accumulated over them, with or without offload.
Outcome run(bool offload) {
  install_cpu_budget_allocator();
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> params = {
      {"w1", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"w2", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"w3", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"b", at::randn({kH}).requires_grad_()}};
  std::vector<at::Tensor> inputs;
  for (int m = 0; m < 3; ++m) inputs.push_back(at::randn({8 + 4 * m, kH}));
  const int64_t before = cpu_allocated_bytes();  // the host buffers come after: outside the budget
  GradientOffload go(params);
  if (offload) {
    EXPECT_EQ(go.enable(), kParams * 4);
  }
  const at::Tensor &w1 = params[0].second, &w2 = params[1].second, &w3 = params[2].second, &b = params[3].second;
  Outcome r;
  for (int m = 0; m < 3; ++m) {
    if (m == 1) reset_cpu_peak();
    at::Tensor h = at::tanh(at::matmul(inputs[m], w1) + b);
    h = at::tanh(at::matmul(h, w2));
    h = checkpoint([&](const at::Tensor& x) { return at::tanh(at::matmul(at::matmul(x, w3), w2)); }, h, {w3, w2});
    (h * h).sum().mul(0.5).backward();
  }
  r.peak = cpu_peak_bytes() - before;
  r.held = cpu_allocated_bytes() - before;
  for (const auto& [name, p] : params) {
    EXPECT_TRUE(p.grad().defined()) << name;
    r.grads.push_back(p.grad().clone());
  }
  const int64_t with_grads = cpu_allocated_bytes();
  for (const auto& [name, p] : params) p.mutable_grad() = at::Tensor();
  r.on_budget = cpu_allocated_bytes() < with_grads;
  return r;
}

TEST(GradientOffload, AccumulatesTheSameBitsOutsideTheBudget) {
  const Outcome kept = run(false), off = run(true);
  for (size_t i = 0; i < kept.grads.size(); ++i) EXPECT_TRUE(at::equal(kept.grads[i], off.grads[i])) << i;
  // Arithmetic, not the code's own count: every fp32 gradient, kParams x 4 bytes.
  EXPECT_EQ(kept.held, kParams * 4);
  EXPECT_EQ(off.held, 0) << "a gradient stayed in the budget";
  EXPECT_TRUE(kept.on_budget);
  EXPECT_FALSE(off.on_budget);
  // In the later micro-batches the device held every gradient besides the work; offloaded,
  // at most one tensor's (or the checkpointed block's two) while backward hands it over.
  const int64_t largest_two = 2 * kH * kH * 4;
  EXPECT_GE(kept.peak - off.peak, kParams * 4 - largest_two) << kept.peak << " vs " << off.peak;
  EXPECT_LE(kept.peak - off.peak, kParams * 4 + 4096) << kept.peak << " vs " << off.peak;
}

TEST(GradientOffload, DisableBringsAHeldGradientBackAndRemovesTheHook) {
  install_cpu_budget_allocator();
  at::Tensor w = at::ones({64, 64}).requires_grad_();
  GradientOffload go({{"w", w}});
  go.enable();
  (w * 3).sum().backward();
  const int64_t before = cpu_allocated_bytes();
  EXPECT_EQ(go.disable(), 64 * 64 * 4);
  EXPECT_EQ(cpu_allocated_bytes() - before, 64 * 64 * 4) << "the gradient is on the device again";
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 3.0f)));
  (w * 2).sum().backward();  // no hook: AccumulateGrad adds on the device
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 5.0f)));
  EXPECT_EQ(cpu_allocated_bytes() - before, 64 * 64 * 4);
}

}  // namespace
}  // namespace memtune::trainer
