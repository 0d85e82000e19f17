#include "runtime/cuda/process_group_nccl.h"

#include <cstdlib>

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace memtune {

c10::intrusive_ptr<compat::C10dBackend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                          int world_size, std::chrono::milliseconds timeout) {
  // Without async error handling a timed-out NCCL collective blocks forever; 1.13 reads
  // NCCL_ASYNC_ERROR_HANDLING, 2.2+ TORCH_NCCL_ASYNC_ERROR_HANDLING (both set, the user's value kept).
  setenv("NCCL_ASYNC_ERROR_HANDLING", "1", 0);
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", 0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, options);
}

}  // namespace memtune
