#pragma once
// Gradient offload, the gradient half of memory.optimizer_offload: cpu (DeepSpeed's
// offload_optimizer moves gradients with the state: ZeRO-Offload). Each trainable tensor's
// gradient leaves the device the moment backward produces it: a pre-hook on the tensor's
// gradient accumulator (the AccumulateGrad node every graph ends in for that leaf) copies it
// into a host buffer outside the device budget (runtime/offload.h) and hands the accumulator
// nothing, so the device never keeps it. Across micro-batches the host buffer accumulates as
// AccumulateGrad would on the device (the first micro-batch's copied, the later ones added
// in place, fp32, in backward's order): the same bits. The tensor's .grad is that host
// buffer, so unscaling, the inf/nan check, the norm, clipping, the data-parallel reduction
// (a CPU group) and the optimizer's update read it where it is; only updated weights go back.
//
// The device holds a gradient only between its producer and its accumulator (one tensor's,
// or a checkpointed layer's at once), never the step's.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace memtune::trainer {

class GradientOffload {
 public:
  using Params = std::vector<std::pair<std::string, at::Tensor>>;

  // `params`: the trainable leaves (fp32). Nothing moves until enable().
  explicit GradientOffload(Params params);
  ~GradientOffload();  // removes the hooks
  GradientOffload(const GradientOffload&) = delete;
  GradientOffload& operator=(const GradientOffload&) = delete;

  // Host buffers (fp32, one per tensor, outside the budget) and the hooks; a gradient held
  // already moves there. Returns the host bytes; 0 when on already.
  int64_t enable();
  // The reverse: hooks removed, a gradient held comes back to its tensor's device (allocated
  // there), the buffers are freed. Returns the bytes that were in host memory.
  int64_t disable();
  bool enabled() const { return !hooks_.empty(); }
  int64_t host_bytes() const;

 private:
  struct Hook;
  void take(size_t i, const at::Tensor& g);  // called by tensor i's hook, in backward

  Params params_;
  std::vector<std::shared_ptr<void>> accumulators_;  // torch::autograd::Node, per tensor (kept alive)
  std::vector<void*> hooks_;                         // our pre-hook on each accumulator (for removal)
  std::vector<at::Tensor> host_;                     // fp32, the tensor's shape, outside the budget
};

}  // namespace memtune::trainer
