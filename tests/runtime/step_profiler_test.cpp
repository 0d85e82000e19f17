// MEMTUNE_PROFILE=STEP:FILE: the asked-for step's ops land in a Chrome trace; a malformed
// value is a clear error naming the variable and the expected form.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <link.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "models/model_spec.h"
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

// The GPU's time by where each kernel was launched (Kineto links a kernel to its launch by
// `correlation`): the innermost memtune scope or backward node around the launch, and the op
// inside it. A GEMM under memtune::q_proj's aten::mm (4 ms) and a kernel q_proj launched
// itself (1), a residual add in the layer (0.5), a backward node's GEMM (3), a checkpointed
// q_proj rerun inside a backward node (2), and a copy with no launch in the trace (1).
TEST(StepProfiler, SummaryOfAGpuTraceGivesTheTimeOfEachScope) {
  const fs::path file = temp_dir() / "gpu-scopes.json";
  write_file(file, R"json({"traceEvents": [
 {"ph": "X", "cat": "cpu_op", "name": "memtune::layer", "ts": 0, "dur": 20000, "pid": 1, "tid": 1},
 {"ph": "X", "cat": "cpu_op", "name": "memtune::q_proj", "ts": 1000, "dur": 9000, "pid": 1, "tid": 1},
 {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 2000, "dur": 4000, "pid": 1, "tid": 1},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 3000, "dur": 500, "pid": 1, "tid": 1, "args": {"correlation": 11}},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 7000, "dur": 500, "pid": 1, "tid": 1, "args": {"correlation": 12}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 12000, "dur": 2000, "pid": 1, "tid": 1},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12500, "dur": 500, "pid": 1, "tid": 1, "args": {"correlation": 13}},
 {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: LoraLinearFunctionBackward", "ts": 30000, "dur": 10000, "pid": 1, "tid": 2},
 {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 31000, "dur": 3000, "pid": 1, "tid": 2},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 31500, "dur": 500, "pid": 1, "tid": 2, "args": {"correlation": 14}},
 {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: CheckpointFunctionBackward", "ts": 45000, "dur": 10000, "pid": 1, "tid": 2},
 {"ph": "X", "cat": "cpu_op", "name": "memtune::q_proj", "ts": 46000, "dur": 5000, "pid": 1, "tid": 2},
 {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 47000, "dur": 2000, "pid": 1, "tid": 2},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 47500, "dur": 500, "pid": 1, "tid": 2, "args": {"correlation": 15}},
 {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 4000, "dur": 4000, "pid": 0, "tid": 7, "args": {"correlation": 11}},
 {"ph": "X", "cat": "kernel", "name": "lora_add", "ts": 8000, "dur": 1000, "pid": 0, "tid": 7, "args": {"correlation": 12}},
 {"ph": "X", "cat": "kernel", "name": "add", "ts": 13000, "dur": 500, "pid": 0, "tid": 7, "args": {"correlation": 13}},
 {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 32000, "dur": 3000, "pid": 0, "tid": 7, "args": {"correlation": 14}},
 {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 48000, "dur": 2000, "pid": 0, "tid": 7, "args": {"correlation": 15}},
 {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 60000, "dur": 1000, "pid": 0, "tid": 7}]})json");
  const CommandResult r =
      run(python() + " " + (source_dir() / "scripts" / "profile_summary.py").string() + " " + file.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* line : {"(5 of 6 linked to their launch)",
                           "      5.0   43.5      2  memtune::q_proj\n",
                           "      3.0   26.1      1  backward: LoraLinearFunctionBackward\n",
                           "      2.0   17.4      1  memtune::q_proj (rerun in backward)\n",
                           "      1.0    8.7      1  (no launch in the trace)\n",
                           "      0.5    4.3      1  memtune::layer\n",
                           "      4.0   34.8      1  memtune::q_proj / aten::mm\n",
                           "      1.0    8.7      1  memtune::q_proj / (its own kernels)\n",
                           "      0.5    4.3      1  memtune::layer / aten::add\n",
                           "      3.0   26.1      1  backward: LoraLinearFunctionBackward / aten::mm\n",
                           "      2.0   17.4      1  memtune::q_proj (rerun in backward) / aten::mm\n"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << " in\n" << r.output;
}

// A model's forward and backward in the trace: each projection under its kind's name as
// Hugging Face's modules name it (every layer's q_proj is one row), inside its layer; the
// attention, norms, rotary, SwiGLU, embedding and loss as theirs; a checkpointed layer's
// projections again in backward, where it reruns.
TEST(StepProfiler, AModelsStepIsTracedUnderMemtunesScopes) {
  const fs::path file = temp_dir() / "model-trace.json";
  auto model = models::init_random_model(*models::preset("tiny-llama"), 3);
  models::LoraOptions lora;
  lora.r = 4;
  models::apply_lora(*model, lora, {});
  std::vector<data::Sample> samples(2);
  for (auto& s : samples)
    for (int32_t t = 0; t < 16; ++t) {
      s.input_ids.push_back(t + 1);
      s.targets.push_back(t + 2);
      s.position_ids.push_back(t);
      s.segment_ids.push_back(0);
    }
  const data::Batch batch = data::collate(samples, 1, 0);
  models::ForwardOptions fo;
  fo.training = true;
  fo.checkpoint_layers.assign(model->num_layers(), false);
  fo.checkpoint_layers[0] = true;
  {
    ProfileEnv env("1:" + file.string());
    StepProfiler p;
    p.begin(1, -1);
    model->forward(batch, fo).loss_sum.backward();
    p.end();
  }
  std::ifstream in(file);
  const auto trace = nlohmann::json::parse(in);
  const auto& events = trace.is_array() ? trace : trace.at("traceEvents");
  std::map<std::string, std::vector<std::pair<double, double>>> spans;  // name -> [start, end)
  for (const auto& e : events)
    if (e.value("ph", "") == "X")
      spans[e.value("name", "")].push_back({e.at("ts").get<double>(), e.at("ts").get<double>() + e.at("dur").get<double>()});
  const int64_t L = model->num_layers();
  for (const char* proj : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
    EXPECT_EQ(spans["memtune::" + std::string(proj)].size(), static_cast<size_t>(L + 1)) << proj;
  EXPECT_EQ(spans["memtune::layer"].size(), static_cast<size_t>(L + 1));
  EXPECT_EQ(spans["memtune::attention"].size(), static_cast<size_t>(L + 1));
  EXPECT_EQ(spans["memtune::rotary"].size(), static_cast<size_t>(2 * (L + 1)));
  EXPECT_EQ(spans["memtune::rms_norm"].size(), static_cast<size_t>(2 * (L + 1) + 1));  // and the final norm
  EXPECT_EQ(spans["memtune::swiglu"].size(), static_cast<size_t>(L + 1));
  EXPECT_EQ(spans["memtune::embed"].size(), 1u);
  ASSERT_EQ(spans["memtune::loss"].size(), 1u);
  // Every projection inside a layer; the rerun's after the loss, in backward.
  const auto inside = [&](const std::pair<double, double>& s) {
    for (const auto& l : spans["memtune::layer"])
      if (l.first <= s.first && s.second <= l.second) return true;
    return false;
  };
  int after_loss = 0;
  for (const auto& s : spans["memtune::self_attn.q_proj"]) {
    EXPECT_TRUE(inside(s));
    after_loss += s.first >= spans["memtune::loss"][0].second;
  }
  EXPECT_EQ(after_loss, 1);
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
