// Activation offload (runtime/activation_checkpoint.h, offload_input): a checkpointed block's
// input waits for backward outside the device budget and comes back for the recomputation;
// the gradients are those of the block kept on the device, bit for bit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "runtime/activation_checkpoint.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/offload.h"
#include "test_util.h"

#ifdef MEMTUNE_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace memtune {
namespace {

struct Grads {
  at::Tensor x, w;
  int64_t held = 0;  // budget bytes in use between forward and backward, beyond before
};

// Three checkpointed blocks y = tanh(x W) W^T, then backward of the sum: each block's
// backward prefetches the input of the block below (the last one's has none to fetch).
Grads run(bool offload, const c10::Device& device = c10::kCPU) {
  install_cpu_budget_allocator();
  at::manual_seed(0);
  at::Tensor w = at::randn({256, 256}).to(device).requires_grad_(true);
  at::Tensor x = at::randn({8, 64, 256}).to(device).requires_grad_(true);
  const BlockFn block = [&](const at::Tensor& in) { return at::matmul(at::tanh(at::matmul(in, w)), w.t()); };
  const int64_t before = cpu_allocated_bytes();
  at::Tensor h = checkpoint(block, x * 2, {w}, offload);  // x * 2: a fresh input only the node holds
  at::Tensor h2 = checkpoint(block, h, {w}, offload);
  at::Tensor y = checkpoint(block, h2, {w}, offload).sum();
  h.reset();
  h2.reset();
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
  // Each block keeps its (8, 64, 256) fp32 input: 512 KiB, three of them, no longer counted.
  const int64_t input_bytes = 8 * 64 * 256 * 4;
  EXPECT_GE(kept.held - offloaded.held, 3 * input_bytes) << kept.held << " vs " << offloaded.held;
}

// On a GPU the copies run on a side stream with pinned host memory, the way back prefetched
// while the block above computes: the gradients must still be the kept run's, bit for bit.
TEST(ActivationOffload, OnTheGpuGradientsAreBitForBit_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  const Grads kept = run(false, cuda), offloaded = run(true, cuda);
  EXPECT_TRUE(at::equal(kept.x.cpu(), offloaded.x.cpu()));
  EXPECT_TRUE(at::equal(kept.w.cpu(), offloaded.w.cpu()));
  // The trip alone, many times over, racing the compute stream: values intact.
  EXPECT_TRUE(offload_prefetches(cuda));
  for (int k = 0; k < 20; ++k) {
    const at::Tensor t = at::randn({512, 1024}, at::TensorOptions().device(cuda));
    OffloadedTensor off(t * 3);  // a temporary: its memory is free for reuse at once
    at::Tensor noise = at::randn({512, 1024}, at::TensorOptions().device(cuda));  // may reuse it
    off.prefetch();
    EXPECT_TRUE(off.prefetched());
    EXPECT_TRUE(at::equal(off.fetch(), t * 3)) << "trip " << k;
  }
#ifdef MEMTUNE_CUDA
  // The hazard the side stream must not fall into: a block the compute stream freed while its
  // queued work (here a long sleep, then a fill) still writes it. A prefetch allocated from
  // it would be overwritten by the fill after the copy back.
  for (int k = 0; k < 5; ++k) {
    const at::Tensor t = at::randn({512, 1024}, at::TensorOptions().device(cuda));
    OffloadedTensor off(t);
    c10::cuda::device_synchronize();  // the copy out is done: only the compute stream's work races
    at::Tensor busy = at::empty({512, 1024}, at::TensorOptions().device(cuda));
    at::cuda::sleep(int64_t{200} * 1000 * 1000);  // about 0.1 s of a GPU's clock
    busy.fill_(7.0);
    busy.reset();  // freed for the compute stream at once, its fill still queued
    off.prefetch();
    EXPECT_TRUE(at::equal(off.fetch(), t)) << "a prefetch wrote into memory the compute stream still used (" << k
                                           << ")";
  }
#endif
}

// The trip itself on the CPU: out of the budget on the way out; prefetch() copies nothing
// ahead (a synchronous copy would only hold memory longer), fetch() brings the same values
// back into the budget; nothing is left behind.
TEST(ActivationOffload, AnOffloadedTensorComesBackWhenFetchedWithNoCopyAheadOnTheCpu) {
  install_cpu_budget_allocator();
  EXPECT_FALSE(offload_prefetches(c10::kCPU));
  const at::Tensor t = at::randn({64, 1024});
  const int64_t bytes = t.numel() * 4;
  const int64_t before = cpu_allocated_bytes();
  OffloadedTensor off(t);
  EXPECT_TRUE(off.defined());
  EXPECT_EQ(cpu_allocated_bytes() - before, 0) << "the host copy is outside the budget";
  off.prefetch();
  EXPECT_FALSE(off.prefetched());
  EXPECT_EQ(cpu_allocated_bytes() - before, 0) << "no copy ahead on the CPU";
  const at::Tensor back = off.fetch();
  EXPECT_EQ(cpu_allocated_bytes() - before, bytes);
  EXPECT_FALSE(off.defined());
  EXPECT_TRUE(at::equal(back, t));
  EXPECT_NE(back.data_ptr(), t.data_ptr());
}

}  // namespace
}  // namespace memtune
