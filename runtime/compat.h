#pragma once
// Every difference between the LibTorch versions memtune builds against (Debian's 1.13,
// CPU only, and official 2.x with CUDA) lives here, and nowhere else (STYLE.md rule 12).
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/api/include/torch/version.h>

#include <exception>
#include <string>

#define MEMTUNE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention arrived in 2.0.
#define MEMTUNE_HAS_SDPA MEMTUNE_TORCH_AT_LEAST(2, 0)

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

namespace memtune::compat {

inline std::string torch_version() { return TORCH_VERSION; }

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
