#pragma once
// Activation offload's copies on CUDA (runtime/cuda/offload_cuda.cpp, built only with CUDA):
// runtime/offload.cpp's OffloadedTensor calls these under MEMTUNE_CUDA. One side stream per
// device carries every copy; events order it against the compute stream (the stream current
// when a function is called), so neither waits for the other more than the data requires.
#include <memory>

#include <ATen/core/Tensor.h>

namespace memtune {

// A pinned host copy of CUDA tensor t, its copy started on the side stream after the work
// the compute stream has queued so far (the copy reads t only once t is written). t's memory
// is kept from reuse by the caching allocator until the copy has read it.
at::Tensor cuda_offload_async(const at::Tensor& t);

// A copy of pinned `host` on `device` (allocated there now, from the side stream's blocks),
// started on the side stream after the copy out finished; *ready receives the event the
// compute stream waits for before reading it.
at::Tensor cuda_fetch_async(const at::Tensor& host, const c10::Device& device, std::shared_ptr<void>* ready);

// Zeros in page-locked host memory of exactly their bytes (cudaHostAlloc; LibTorch's caching
// host allocator would round each up to a power of two and keep it), freed with the tensor.
at::Tensor cuda_pinned_zeros(at::IntArrayRef sizes, at::ScalarType dtype);

// The current stream of `device` waits (on the device, not the host) for `ready`.
void cuda_wait_on_current_stream(const std::shared_ptr<void>& ready, const c10::Device& device);

}  // namespace memtune
