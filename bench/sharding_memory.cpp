// Per-rank memory and traffic of distributed.sharding, measured: W = 1, 2, 3 processes of
// this program join a Gloo group on 127.0.0.1, build the same model (random weights), and
// run one training step the way the trainer does (forward, Sharding's backward, which under
// `gradients` and `full` reduces each bucket to its owner as backward completes it,
// reduce_gradients, check_gradients, step). Each rank reports, from the CPU budget
// allocator: its optimizer state, the gradients after backward, what stays of them after the
// reduction (with the reduction's own buffers), the sharding buffer and the step's peak; and
// the bytes it sent, as ProcessGroup::sent_bytes counts them, next to the bytes the process
// wrote through write/writev during the collectives (/proc/self/io wchar: Gloo's sockets,
// the yardstick of that count). The table shows the largest rank's figures. Under `full`
// the layers' weights, frozen and trainable, are sharded too (trainer/layer_shards.h): the
// weights column is what the rank keeps, and the forward and backward gather each layer,
// so their bytes count in the step's traffic. Every layer is checkpointed at every level,
// as `full` must, so the levels compare.
// Usage: bench_sharding_memory [MODEL_SUBSTRING]
//   (models: M QLoRA, M full, GPT-2 124M QLoRA, GPT-2 124M full)
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "data/batch.h"
#include "models/causal_lm.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/dist_env.h"
#include "runtime/error.h"
#include "runtime/process_group.h"
#include "runtime/threads.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/grad_scaler.h"
#include "trainer/layer_shards.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"
#include "trainer/sharding.h"

using namespace memtune;
using nlohmann::json;

