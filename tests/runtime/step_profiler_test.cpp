// MEMTUNE_PROFILE=STEP:FILE: the asked-for step's ops land in a Chrome trace; a malformed
// value is a clear error naming the variable and the expected form.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <link.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "runtime/error.h"
#include "runtime/step_profiler.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

struct ProfileEnv {
  explicit ProfileEnv(const std::string& v) { setenv("MEMTUNE_PROFILE", v.c_str(), 1); }
  ~ProfileEnv() { unsetenv("MEMTUNE_PROFILE"); }
};

TEST(StepProfiler, WritesATraceOfTheAskedStepOnly) {
  const fs::path file = temp_dir() / "trace.json";
  ProfileEnv env("2:" + file.string());
  StepProfiler p;
  p.begin(1);
  (void)at::ones({4, 4}).mm(at::ones({4, 4}));
  p.end();
  EXPECT_FALSE(fs::exists(file));  // step 1 was not asked for
  p.begin(2);
  (void)at::ones({8, 8}).mm(at::ones({8, 8}));
  p.end();
  ASSERT_TRUE(fs::exists(file));
  std::ifstream in(file);
  const auto trace = nlohmann::json::parse(in);
  const auto& events = trace.is_array() ? trace : trace.at("traceEvents");
  int mm = 0;
  for (const auto& e : events)
    if (e.value("name", "") == "aten::mm") ++mm;
  EXPECT_GE(mm, 1);
}

// Whether this process has CUPTI loaded (LibTorch's Kineto links it where it has it).
bool cupti_loaded() {
  bool found = false;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name && std::strstr(info->dlpi_name, "libcupti")) *static_cast<bool*>(data) = true;
        return 0;
      },
      &found);
  return found;
}

// On a GPU the trace has the kernels too (Kineto with CUPTI), beside the host's op.
TEST(StepProfiler, OnTheGpuTheTraceHasTheKernels_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const fs::path file = temp_dir() / "trace-cuda.json";
  ProfileEnv env("1:" + file.string());
  const at::Tensor a = at::ones({256, 256}, at::TensorOptions().device(at::kCUDA));
  StepProfiler p;
  p.begin(1, /*cuda_device=*/0);
  (void)a.mm(a);
  p.end();
  if (!cupti_loaded()) GTEST_SKIP() << "this LibTorch's Kineto has no CUPTI (Debian's libtorch-cuda): no kernels";
  ASSERT_TRUE(fs::exists(file));
  std::ifstream in(file);
  const auto trace = nlohmann::json::parse(in);
  const auto& events = trace.is_array() ? trace : trace.at("traceEvents");
  int mm = 0, kernels = 0;
  for (const auto& e : events) {
    if (e.value("name", "") == "aten::mm") ++mm;
    if (e.value("cat", "") == "kernel") ++kernels;
  }
  EXPECT_GE(mm, 1);
  EXPECT_GE(kernels, 1);  // the product's GEMM, as the GPU ran it
}

// scripts/profile_summary.py on a trace shaped as Kineto writes a GPU run's: the host's ops
// (launch calls and the recording's span left out), then the kernels by name and the share
// of the span they cover. Kernels at [10,30] and [25,35] ms overlap (two streams), a copy at
// [50,60]: busy 35 of 50 ms.
TEST(StepProfiler, SummaryOfAGpuTraceGivesKernelTimesAndTheBusyShare) {
  const fs::path file = temp_dir() / "gpu-trace.json";
  write_file(file, R"json({"traceEvents": [
    {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 0, "dur": 60000, "pid": "Spans", "tid": 1},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10000, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 2000, "dur": 5000, "pid": 1, "tid": 1},
    {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 10000, "dur": 20000, "pid": 0, "tid": 7},
    {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 25000, "dur": 10000, "pid": 0, "tid": 8},
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 50000, "dur": 10000, "pid": 0, "tid": 7}]})json");
  const CommandResult r =
      run(python() + " " + (source_dir() / "scripts" / "profile_summary.py").string() + " " + file.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Neither the launch nor the recording's own span is an op.
  EXPECT_NE(r.output.find("(traced 10.0 ms)"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("cudaLaunchKernel"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("PyTorch Profiler"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3 kernels, copies and fills, 40.0 ms in all"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("busy 35.0 ms of the 50.0 ms from the first to the last (70 %)"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("     30.0   75.0      2  gemm_a"), std::string::npos) << r.output;
}

TEST(StepProfiler, MalformedValuesAreRefused) {
  for (const char* bad : {"trace.json", "0:trace.json", "x:trace.json", "3:", "-1:t.json"}) {
    SCOPED_TRACE(bad);
    ProfileEnv env(bad);
    try {
      StepProfiler p;
      ADD_FAILURE() << "accepted";
    } catch (const UserError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("MEMTUNE_PROFILE='" + std::string(bad) + "'"), std::string::npos) << m;
      EXPECT_NE(m.find("STEP:FILE"), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace memtune::testing
