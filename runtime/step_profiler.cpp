#include "runtime/step_profiler.h"

#include <cstdlib>

#include <spdlog/spdlog.h>
#include <torch/csrc/autograd/profiler_legacy.h>

#include "runtime/error.h"

namespace memtune {

struct StepProfiler::Recording {
  explicit Recording(const std::string& file) : profile(file) {}
  torch::autograd::profiler::RecordProfile profile;  // writes the trace when destroyed
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

void StepProfiler::begin(int64_t step) {
  if (step != step_ || recording_) return;
  recording_ = std::make_unique<Recording>(file_);
}

void StepProfiler::end() {
  if (!recording_) return;
  recording_.reset();
  spdlog::info("profile of step {}: {}", step_, file_);
}

}  // namespace memtune
