// The CUDA memory backend: statistics from c10's CUDA caching allocator, capacity and
// free memory from cudaMemGetInfo, the limit through the allocator's memory fraction.
// Built only with CUDA (MEMTUNE_CUDA); API differences between versions are in compat.h.
#include "runtime/cuda/cuda_memory.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>

#include "runtime/compat.h"

namespace memtune {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

class CudaBackend final : public MemoryBackend {
 public:
  explicit CudaBackend(int index) : index_(static_cast<c10::DeviceIndex>(index)) {
    // The caching allocator is set up by CUDA's lazy initialisation, which creating a
    // tensor on the device runs (the Context call for it was renamed in 2.x).
    (void)at::empty({0}, at::TensorOptions().device(c10::Device(c10::DeviceType::CUDA, index_)));
  }

  std::string device() const override { return "cuda:" + std::to_string(static_cast<int>(index_)); }

  MemoryStats stats() const override {
    // `auto`: the stats type moved namespace in 2.5 (compat.h).
    const auto st = cca::getDeviceStats(index_);
    const std::size_t agg = compat::kCudaStatAggregate;
    size_t free_b = 0, total_b = 0;
    {
      c10::cuda::CUDAGuard guard(index_);
      C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    }
    MemoryStats s;
    s.allocated = st.allocated_bytes[agg].current;
    s.reserved = st.reserved_bytes[agg].current;
    s.peak = st.allocated_bytes[agg].peak;
    s.limit = limit_.load();
    s.total = static_cast<int64_t>(total_b);
    s.free = static_cast<int64_t>(free_b);
    if (s.limit > 0) s.free = std::min(s.free, std::max<int64_t>(0, s.limit - s.reserved));
    s.alloc_count = st.allocation[agg].current;
    return s;
  }

  void set_limit(int64_t bytes) override {
    TORCH_CHECK(bytes >= 0, "CUDA memory limit must be >= 0 bytes, got ", bytes);
    const int64_t total = total_bytes();
    TORCH_CHECK(bytes <= total, "CUDA memory limit of ", bytes, " bytes exceeds ", device(),
                "'s capacity of ", total, " bytes");
    const double fraction = bytes == 0 ? 1.0 : static_cast<double>(bytes) / static_cast<double>(total);
    cca::setMemoryFraction(fraction, index_);
    limit_ = bytes;
  }

  void release_cached() override { cca::emptyCache(); }

  void reset_peak() override { cca::resetPeakStats(index_); }

 private:
  int64_t total_bytes() const {
    size_t free_b = 0, total_b = 0;
    c10::cuda::CUDAGuard guard(index_);
    C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return static_cast<int64_t>(total_b);
  }

  c10::DeviceIndex index_;
  std::atomic<int64_t> limit_{0};
};

}  // namespace

int cuda_memory_device_count() { return static_cast<int>(c10::cuda::device_count()); }

int cuda_memory_current_device() { return static_cast<int>(c10::cuda::current_device()); }

std::unique_ptr<MemoryBackend> make_cuda_memory_backend(int index) {
  return std::make_unique<CudaBackend>(index);
}

}  // namespace memtune
