#include "runtime/offload.h"

#include <cstdlib>
#include <cstring>

#include <ATen/ATen.h>

#include "runtime/error.h"
#ifdef MEMTUNE_CUDA
#include "runtime/cuda/offload_cuda.h"
#endif

namespace memtune {

at::Tensor to_offload_storage(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor src = t.detach().to(c10::kCPU).contiguous();
  const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
  void* p = std::malloc(std::max<size_t>(bytes, 1));
  MEMTUNE_CHECK(p != nullptr, "offload: host memory exhausted while offloading ", bytes, " bytes");
  std::memcpy(p, src.data_ptr(), bytes);
  return at::from_blob(p, src.sizes(), src.strides(), [](void* q) { std::free(q); }, src.options());
}

at::Tensor offload_zeros(at::IntArrayRef sizes, at::ScalarType dtype, bool pinned) {
#ifdef MEMTUNE_CUDA
  if (pinned) return cuda_pinned_zeros(sizes, dtype);
#else
  (void)pinned;
#endif
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  const size_t bytes = static_cast<size_t>(n) * c10::elementSize(dtype);
  void* p = std::calloc(std::max<size_t>(bytes, 1), 1);
  MEMTUNE_CHECK(p != nullptr, "offload: host memory exhausted while allocating ", bytes, " bytes");
  return at::from_blob(p, sizes, [](void* q) { std::free(q); }, at::TensorOptions(dtype));
}

at::Tensor fetch_from_offload(const at::Tensor& t, const c10::Device& device) {
  if (!t.defined()) return t;
  return t.to(device, /*non_blocking=*/false, /*copy=*/true);
}

OffloadedTensor::OffloadedTensor(const at::Tensor& t) : device_(t.device()) {
#ifdef MEMTUNE_CUDA
  if (t.is_cuda()) {
    host_ = cuda_offload_async(t);
    return;
  }
#endif
  host_ = to_offload_storage(t);
}

bool offload_prefetches(const c10::Device& device) { return device.is_cuda(); }

void OffloadedTensor::prefetch() {
  if (!host_.defined() || device_copy_.defined() || !offload_prefetches(device_)) return;
#ifdef MEMTUNE_CUDA
  device_copy_ = cuda_fetch_async(host_, device_, &ready_);
#endif
}

at::Tensor OffloadedTensor::fetch() {
  MEMTUNE_INTERNAL_ASSERT(host_.defined(), "OffloadedTensor: fetched twice, or never offloaded");
  prefetch();
  if (!device_copy_.defined()) device_copy_ = fetch_from_offload(host_, device_);
#ifdef MEMTUNE_CUDA
  if (ready_) cuda_wait_on_current_stream(ready_, device_);
#endif
  at::Tensor out = std::move(device_copy_);
  *this = OffloadedTensor();
  return out;
}

}  // namespace memtune
