#pragma once
// bitsandbytes' AdamW updates for parameters and states on one CUDA device
// (trainer/cuda/adamw_bnb_cuda.cpp, built only with CUDA): trainer/optimizer.cpp calls these
// under MEMTUNE_CUDA. Every tensor contiguous fp32 (codes uint8) on the parameter's device;
// nothing is allocated, so an out-of-memory error cannot interrupt an update half way.
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "trainer/bnb_scalars.h"

namespace memtune::trainer {

// Whether the update of p (with gradient g and these states) can run on p's CUDA device:
// all contiguous, fp32 (the 8-bit codes uint8), on that device.
bool bnb_cuda_applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& states);

// adamw_8bit: c1, c2 the codes, absmax1, absmax2 fp32 per 256 elements.
void bnb_adam8_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& c1,
                    const at::Tensor& c2, const at::Tensor& absmax1, const at::Tensor& absmax2);
// adamw_32bit (and adamw_8bit's tensors under 4096 elements): fp32 m, v.
void bnb_adam32_cuda(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                     const at::Tensor& v);

// Paged states (paged_adamw_8bit, paged_adamw_32bit) of parameters on a CUDA device:
// bitsandbytes keeps them in host memory and pages them into the device for the update.
// Here they pass through two device slots of at most kPagedSlotBytes, double-buffered: while
// the kernel updates a run of a parameter in one slot, a side stream copies the next run's
// states into the other slot and the previous run's back to the host. A run is as many
// whole 256-element blocks as a slot holds (bitsandbytes' kernels treat each block, or
// element, on its own), so a tensor of any size passes through slots of a fixed size. The
// host states are pinned where they were made so (runtime/offload.h), which lets the copies
// overlap the kernels.
class PagedStates {
 public:
  // The smallest slot: one block of either kind of states.
  static constexpr int64_t kMinSlotBytes = 4 * 256 + 2 * 4 * 256;
  // Device bytes a slot needs for the whole of these states: [c1, c2, absmax1, absmax2]
  // (8-bit) or [m, v] (32-bit), each at a 256-byte boundary.
  static int64_t slot_bytes(const std::vector<at::Tensor>& host_states);
  // Elements of a run through a slot of `slot_bytes` (a multiple of 256).
  static int64_t run_elements(int64_t slot_bytes, bool eight_bit);
  // Two slots of `slot_bytes` (at least kMinSlotBytes) on `device`, allocated now.
  PagedStates(const c10::Device& device, int64_t slot_bytes);
  ~PagedStates();
  PagedStates(const PagedStates&) = delete;
  PagedStates& operator=(const PagedStates&) = delete;

  int64_t capacity() const { return slot_bytes_; }
  // Whether p (fp32, contiguous, on this device, its gradient too) can be updated with these
  // host states: bitsandbytes' 8-bit states (uint8 codes, fp32 absmax per block) or fp32 m, v,
  // contiguous on the host.
  bool applies(const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& host_states) const;
  // Queues p's update, run by run (the 8-bit update with four states, the 32-bit with two).
  void update(const BnbScalars& s, const at::Tensor& p, const at::Tensor& g, const std::vector<at::Tensor>& host_states);
  // Returns once every queued run's states are back in host memory (and the side stream
  // idle, even when a copy failed: its error is thrown after).
  void finish();

 private:
  struct Impl;
  c10::Device device_;
  int64_t slot_bytes_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace memtune::trainer
