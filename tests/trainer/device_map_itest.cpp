// Device maps on a CPU-only machine, exercised through a memory budget: a model whose
// weights exceed memory.device_limit trains with device_map: auto by offloading layers
// (host memory outside the budget), with the losses of the run without a limit.
// And the streaming load: every load reads tensor by tensor from the memory-mapped file (what
// low_cpu_mem_usage: true names; the config refuses false, ConfigErrors.LowCpuMemUsageFalseRefused).
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

std::vector<json> loss_rows(const fs::path& out) { return read_jsonl(out / "metrics.jsonl", "loss"); }

std::string command(const fs::path& out, const std::string& extra) {
  fs::path src = source_dir();
  // On the CPU unless told otherwise: the budget is the CPU's (a GPU machine would pick cuda).
  return memtune_bin() + " train " + (src / "configs/quickstart.yaml").string() +
         " runtime.device=cpu model.name_or_path=tiny-llama model.quantization_config.load_in_4bit=false"
         " training.output_dir=" + out.string() +
         " training.max_steps=4 training.per_device_train_batch_size=2 training.gradient_accumulation_steps=1"
         " training.gradient_checkpointing=false training.eval_steps=0 training.eval_accuracy_rows=0"
         " training.save_steps=0 training.logging_steps=1 memory.device_limit=null data.max_seq_length=64 model.tokenizer=" +
         (src / "examples/tiny-tokenizer").string() + " data.train_file=" + (src / "examples/data/tasks_train.jsonl").string() +
         " data.eval_file=null lora.r=4 lora.lora_alpha=8 data.cache_dir=" + (out.parent_path() / "cache").string() + " " + extra;
}

TEST(DeviceMap, AutoOffloadsLayersToFitABudgetSmallerThanTheWeights) {
  fs::path d = temp_dir();
  auto ref = run(command(d / "ref", ""));
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  // The dense tiny model holds 3.77 MiB of base weights: a 3.5 MiB device cannot hold them.
  const int64_t limit = 7 << 19;
  auto off = run(command(d / "off", "memory.device_limit=" + std::to_string(limit) + " model.device_map=auto"));
  ASSERT_EQ(off.exit_code, 0) << off.output;
  EXPECT_NE(off.output.find("offload"), std::string::npos) << off.output;
  auto a = loss_rows(d / "ref"), b = loss_rows(d / "off");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i]["loss"].get<double>(), b[i]["loss"].get<double>(), 1e-5) << i;
    EXPECT_LE(b[i]["memory"]["cpu"]["peak"].get<int64_t>(), limit) << i;
  }
}

