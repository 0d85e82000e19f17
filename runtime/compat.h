#pragma once
// Every difference between the LibTorch versions memtune builds against (Debian's 1.13,
// CPU only, and official 2.x with CUDA) lives here, and nowhere else (CONTRIBUTING.md,
// "GPUs and LibTorch versions").
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/version.h>

#include <cstddef>
#include <exception>
#include <string>
#include <utility>

#define MEMTUNE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention arrived in 2.0 (scaling by 1/sqrt(head size) only);
// its `scale` argument in 2.1.
#define MEMTUNE_HAS_SDPA MEMTUNE_TORCH_AT_LEAST(2, 0)
#define MEMTUNE_SDPA_HAS_SCALE MEMTUNE_TORCH_AT_LEAST(2, 1)
// Its `enable_gqa` (key and value heads shared by groups of query heads) in 2.5.
#define MEMTUNE_SDPA_HAS_GQA MEMTUNE_TORCH_AT_LEAST(2, 5)

// Headers: <ATen/ATen.h> brings <ATen/core/grad_mode.h> (at::NoGradGuard, at::AutoGradMode)
// in 1.13 only; a file using them includes it itself.

// c10::Allocator gained a pure virtual copy_data() in 2.3; allocators declare it through
// this macro so the same class compiles on both.
#if MEMTUNE_TORCH_AT_LEAST(2, 3)
#define MEMTUNE_ALLOCATOR_COPY_DATA                                               \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                          \
  }
#else
#define MEMTUNE_ALLOCATOR_COPY_DATA
#endif

// c10::Allocator::allocate() is const in 1.13 and lost its const in 2.x. Declaring both
// overloads, each forwarding to `impl`, overrides whichever one the found version has.
#define MEMTUNE_ALLOCATOR_ALLOCATE(impl)                                     \
  c10::DataPtr allocate(std::size_t n) const { return impl(n); }           \
  c10::DataPtr allocate(std::size_t n) { return impl(n); }

// CUDACachingAllocator::getDeviceStats() returns c10::cuda::CUDACachingAllocator::DeviceStats
// up to 2.4 and c10::CachingDeviceAllocator::DeviceStats from 2.5, and StatType moved from
// c10::cuda::CUDACachingAllocator to c10::CachingAllocator. The fields kept their names and
// AGGREGATE stayed index 0 of each StatArray: callers take the result as `auto` and index
// the aggregate with compat::kCudaStatAggregate.

namespace memtune::compat {

inline std::string torch_version() { return TORCH_VERSION; }

// Throws c10::OutOfMemoryError carrying `msg`. 1.13 symbolizes a backtrace eagerly when an
// error is built from a source location (milliseconds per throw), so there the error is
// built without one; from 2.2 the backtrace is lazy and C10_THROW_ERROR is cheap.
[[noreturn]] inline void throw_out_of_memory(std::string msg) {
#if MEMTUNE_TORCH_AT_LEAST(2, 2)
  C10_THROW_ERROR(OutOfMemoryError, std::move(msg));
#else
  throw c10::OutOfMemoryError(std::move(msg), std::string());
#endif
}

// Index of StatType::AGGREGATE in a CUDA caching allocator StatArray (see above).
constexpr std::size_t kCudaStatAggregate = 0;

// True for an out-of-memory error from any device: the c10 type, which 1.13 and later
// throw from the caching allocators and memtune's budget allocator, or the message of
// builds that throw a plain c10::Error / std::bad_alloc.
inline bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) return true;
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos ||
         what.find("OutOfMemory") != std::string::npos;
}

}  // namespace memtune::compat

// c10d: ProcessGroupGloo and ProcessGroupNCCL derive from c10d::ProcessGroup in 1.13 and
// from c10d::Backend since 2.0 (ProcessGroup became a dispatcher over backends). memtune
// holds the backend object directly; its collectives have the same signatures in both.
namespace c10d {
class ProcessGroup;
class Backend;
}  // namespace c10d
namespace memtune::compat {
#if MEMTUNE_TORCH_AT_LEAST(2, 0)
using C10dBackend = c10d::Backend;
#define MEMTUNE_C10D_BACKEND_HEADER <torch/csrc/distributed/c10d/Backend.hpp>
#else
using C10dBackend = c10d::ProcessGroup;
#define MEMTUNE_C10D_BACKEND_HEADER <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
}  // namespace memtune::compat
