#pragma once
// Offloaded weights: kept in host memory outside the device's budget, copied to the
// compute device just before their layer runs and released after.
#include <memory>

#include <ATen/core/Tensor.h>

namespace memtune {

// A copy of `t` in plain host memory that the CPU budget allocator does not count (as
// weights offloaded to host RAM are not part of a GPU's memory). Undefined stays undefined.
at::Tensor to_offload_storage(const at::Tensor& t);

// Zeros in that host memory (outside the CPU budget), allocated there directly. `pinned`
// (CUDA builds): page-locked, so that copies to and from a GPU run asynchronously.
at::Tensor offload_zeros(at::IntArrayRef sizes, at::ScalarType dtype, bool pinned = false);

// A copy of an offloaded tensor on `device`, allocated there (counted by its budget).
at::Tensor fetch_from_offload(const at::Tensor& t, const c10::Device& device);

// A tensor's trip to host memory and back (activation offload: a checkpointed layer's input
// waits there for backward). On CUDA the host copy is pinned memory (outside any budget) and
// both copies run on a side stream, ordered against the compute stream by events: the copy out
// overlaps the next layers' forward, and prefetch() starts the copy back while the layer
// above runs its backward (runtime/cuda/offload_cuda.h). Elsewhere both are the synchronous
// copies of the functions above, and prefetch() does nothing: a copy that cannot overlap
// anything would only hold the device's memory longer, so fetch() makes it when needed.
// Whether OffloadedTensor::prefetch copies ahead on `device` (CUDA) or leaves it to fetch().
bool offload_prefetches(const c10::Device& device);

class OffloadedTensor {
 public:
  OffloadedTensor() = default;
  // Starts the copy of t to host memory (t's memory is kept from reuse until it is done).
  explicit OffloadedTensor(const at::Tensor& t);
  // Starts the copy back to the device (allocated there, counted by its budget), once, where
  // copies are asynchronous (offload_prefetches).
  void prefetch();
  bool prefetched() const { return device_copy_.defined(); }
  // The tensor on its device: the prefetched copy (the compute stream waits for it), or a
  // copy made now. Releases the host copy; an empty OffloadedTensor is left.
  at::Tensor fetch();
  bool defined() const { return host_.defined(); }

 private:
  at::Tensor host_;
  at::Tensor device_copy_;
  c10::Device device_ = c10::kCPU;
  std::shared_ptr<void> ready_;  // CUDA: the event after which device_copy_ may be read
};

}  // namespace memtune
