#pragma once
// The NCCL backend of ProcessGroup (CUDA builds only; process_group.cpp includes this
// under MEMTUNE_CUDA).
#include <chrono>

#include <c10/util/intrusive_ptr.h>

#include "runtime/compat.h"

namespace c10d {
class Store;
}

namespace memtune {

// A ProcessGroupNCCL over `store` whose collectives abort after `timeout` (the watchdog
// tears the communicator down instead of hanging; set before the first collective).
c10::intrusive_ptr<compat::C10dBackend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int world_size, std::chrono::milliseconds timeout);

}  // namespace memtune
