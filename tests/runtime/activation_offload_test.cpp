// Activation offload (runtime/activation_checkpoint.h, offload_input): a checkpointed block's
// input waits for backward outside the device budget and comes back for the recomputation;
// the gradients are those of the block kept on the device, bit for bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/activation_checkpoint.h"
#include "runtime/cpu_budget_allocator.h"

namespace memtune {
namespace {

struct Grads {
  at::Tensor x, w;
  int64_t held = 0;  // budget bytes in use between forward and backward, beyond before
};

// Two checkpointed blocks y = tanh(x W) W^T, then backward of the sum.
Grads run(bool offload) {
  install_cpu_budget_allocator();
  at::manual_seed(0);
  at::Tensor w = at::randn({256, 256}).requires_grad_(true);
  at::Tensor x = at::randn({8, 64, 256}).requires_grad_(true);
  const BlockFn block = [&](const at::Tensor& in) { return at::matmul(at::tanh(at::matmul(in, w)), w.t()); };
  const int64_t before = cpu_allocated_bytes();
  at::Tensor h = checkpoint(block, x * 2, {w}, offload);  // x * 2: a fresh input only the node holds
  at::Tensor y = checkpoint(block, h, {w}, offload).sum();
  h.reset();
  Grads g;
  g.held = cpu_allocated_bytes() - before;
  y.backward();
  g.x = x.grad();
  g.w = w.grad();
  return g;
}

TEST(ActivationOffload, GradientsAreBitForBitAndInputsLeaveTheBudget) {
  const Grads kept = run(false), offloaded = run(true);
  EXPECT_TRUE(at::equal(kept.x, offloaded.x));
  EXPECT_TRUE(at::equal(kept.w, offloaded.w));
  // Each block keeps its (8, 64, 256) fp32 input: 512 KiB, two of them, no longer counted.
  const int64_t input_bytes = 8 * 64 * 256 * 4;
  EXPECT_GE(kept.held - offloaded.held, 2 * input_bytes) << kept.held << " vs " << offloaded.held;
}

}  // namespace
}  // namespace memtune
