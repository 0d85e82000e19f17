#pragma once
// The CUDA memory backend (runtime/cuda/cuda_memory.cpp, built only with CUDA). memory.cpp
// reaches it through these two functions, and only under MEMTUNE_CUDA.
#include <memory>

#include "runtime/memory.h"

namespace memtune {

int cuda_memory_device_count();  // 0 when no driver or device
int cuda_memory_current_device();
std::unique_ptr<MemoryBackend> make_cuda_memory_backend(int index);

}  // namespace memtune
