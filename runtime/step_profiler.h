#pragma once
// Where a training step's time goes: MEMTUNE_PROFILE=STEP:FILE records every ATen op of
// step STEP (1-based) with LibTorch's profiler and writes a Chrome trace to FILE (open it
// in chrome://tracing or ui.perfetto.dev; scripts/profile_summary.py prints self times).
// A run on a CUDA device records the GPU's kernels and copies too (Kineto, as torch.profiler
// does, where LibTorch's has CUPTI): on a GPU the host's op times say when work was queued,
// not how long it ran.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/record_function.h>

// A named scope in the trace until the end of the enclosing block: the host's ops inside it
// are its children, and scripts/profile_summary.py counts the GPU's kernels launched inside
// it under the innermost such scope whose name starts "memtune::" (a const char* that
// outlives the scope). When nothing records, a check of a flag, as for every ATen op.
#define MEMTUNE_PROFILE_SCOPE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

namespace memtune {

class StepProfiler {
 public:
  // Reads MEMTUNE_PROFILE; a malformed value is a UserError naming the variable.
  StepProfiler();
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Starts recording when step is the one asked for; cuda_device: the index of the CUDA
  // device the step runs on, -1 for the CPU.
  void begin(int64_t step, int cuda_device = -1);
  void end();  // writes the trace if recording (on a GPU once its queued work has finished)

 private:
  struct Recording;
  int64_t step_ = -1;
  std::string file_;
  std::unique_ptr<Recording> recording_;
};

}  // namespace memtune
