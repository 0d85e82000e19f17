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

// On the CPU the legacy profiler (it writes the trace when destroyed); on a GPU Kineto,
// whose trace has a row per kernel and copy on the GPU's streams beside the host's ops.
struct StepProfiler::Recording {
  Recording(const std::string& file, bool cuda) : file(file), cuda(cuda) {
    if (!cuda) {
      legacy.emplace(file);
      return;
    }
    const ProfilerConfig config(ProfilerState::KINETO);
    const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
    torch::cuda::synchronize();  // the step's kernels only, not the previous step's tail
    kineto::prepareProfiler(config, activities);
    kineto::enableProfiler(config, activities);
  }
  ~Recording() {
    if (!cuda) return;
    try {
      torch::cuda::synchronize();  // CUPTI reports a kernel once it has run
      kineto::disableProfiler()->save(file);
    } catch (const std::exception& e) {
      spdlog::warn("MEMTUNE_PROFILE: the GPU trace could not be written to {}: {}", file, e.what());
    }
  }
  std::string file;
  bool cuda;
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

void StepProfiler::begin(int64_t step, bool cuda) {
  if (step != step_ || recording_) return;
  recording_ = std::make_unique<Recording>(file_, cuda);
}

void StepProfiler::end() {
  if (!recording_) return;
  recording_.reset();
  spdlog::info("profile of step {}: {}", step_, file_);
}

}  // namespace memtune