namespace {

struct Model {
  std::string name;
  std::vector<std::string> overrides;
  bool m_shape = false;  // the M model of docs/performance.md (12 layers, hidden 768, vocab 32000)
};

const std::vector<Model>& bench_models() {
  static const std::vector<Model> all = {
      {"M QLoRA r16", {"model.name_or_path=tiny-llama", "model.quantization_config.load_in_4bit=true",
                       "model.quantization_config.bnb_4bit_use_double_quant=true",
                       "model.quantization_config.bnb_4bit_quant_type=nf4", "lora.r=16",
                       "lora.target_modules=all-linear"}, true},
      {"M full", {"model.name_or_path=tiny-llama", "training.finetune=full"}, true},
      {"GPT-2 124M QLoRA", {"model.name_or_path=gpt2", "model.quantization_config.load_in_4bit=true",
                            "model.quantization_config.bnb_4bit_use_double_quant=true",
                            "model.quantization_config.bnb_4bit_quant_type=nf4", "lora.r=16",
                            "lora.target_modules=all-linear"}, false},
      {"GPT-2 124M full", {"model.name_or_path=gpt2", "training.finetune=full"}, false},
  };
  return all;
}

models::ModelSpec spec_of(const Model& m, const trainer::Config& c) {
  models::ModelSpec s = trainer::model_spec(c);
  if (m.m_shape) {
    s.num_layers = 12;
    s.hidden_size = 768;
    s.num_heads = 12;
    s.num_kv_heads = 12;
    s.head_dim = 64;
    s.intermediate_size = 2048;
    s.vocab_size = 32000;
  }
  return s;
}

int64_t wchar() {
  std::ifstream in("/proc/self/io");
  std::string key;
  int64_t v = 0;
  while (in >> key >> v)
    if (key == "wchar:") return v;
  return -1;
}

data::Sample row(int64_t T, int64_t V, int64_t seed) {
  data::Sample s;
  for (int64_t t = 0; t < T; ++t) {
    s.input_ids.push_back(static_cast<int32_t>((seed * 7919 + t * 31) % V));
    s.targets.push_back(static_cast<int32_t>((seed * 104729 + t * 17 + 3) % V));
    s.position_ids.push_back(static_cast<int32_t>(t));
    s.segment_ids.push_back(0);
  }
  return s;
}

// One rank: prints its JSON line.
int worker(const Model& m, const std::string& level) {
  install_cpu_budget_allocator();
  trainer::Config c = trainer::parse_config("{}", "bench", m.overrides);
  const models::ModelSpec spec = spec_of(m, c);
  std::unique_ptr<models::CausalLM> model = models::init_random_model(spec, 0);
  const auto& q = c.model.quantization_config;
  if (q.load_in_4bit)
    for (models::Linear* l : model->linears()) l->quantize(q.blocksize, q.bnb_4bit_use_double_quant, trainer::quant_type(q));
  model->set_compute_dtype(at::kFloat);
  at::manual_seed(c.training.seed);
  if (c.training.finetune == "lora")
    models::apply_lora(*model, trainer::lora_options(c.lora), trainer::lora_targets(c.lora, spec.model_type));
  else
    models::make_all_trainable(*model);
  const auto params = model->trainable_parameters();
  const DistEnv env = DistEnv::from_environment();
  std::unique_ptr<ProcessGroup> pg;
  if (env.world_size > 1) {
    ProcessGroupOptions po;
    po.timeout_s = 600;
    po.join_timeout_s = 600;
    pg = std::make_unique<ProcessGroup>(env, po);
  }
  trainer::dynamic_map(true);
  trainer::dynamic_map(false);
  std::unique_ptr<trainer::LayerShards> layer_shards;
  if (pg && trainer::shard_level(level) == trainer::ShardLevel::full)
    layer_shards = std::make_unique<trainer::LayerShards>(*model, *pg);
  const int64_t a0 = cpu_allocated_bytes();  // the model as this rank keeps it
  std::vector<bool> on_demand;  // the layers' trainable tensors under full: with their owners only
  for (const auto& [name, p] : params) on_demand.push_back(layer_shards && layer_shards->holds(p));
  trainer::Sharding sharding(trainer::shard_level(level), pg.get(), params, int64_t{25} << 20, on_demand);
  const int64_t a1 = cpu_allocated_bytes();
  trainer::OptimizerOptions oo;  // adamw
  trainer::Optimizer optimizer(params, oo, sharding.owned());
  const int64_t a2 = cpu_allocated_bytes();

  reset_cpu_peak();
  const std::vector<int64_t> sent0 = pg ? pg->sent_bytes() : std::vector<int64_t>{};
  const int64_t w0 = wchar();
  {
    std::vector<data::Sample> samples = {row(128, spec.vocab_size, env.rank)};
    data::Batch batch = data::collate(samples, 8, 0);
    models::ForwardOptions fo;
    fo.training = true;
    fo.checkpoint_layers.assign(static_cast<size_t>(spec.num_layers), true);  // as full must, at every level
    models::ForwardOutput out = model->forward(batch, fo);
    // With its reductions in backward under `gradients` and `full` (ZeRO-2), as the trainer runs it.
    sharding.backward(out.loss_sum / static_cast<double>(batch.target_tokens), /*host_gradients=*/false);
  }
  const int64_t after_backward = cpu_allocated_bytes() - a2;
  at::Tensor extra = at::zeros({2}, at::kDouble);
  const trainer::GradScaler fp32(false);
  sharding.reduce_gradients(params, extra, fp32);
  const int64_t after_reduce = cpu_allocated_bytes() - a2;
  auto [skip, norm] = sharding.check_gradients(fp32, params);
  sharding.step(optimizer, 1e-4, norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0);
  const int64_t written = wchar() - w0;
  const int64_t peak = cpu_peak_bytes();
  const std::vector<int64_t> sent1 = pg ? pg->sent_bytes() : std::vector<int64_t>{};
  int64_t n = 0;
  for (const auto& [name, p] : params) n += p.numel();
  json j = {{"rank", env.rank},
            {"world", env.world_size},
            {"level", level},
            {"trainable", n},
            {"weights", a0},
            {"state", a2 - a1},
            {"buffer", a1 - a0},
            {"grads_backward", after_backward},
            {"grads_update", after_reduce},
            {"peak", peak},
            {"sent", pg ? sent1[env.rank] - sent0[env.rank] : 0},
            {"wchar", written},
            {"norm", norm}};
  std::printf("%s\n", j.dump().c_str());
  if (pg) pg->barrier();
  return 0;
}

std::vector<json> launch(size_t model, const std::string& level, int world) {
  const std::string self = std::string(realpath("/proc/self/exe", nullptr));
  const std::string dir = "/tmp/bench_sharding_" + std::to_string(getpid());
  std::system(("mkdir -p " + dir).c_str());
  const int port = free_tcp_port();
  std::string cmd;
  for (int r = 0; r < world; ++r)
    cmd += str_cat("BENCH_SHARDING_MODEL=", model, " BENCH_SHARDING_LEVEL=", level, " RANK=", r, " WORLD_SIZE=", world,
                   " LOCAL_RANK=", r, " LOCAL_WORLD_SIZE=", world, " MASTER_ADDR=127.0.0.1 MASTER_PORT=", port,
                   " OMP_NUM_THREADS=1 ", self, " > ", dir, "/rank", r, ".json 2> ", dir, "/rank", r, ".log & ");
  cmd += "wait";
  std::system(cmd.c_str());
  std::vector<json> rows;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(str_cat(dir, "/rank", r, ".json"));
    std::string line, last;
    while (std::getline(in, line))
      if (!line.empty() && line.front() == '{') last = line;
    if (last.empty()) {
      std::ifstream log(str_cat(dir, "/rank", r, ".log"));
      std::stringstream ss;
      ss << log.rdbuf();
      std::fprintf(stderr, "rank %d of %d failed:\n%s\n", r, world, ss.str().c_str());
      std::exit(1);
    }
    rows.push_back(json::parse(last));
  }
  std::system(("rm -rf " + dir).c_str());
  return rows;
}

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  if (const char* m = std::getenv("BENCH_SHARDING_MODEL"))
    return worker(bench_models().at(static_cast<size_t>(std::atoi(m))), std::getenv("BENCH_SHARDING_LEVEL"));
  const std::string filter = argc > 1 ? argv[1] : "";
  std::printf("%-16s %2s %-9s | %10s %10s %10s %10s %10s %10s | %12s %12s\n", "model", "W", "sharding", "weights",
              "opt state", "grads bwd", "grads upd", "buffer", "step peak", "sent/step", "wchar/step");
  for (size_t i = 0; i < bench_models().size(); ++i) {
    const Model& m = bench_models()[i];
    if (!filter.empty() && m.name.find(filter) == std::string::npos) continue;
    for (int w : {1, 2, 3})
      for (const char* level : {"none", "optimizer", "gradients", "full"}) {
        if (w == 1 && std::string(level) != "none") continue;
        const std::vector<json> rows = launch(i, level, w);
        auto most = [&](const char* key) {
          int64_t v = 0;
          for (const auto& r : rows) v = std::max(v, r[key].get<int64_t>());
          return v;
        };
        std::printf("%-16s %2d %-9s | %10.2f %10.2f %10.2f %10.2f %10.2f %10.2f | %12.3f %12.3f\n", m.name.c_str(), w,
                    level, mib(most("weights")), mib(most("state")), mib(most("grads_backward")), mib(most("grads_update")), mib(most("buffer")),
                    mib(most("peak")), mib(most("sent")), mib(most("wchar")));
        std::fflush(stdout);
        std::fprintf(stderr, "%s W=%d %s: %s\n", m.name.c_str(), w, level, json(rows).dump().c_str());
      }
  }
  std::printf("MiB per rank, the largest rank; trainable fp32, AdamW; one step of 1 x 128 tokens (every layer "
              "checkpointed). weights: the model and adapters as the rank keeps them; opt state: the "
              "optimizer's allocation; grads bwd / upd: gradients held after backward / after the reduction (with "
              "the reduction's buffers); sent: ProcessGroup::sent_bytes; wchar: bytes written by the process during "
              "the collectives (/proc/self/io)\n");
  return 0;
}
