#include "runtime/cuda/offload_cuda.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "runtime/error.h"

namespace memtune {
namespace {

// The side stream of each device, taken from LibTorch's pool once.
c10::cuda::CUDAStream offload_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::vector<c10::optional<c10::cuda::CUDAStream>> streams(c10::cuda::device_count());
  std::lock_guard<std::mutex> lock(mutex);
  auto& s = streams.at(index);
  if (!s) s = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index);
  return *s;
}

}  // namespace

at::Tensor cuda_offload_async(const at::Tensor& t) {
  const c10::cuda::CUDAGuard guard(t.device());
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(t.device().index());
  const c10::cuda::CUDAStream side = offload_stream(t.device().index());
  at::cuda::CUDAEvent written;
  written.record(compute);
  written.block(side);
  const at::Tensor src = t.detach();
  at::Tensor host = at::empty(src.sizes(), src.options().device(c10::kCPU).pinned_memory(true));
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    host.copy_(src, /*non_blocking=*/true);
  }
  // src may be freed on the compute stream before the side stream has read it.
  c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), side);
  return host;
}

at::Tensor cuda_fetch_async(const at::Tensor& host, const c10::Device& device, std::shared_ptr<void>* ready) {
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream side = offload_stream(device.index());
  at::Tensor out;
  {
    // Allocated with the side stream current: a block the compute stream freed may still be
    // in use by its queued work, and the side stream, which never waits for that work, must
    // not write into it. The side stream's own blocks are free in its order. Copies on the
    // side stream run in order, so this one starts after the copy out that filled `host`.
    const c10::cuda::CUDAStreamGuard on_side(side);
    out = at::empty(host.sizes(), host.options().device(device).pinned_memory(false));
    out.copy_(host, /*non_blocking=*/true);
  }
  // The compute stream reads it (after the ready event): its uses hold the block too.
  c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), compute);
  auto event = std::make_shared<at::cuda::CUDAEvent>();
  event->record(side);
  *ready = event;
  return out;
}

at::Tensor cuda_pinned_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  const size_t bytes = std::max<size_t>(static_cast<size_t>(n) * c10::elementSize(dtype), 1);
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it
    MEMTUNE_CHECK(false, "offload: page-locked host memory exhausted while allocating ", bytes, " bytes (",
                  cudaGetErrorString(err), ")");
  }
  std::memset(p, 0, bytes);
  return at::from_blob(p, sizes, [](void* q) { cudaFreeHost(q); }, at::TensorOptions(dtype));
}

void cuda_wait_on_current_stream(const std::shared_ptr<void>& ready, const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  static_cast<at::cuda::CUDAEvent*>(ready.get())->block(c10::cuda::getCurrentCUDAStream(device.index()));
}

}  // namespace memtune
