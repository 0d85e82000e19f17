// Predicted (trainer/estimator.h) vs measured peak memory of a training step: the CPU budget
// allocator's peak over real steps run in-process the way the trainer runs them (collate,
// forward with the checkpointing plan, loss / tokens, backward, gradient norm, optimizer
// update), on configs varying architecture, layers, sequence length, micro-batch,
// checkpointing policy, quantization and fine-tuning mode. Prints the table, per phase, and
// the worst error. Usage: bench_estimator_accuracy [NAME_SUBSTRING]
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "runtime/cpu_budget_allocator.h"
#include "trainer/estimator.h"
#include "runtime/threads.h"
#include "runtime/units.h"
#include "trainer/config.h"
#include "trainer/estimate.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"

using namespace memtune;

namespace {

struct Case {
  std::string name;
  std::vector<std::string> overrides;  // config keys
  int64_t layers;
  std::function<void(models::ModelSpec&)> shape = nullptr;
};

struct Measured {
  int64_t forward = 0, backward = 0, optimizer = 0;
  int64_t kept = 0;  // allocated after the forward minus before it (batch included)
  int64_t peak() const { return std::max({forward, backward, optimizer}); }
};

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

Measured measure(const trainer::Config& c, const models::ModelSpec& spec, int steps) {
  Measured m;
  {
    // The model as trainer::setup_model builds it.
    std::unique_ptr<models::CausalLM> model = models::init_random_model(spec, 0);
    const auto& q = c.model.quantization_config;
    if (q.load_in_4bit)
      for (models::Linear* l : model->linears()) l->quantize(q.blocksize, q.bnb_4bit_use_double_quant);
    model->set_compute_dtype(at::kFloat);
    at::manual_seed(c.training.seed);
    if (c.training.finetune == "lora")
      models::apply_lora(*model, trainer::lora_options(c.lora), trainer::lora_targets(c.lora));
    else
      models::make_all_trainable(*model);
    trainer::OptimizerOptions oo;
    oo.kind = c.training.optim == "sgd" ? "sgd" : "adamw";
    trainer::Optimizer optimizer(model->trainable_parameters(), oo);
    const auto params = optimizer.params();

    std::vector<data::Sample> samples;
    const int64_t B = c.training.per_device_train_batch_size, T = c.data.max_seq_length;
    for (int64_t b = 0; b < B; ++b) samples.push_back(row(T, spec.vocab_size, b));
    models::ForwardOptions fo;
    fo.training = true;
    fo.checkpoint_layers = trainer::checkpoint_plan(c.training.gradient_checkpointing, spec.num_layers);
    for (int s = 0; s < steps; ++s) {
      optimizer.zero_grad();
      reset_cpu_peak();
      const int64_t before = cpu_allocated_bytes();
      data::Batch batch = data::collate(samples, 8, 0);
      models::ForwardOutput out = model->forward(batch, fo);
      m.kept = cpu_allocated_bytes() - before;
      m.forward = std::max(m.forward, cpu_peak_bytes());
      at::Tensor loss = out.loss_sum / static_cast<double>(batch.target_tokens);
      reset_cpu_peak();
      loss.backward();
      m.backward = std::max(m.backward, cpu_peak_bytes());
      out = models::ForwardOutput();
      loss = at::Tensor();
      batch = data::Batch();
      reset_cpu_peak();
      const double norm = trainer::grad_norm(params);
      optimizer.step(1e-4, norm > 1.0 ? 1.0 / (norm + 1e-6) : 1.0);
      m.optimizer = std::max(m.optimizer, cpu_peak_bytes());
    }
    optimizer.zero_grad();
  }
  return m;
}

double mib(int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  install_cpu_budget_allocator();
  configure_threads(0);
  const std::string filter = argc > 1 ? argv[1] : "";
  auto wide = [](models::ModelSpec& s) {
    s.hidden_size = 256;
    s.intermediate_size = 688;
    s.num_heads = 8;
    s.num_kv_heads = 4;
    s.head_dim = 32;
  };
  const std::string L = "model.name_or_path=tiny-llama", G = "model.name_or_path=tiny-gpt2";
  const std::string nf4 = "model.quantization_config.load_in_4bit=true";
  auto mb = [](int b) { return "training.per_device_train_batch_size=" + std::to_string(b); };
  auto seq = [](int t) { return "data.max_seq_length=" + std::to_string(t); };
  const std::string all = "training.gradient_checkpointing=true";
  const std::string every2 = "training.gradient_checkpointing={policy: every_n, n: 2}";
  const std::string full = "training.finetune=full";
  const std::vector<Case> cases = {
      {"llama L2 T128 B2 none dense", {L, seq(128), mb(2)}, 2},
      {"llama L4 T128 B2 none nf4", {L, nf4, seq(128), mb(2)}, 4},
      {"llama L4 T256 B2 all nf4", {L, nf4, seq(256), mb(2), all}, 4},
      {"llama L4 T256 B4 every2 nf4", {L, nf4, seq(256), mb(4), every2}, 4},
      {"llama L6 T512 B1 all dense", {L, seq(512), mb(1), all}, 6},
      {"llama L2 T512 B2 none dense", {L, seq(512), mb(2)}, 2},
      {"llama L4 T1024 B1 every2 nf4", {L, nf4, seq(1024), mb(1), every2}, 4},
      {"llama L2 T2048 B4 all nf4 (probs recomputed)", {L, nf4, seq(2048), mb(4), all}, 2},
      {"llama-wide L3 T256 B2 none nf4 q,v", {L, nf4, seq(256), mb(2), "lora.target_modules=[q_proj,v_proj]"}, 3, wide},
      {"llama full L2 T128 B2 none", {L, full, seq(128), mb(2)}, 2},
      {"llama full L4 T256 B1 all sgd", {L, full, seq(256), mb(1), all, "training.optim=sgd"}, 4},
      {"gpt2 L2 T128 B2 none dense", {G, seq(128), mb(2)}, 2},
      {"gpt2 L4 T256 B2 all dense", {G, seq(256), mb(2), all}, 4},
      {"gpt2 L4 T256 B4 every2 nf4", {G, nf4, seq(256), mb(4), every2}, 4},
      {"gpt2 L6 T512 B1 none nf4", {G, nf4, seq(512), mb(1)}, 6},
      {"gpt2 full L2 T256 B2 every2", {G, full, seq(256), mb(2), every2}, 2},
  };
  std::printf("%-46s %8s %8s | %8s %8s %8s | %8s %8s %8s | %8s %8s %7s\n", "config", "kept est", "kept", "fwd est",
              "bwd est", "opt est", "fwd", "bwd", "opt", "peak est", "peak", "error");
  double worst = 0;
  std::string worst_name;
  int n = 0;
  for (const auto& k : cases) {
    if (!filter.empty() && k.name.find(filter) == std::string::npos) continue;
    trainer::Config c = trainer::parse_config("{}", "bench", k.overrides);
    models::ModelSpec spec = trainer::model_spec(c);
    spec.num_layers = k.layers;
    if (k.shape) k.shape(spec);
    const trainer::Estimate e = estimate_memory(trainer::estimate_input(c, spec));
    const Measured m = measure(c, spec, 2);
    const double err = 100.0 * (static_cast<double>(e.peak_bytes) - m.peak()) / m.peak();
    if (std::fabs(err) > std::fabs(worst)) {
      worst = err;
      worst_name = k.name;
    }
    ++n;
    std::printf("%-46s %8.2f %8.2f | %8.2f %8.2f %8.2f | %8.2f %8.2f %8.2f | %8.2f %8.2f %+6.1f%%\n", k.name.c_str(),
                mib(e.after_forward), mib(m.kept), mib(e.forward_peak), mib(e.backward_peak), mib(e.optimizer_peak),
                mib(m.forward), mib(m.backward), mib(m.optimizer), mib(e.peak_bytes), mib(m.peak()), err);
    std::fflush(stdout);
  }
  std::printf("MiB. %d configs; worst error %+.1f%% (%s); aim: every config within +-10%%\n", n, worst,
              worst_name.c_str());
  return 0;
}
