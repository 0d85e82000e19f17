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
//
// A tensor used twice, as a tied embedding and head are, gets its two gradients summed by
// autograd before its accumulator runs: the head's, from the loss's backward, would wait on
// the device for the embedding's, which comes last, and the two would meet in a third (V,C)
// tensor there. tap() hands the head's to the host as the loss's backward produces it; the
// accumulator's hook adds the embedding's to it there (head + emb: the sum autograd forms,
// fp32 addition commutes) and accumulates that as above: the same bits, 2 x (V,C) fp32 less
// on the device at the end of backward.
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
  ~GradientOffload();  // removes the hooks; gradients held stay in host memory (nothing moves)
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

  // `w` for the loss to use in its place when the loss is not its only use (a tied head): the
  // same values, whose backward gives the gradient to the host (a staging buffer there) and
  // none to `w`; `w`'s accumulator takes it from there with `w`'s other gradient. `w` itself
  // when it is not one of the tensors, gradient offload is off or no gradient is recorded.
  // The graph must not outlive this object. A staged gradient whose backward failed is
  // dropped, as autograd drops its input buffers: by the next tap() or by disable().
  at::Tensor tap(const at::Tensor& w);

 private:
  struct Hook;
  struct Tap;
  void take(size_t i, const at::Tensor& g);   // called by tensor i's hook, in backward; g may be undefined
  void stage(size_t i, const at::Tensor& g);  // called by a tap of tensor i, in backward
  void remove_hooks();

  Params params_;
  std::vector<std::shared_ptr<void>> accumulators_;  // torch::autograd::Node, per tensor (kept alive)
  std::vector<void*> hooks_;                         // our pre-hook on each accumulator (for removal)
  std::vector<at::Tensor> host_;                     // fp32, the tensor's shape, outside the budget
  // A tap's gradient waiting for its tensor's accumulator: in host_ on the step's first
  // micro-batch (the sum becomes the gradient), else in staging_ (the sum is added to it).
  std::vector<at::Tensor> staging_;  // fp32 host, per tensor, allocated at its first use
  std::vector<bool> staged_;
};

}  // namespace memtune::trainer
