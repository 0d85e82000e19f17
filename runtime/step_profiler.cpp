#include "runtime/step_profiler.h"

#include <cstdlib>

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/cuda.h>

#include <optional>
#include <set>

#include "runtime/error.h"

namespace memtune {

namespace {
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;
}  // namespace

// On the CPU the legacy profiler (it writes the trace when destroyed). On a GPU Kineto, as
// torch.profiler: where LibTorch's Kineto has CUPTI (PyTorch's wheels) its trace has a row per
// kernel, copy and fill on the GPU's streams beside the host's ops; without CUPTI (Debian's
// libtorch-cuda) the host's ops only; where Kineto cannot start, the legacy profiler's trace.
struct StepProfiler::Recording {
  Recording(const std::string& file, int cuda_device) : file(file), device(cuda_device) {
    if (device >= 0) {
      try {
        const ProfilerConfig config(ProfilerState::KINETO);
        const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
        torch::cuda::synchronize(device);  // the step's kernels only, not the previous step's tail
        kineto::prepareProfiler(config, activities);
        kineto::enableProfiler(config, activities);
        on_kineto = true;
        return;
      } catch (const std::exception& e) {
        spdlog::warn("MEMTUNE_PROFILE: LibTorch's Kineto profiler did not start ({}); the trace will have the "
                     "host's ops only",
                     e.what());
      }
    }
    legacy.emplace(file);
  }
  // Writes the trace; false (with a warning saying why) when it could not.
  bool finish() {
    if (!on_kineto) {
      legacy.reset();
      return true;
    }
    try {
      torch::cuda::synchronize(device);  // CUPTI reports a kernel once it has run
    } catch (const std::exception& e) {
      spdlog::warn("MEMTUNE_PROFILE: waiting for cuda:{} failed ({}); its last kernels may be missing", device,
                   e.what());
    }
    try {
      kineto::disableProfiler()->save(file);
      return true;
    } catch (const std::exception& e) {
      spdlog::warn("MEMTUNE_PROFILE: the trace could not be written to {}: {}", file, e.what());
      return false;
    }
  }
  std::string file;
  int device;
  bool on_kineto = false;
  std::optional<torch::autograd::profiler::RecordProfile> legacy;
};

StepProfiler::StepProfiler() {
  const char* env = std::getenv("MEMTUNE_PROFILE");
  if (env == nullptr || *env == '\0') return;
  const std::string v = env;
  const auto colon = v.find(':');
  char* end = nullptr;
  const long long step = colon == std::string::npos ? 0 : std::strtoll(v.c_str(), &end, 10);
  MEMTUNE_CHECK(colon != std::string::npos && end == v.c_str() + colon && step > 0 && colon + 1 < v.size(),
                "MEMTUNE_PROFILE='", v, "': expected STEP:FILE, e.g. 5:trace.json (STEP counts from 1)");
  step_ = step;
  file_ = v.substr(colon + 1);
}

StepProfiler::~StepProfiler() = default;

void StepProfiler::begin(int64_t step, int cuda_device) {
  if (step != step_ || recording_) return;
  recording_ = std::make_unique<Recording>(file_, cuda_device);
}

void StepProfiler::end() {
  if (!recording_) return;
  const bool written = recording_->finish();
  recording_.reset();
  if (written) spdlog::info("profile of step {}: {}", step_, file_);
}

}  // namespace memtune
