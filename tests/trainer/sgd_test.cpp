// training.optim: sgd as torch.optim.SGD computes it (dampening 0, not Nesterov), against
// its update rule worked out here in double: at momentum 0 p -= lr (g + wd p) and no state
// at all (torch keeps momentum_buffer None, so nothing is allocated or checkpointed); with
// momentum m the buffer starts as the first gradient, then b = m b + g, and p -= lr b.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/cpu_budget_allocator.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {
namespace {

struct SgdRun {
  at::Tensor param;
  int64_t state_bytes = 0, held = 0;
  size_t state_tensors = 0;
};

// Three steps of SGD on a [5, 7] tensor with gradients drawn from a fixed seed, lr 0.1.
SgdRun run(double momentum, double weight_decay) {
  install_cpu_budget_allocator();
  at::manual_seed(4);
  std::vector<std::pair<std::string, at::Tensor>> params = {{"w", at::randn({5, 7}).requires_grad_()}};
  OptimizerOptions o;
  set_optimizer_kind("sgd", o);
  o.momentum = momentum;
  o.weight_decay = weight_decay;
  const int64_t before = cpu_allocated_bytes();
  Optimizer opt(params, o);
  SgdRun r;
  r.held = cpu_allocated_bytes() - before;
  at::manual_seed(9);
  for (int step = 0; step < 3; ++step) {
    params[0].second.mutable_grad() = at::randn({5, 7});
    opt.step(0.1, 1.0);
  }
  r.param = params[0].second.detach().clone();
  r.state_bytes = opt.state_bytes();
  r.state_tensors = opt.state_tensors().size();
  return r;
}

at::Tensor expected(double momentum, double weight_decay) {
  at::manual_seed(4);
  at::Tensor p = at::randn({5, 7}).to(at::kDouble);
  at::manual_seed(9);
  at::Tensor b;
  for (int step = 0; step < 3; ++step) {
    at::Tensor g = at::randn({5, 7}).to(at::kDouble) + weight_decay * p;
    if (momentum != 0) {
      b = step == 0 ? g : momentum * b + g;
      g = b;
    }
    p = p - 0.1 * g;
  }
  return p;
}

TEST(Sgd, WithoutMomentumKeepsNoStateAndStepsByTheGradient) {
  for (const double wd : {0.0, 0.01}) {
    const SgdRun r = run(0.0, wd);
    EXPECT_TRUE(at::allclose(r.param.to(at::kDouble), expected(0.0, wd), 1e-6, 1e-7)) << "wd " << wd;
    EXPECT_EQ(r.state_bytes, 0);
    EXPECT_EQ(r.state_tensors, 0u) << "nothing to checkpoint";
    EXPECT_EQ(r.held, 0) << "nothing allocated";
  }
  EXPECT_EQ(optimizer_state_bytes("sgd", false, {5, 7}, false), 0);
}

TEST(Sgd, WithMomentumKeepsOneBufferAsTorch) {
  const SgdRun r = run(0.9, 0.01);
  EXPECT_TRUE(at::allclose(r.param.to(at::kDouble), expected(0.9, 0.01), 1e-6, 1e-7));
  EXPECT_EQ(r.state_bytes, 5 * 7 * 4);
  EXPECT_EQ(r.state_tensors, 1u);
  EXPECT_EQ(r.held, 5 * 7 * 4);
  EXPECT_EQ(optimizer_state_bytes("sgd", false, {5, 7}, true), 5 * 7 * 4);
}

}  // namespace
}  // namespace memtune::trainer