TEST(DeviceMap, ExplicitMapOffloadsTheNamedLayersAndRejectsUnknownNames) {
  fs::path d = temp_dir();
  auto ok = run(command(d / "ok", "'model.device_map={model.layers.0-1: cpu, model.layers.2-3: offload}'"));
  ASSERT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_NE(ok.output.find("layers 0-1: cpu, layers 2-3: offload to cpu"), std::string::npos) << ok.output;
  auto bad = run(command(d / "bad", "'model.device_map={model.blocks.0: offload}'"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("names no module"), std::string::npos) << bad.output;
}

// On a GPU: QLoRA (fp32 compute) on cuda:0, and split over cuda:0, an offloaded layer and
// the CPU, train with the CPU run's losses; the GPU's memory shows the model is there.
TEST(DeviceMap, TrainsOnCudaAndOverCudaAndCpuWithTheCpuLosses_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  fs::path d = temp_dir();
  const std::string qlora =
      " model.quantization_config.load_in_4bit=true model.quantization_config.bnb_4bit_compute_dtype=float32";
  auto cpu = run(command(d / "cpu", qlora + " runtime.device=cpu"));
  ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
  auto gpu = run(command(d / "gpu", qlora + " runtime.device=cuda:0"));
  ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
  auto split = run(command(d / "split", qlora + " runtime.device=cuda:0 'model.device_map={model.layers.0-1: cuda:0, "
                                                "model.layers.2: offload, model.layers.3: cpu}'"));
  ASSERT_EQ(split.exit_code, 0) << split.output;
  EXPECT_NE(split.output.find("device map: embeddings cuda:0, layers 0-1: cuda:0, layer 2: offload to cuda:0, "
                              "layer 3: cpu, head cuda:0"),
            std::string::npos)
      << split.output;
  auto ref = loss_rows(d / "cpu");
  for (const char* name : {"gpu", "split"}) {
    SCOPED_TRACE(name);
    auto rows = loss_rows(d / name);
    ASSERT_EQ(rows.size(), ref.size());
    for (size_t i = 0; i < rows.size(); ++i) {
      const double want = ref[i]["loss"].get<double>();
      EXPECT_NEAR(rows[i]["loss"].get<double>(), want, 1e-3 * want) << i;
      EXPECT_GT(rows[i]["memory"]["cuda:0"]["peak"].get<int64_t>(), 1 << 20) << rows[i].dump();
    }
  }
  // The GPU's own compute dtype (auto: bf16 where the GPU has it) trains too.
  auto bf16 = run(command(d / "auto", " model.quantization_config.load_in_4bit=true runtime.device=cuda"));
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  auto rows = loss_rows(d / "auto");
  ASSERT_EQ(rows.size(), ref.size());
  EXPECT_NEAR(rows.back()["loss"].get<double>(), ref.back()["loss"].get<double>(), 0.05 * ref.back()["loss"].get<double>());
}

// `memtune quantize` has no config: this measures the loader itself, which train shares.
TEST(StreamingLoad, FourBitLoadStreamsTensorByTensor) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  // About 240 MB of fp32 weights, the largest single tensor 16 MiB.
  auto init = run(python() + " " + (source_dir() / "tests/reference/hf_reference.py").string() +
                  " init --arch llama --out " + (d / "big").string() +
                  " --layers 6 --hidden 1024 --heads 8 --kv-heads 8 --intermediate 2816 --vocab 4096 --seed 1");
  ASSERT_EQ(init.exit_code, 0) << init.output;
  int64_t file_bytes = static_cast<int64_t>(fs::file_size(d / "big/model.safetensors"));
  ASSERT_GT(file_bytes, 200LL << 20);
  // Peak resident memory of `memtune quantize`, against the same command on a tiny model.
  auto peak_kib = [&](const fs::path& model, const fs::path& out) -> int64_t {
    auto r = run("/usr/bin/time -f 'PEAK %M' " + memtune_bin() + " quantize --model " + model.string() + " --out " +
                 out.string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    size_t at = r.output.rfind("PEAK ");
    return at == std::string::npos ? -1 : std::stoll(r.output.substr(at + 5));
  };
  auto tiny = run(memtune_bin() + " init-model --preset tiny-llama --out " + (d / "tiny").string());
  ASSERT_EQ(tiny.exit_code, 0) << tiny.output;
  const int64_t base = peak_kib(d / "tiny", d / "tiny-q");
  const int64_t big = peak_kib(d / "big", d / "big-q");
  ASSERT_GT(base, 0);
  ASSERT_GT(big, 0);
  const int64_t growth = (big - base) * 1024;
  const int64_t nf4 = file_bytes * 4127 / 32000;  // about 4.127 of 32 bits
  std::printf("quantize peak RSS: %lld KiB (tiny model: %lld KiB); fp32 checkpoint %lld MiB\n",
              static_cast<long long>(big), static_cast<long long>(base), static_cast<long long>(file_bytes >> 20));
  // The 4-bit model, a copy of it while saving, the largest tensor and its transposes.
  EXPECT_LT(growth, 2 * nf4 + 4 * (16LL << 20) + (32LL << 20)) << "grew by " << (growth >> 20) << " MiB";
  EXPECT_LT(growth, file_bytes / 2);
}

}  // namespace
}  // namespace memtune::testing
