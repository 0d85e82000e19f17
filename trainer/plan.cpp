#include "trainer/plan.h"

#include <algorithm>

#include "models/causal_lm.h"
#include "runtime/error.h"
#include "trainer/estimate.h"
#include "trainer/model_setup.h"
#include "trainer/optimizer.h"

namespace memtune::trainer {

PlanCostModel plan_cost_model(const std::string& kind) {
  MEMTUNE_CHECK(kind == "cpu" || kind == "gpu", "plan cost model '", kind, "': expected cpu or gpu");
  if (kind == "cpu") {
    // The 2-vCPU AMD EPYC of docs/performance.md: fp32 matmul peak 219 GFLOP/s
    // (bench_matmul_peak), training steps at 36-72 % of it, so 100 GFLOP/s; memcpy 13-15
    // GB/s measured there on warm pages, less when the copy's fresh host pages fault in.
    // The per-micro-batch cost (every layer's weights read, NF4 dequantized, threads started
    // whatever the rows): M QLoRA ran 300 tokens/s at micro-batch 1 x 256 tokens
    // (bench/ladder_rungs.py) and 336 at 2 x 256 (bench/train_vs_peer.py), which
    // (1 + k/256) / (1 + k/512) = 1.12 puts near k = 64. The CPU is both device and host:
    // offloaded optimizer states are updated where they are.
    return {"cpu", 100e9, 10e9, 64, true};
  }
  // A data-centre GPU: about 200 TFLOP/s achieved in bf16 (H100 SXM peaks at 989 dense, A100
  // at 312); host copies over PCIe 4.0 x16 at 25 GB/s (32 GB/s each way in theory, about 25
  // measured for pinned memory by CUDA's bandwidthTest). k: below about 300 rows a matmul
  // waits on reading its bf16 weights, not on arithmetic (H100: 989 TFLOP/s over 3.35 TB/s
  // of HBM3 = 295 FLOP per byte, 2 FLOP per weight per row, 2 bytes a weight), and every
  // micro-batch launches the same kernels: k = 256.
  return {"gpu", 200e12, 25e9, 256, false};
}

PlanCostModel plan_cost_model(const Config& c) {
  return plan_cost_model(resolve_device(c.runtime.device).is_cpu() ? "cpu" : "gpu");
}

namespace {

// Forward FLOPs per token: each decoder layer's (2 per weight of its projections, plus
// attention's scores and weighted values under the causal mask, 2 x T x q_dim) and the
// head's (2 V C). Walks the model's own tensor list, so any registered architecture counts.
struct Work {
  std::vector<double> layer;  // per token, forward
  double head = 0;            // per token, forward
  double all() const {
    double s = head;
    for (double l : layer) s += l;
    return s;
  }
};

Work forward_work(const models::CausalLM& structure, int64_t seq_length) {
  const models::ModelSpec& spec = structure.spec();
  Work w;
  w.layer.assign(static_cast<size_t>(spec.num_layers), 2.0 * static_cast<double>(seq_length) * spec.q_dim());
  for (const auto& slot : structure.tensors()) {
    if (slot.role != models::TensorRole::kLinearWeight || slot.layer < 0) continue;
    double n = 1;
    for (int64_t d : slot.shape) n *= static_cast<double>(d);
    w.layer[slot.layer] += 2 * n;
  }
  w.head = 2.0 * static_cast<double>(spec.vocab_size) * static_cast<double>(spec.hidden_size);
  return w;
}

// One configuration: the effective batch's split and the savings that are on.
struct Shape {
  int64_t micro_batch = 1;
  int64_t accumulation = 1;
  CheckpointingConfig checkpointing;
  bool activation_offload = false;
  bool optimizer_offload = false;
};

struct Planner {
  Planner(const Config& config, const models::ModelSpec& model_spec, int64_t ranks, const PlanCostModel& cost,
          const data::DatasetStats* data)
      : c(config), spec(model_spec), world_size(ranks), model(cost) {
    OptimizerOptions oo;
    set_optimizer_kind(config.training.optim, oo);
    optimizer_pages = oo.paged;
    // The configured run's input, built once (with the model's structure); plans change
    // only the micro-batch and the savings.
    base = estimate_input(config, spec, config.training.per_device_train_batch_size);
    if (data) base = fit_to_data(base, *data);
    base.world_size = world_size;
    seq_length = base.seq_length;
    work = forward_work(*base.model, seq_length);
    // The states' device bytes when not offloaded: what offload copies out and back each step.
    EstimateInput in = base;
    in.optimizer_paged = false;
    const Estimate kept = estimate_memory(in);
    optimizer_state_bytes = kept.optimizer_states;
    gradient_bytes = kept.gradients;
  }

  EstimateInput input(int64_t micro_batch) const {
    EstimateInput in = base;
    in.micro_batch = micro_batch;
    return in;
  }

  // `in` (at s.micro_batch) with the shape's savings.
  EstimateInput with(EstimateInput in, const Shape& s) const {
    in.samples_per_step = s.micro_batch * s.accumulation;  // gradients held across micro-batches
    in.checkpoint_layers = checkpoint_plan(s.checkpointing, in.num_layers);
    in.offload_activations = s.activation_offload;
    in.optimizer_paged = optimizer_pages || s.optimizer_offload;
    in.gradients_offloaded = s.optimizer_offload;
    return in;
  }

  // A step's predicted time by the cost model, in seconds (only ratios of it are shown).
  double seconds(EstimateInput in, const Shape& s) const {
    const double tokens = static_cast<double>(s.micro_batch * s.accumulation * seq_length);  // per rank
    double flops = 3 * tokens * work.all();  // forward, and backward at twice the forward
    for (size_t i = 0; i < in.checkpoint_layers.size(); ++i)
      if (in.checkpoint_layers[i]) flops += kRecomputeShare * 3 * tokens * work.layer[i];
    flops *= 1 + model.micro_batch_overhead / static_cast<double>(s.micro_batch * seq_length);
    double bytes = 0;
    if (in.offload_activations) {
      // Each checkpointed layer's input goes to host memory in forward and comes back for its
      // recompute: twice the bytes it would keep on the device, per micro-batch.
      in.offload_activations = false;
      const Estimate kept = estimate_memory(in);
      for (size_t i = 0; i < kept.activations_per_layer.size(); ++i)
        if (in.checkpoint_layers[i]) bytes += 2.0 * static_cast<double>(kept.activations_per_layer[i]) * s.accumulation;
    }
    // Offloaded states stream to the device and back for each step's update (not on the CPU,
    // where the update reads them where they are).
    if (in.optimizer_paged && !model.host_is_device) bytes += 2.0 * static_cast<double>(optimizer_state_bytes);
    // Offloaded gradients go to the host once per micro-batch, the updated weights come back.
    if (in.gradients_offloaded && !model.host_is_device && gradient_offload_applies(c, world_size))
      bytes += static_cast<double>(gradient_bytes) * static_cast<double>(s.accumulation + 1);
    return flops / model.flops_per_second + bytes / model.host_bytes_per_second;
  }

  const Config& c;
  const models::ModelSpec& spec;
  int64_t world_size;
  PlanCostModel model;
  bool optimizer_pages = false;  // training.optim keeps its states in host memory (paged_*)
  EstimateInput base;            // the configured run's estimate input
  int64_t seq_length = 0;
  Work work;
  int64_t optimizer_state_bytes = 0;
  int64_t gradient_bytes = 0;  // every trainable tensor's, fp32
};

std::string checkpointing_value(const CheckpointingConfig& g) {
  if (g.policy == "none") return "false";
  if (g.policy == "all") return "true";
  return str_cat("{policy: every_n, n: ", g.n, "}");
}

bool same_checkpointing(const CheckpointingConfig& a, const CheckpointingConfig& b) {
  return a.policy == b.policy && (a.policy != "every_n" || a.n == b.n) && (a.policy != "layers" || a.layers == b.layers);
}

}  // namespace

std::vector<std::string> plan_overrides(const Config& c, const Plan& p) {
  std::vector<std::string> out;
  if (p.micro_batch != c.training.per_device_train_batch_size)
    out.push_back(str_cat("training.per_device_train_batch_size=", p.micro_batch));
  if (p.accumulation != c.training.gradient_accumulation_steps)
    out.push_back(str_cat("training.gradient_accumulation_steps=", p.accumulation));
  if (!same_checkpointing(p.checkpointing, c.training.gradient_checkpointing))
    out.push_back("training.gradient_checkpointing=" + checkpointing_value(p.checkpointing));
  if (p.activation_offload != (c.training.activation_offload == "checkpoints"))
    out.push_back(str_cat("training.activation_offload=", p.activation_offload ? "checkpoints" : "false"));
  if (p.optimizer_offload != (c.memory.optimizer_offload == "cpu"))
    out.push_back(str_cat("memory.optimizer_offload=", p.optimizer_offload ? "cpu" : "none"));
  return out;
}

std::vector<Plan> candidate_plans(const Config& c, const models::ModelSpec& spec, int64_t world_size,
                                  const data::DatasetStats* data) {
  return candidate_plans(c, spec, world_size, plan_cost_model(c), data);
}

std::vector<Plan> candidate_plans(const Config& c, const models::ModelSpec& spec, int64_t world_size,
                                  const PlanCostModel& model, const data::DatasetStats* data) {
  MEMTUNE_CHECK(c.training.per_device_train_batch_size != TrainingConfig::kAuto,
                "training.per_device_train_batch_size: auto: a plan keeps the effective batch "
                "(per_device_train_batch_size x gradient_accumulation_steps), which auto leaves to the run; "
                "set per_device_train_batch_size to a number");
  const Planner planner(c, spec, world_size, model, data);
  const int64_t effective = int64_t{c.training.per_device_train_batch_size} * c.training.gradient_accumulation_steps;
  const int64_t layers = spec.num_layers;

  std::vector<CheckpointingConfig> policies;
  policies.push_back({});  // none
  for (int n : {4, 3, 2})
    if (n < layers) {
      CheckpointingConfig g;
      g.policy = "every_n";
      g.n = n;
      policies.push_back(g);
    }
  CheckpointingConfig all;
  all.policy = "all";
  policies.push_back(all);

  // The configured run, the yardstick of relative_time (its policy may be one not enumerated).
  Shape configured;
  configured.micro_batch = c.training.per_device_train_batch_size;
  configured.accumulation = c.training.gradient_accumulation_steps;
  configured.checkpointing = c.training.gradient_checkpointing;
  configured.activation_offload = c.training.activation_offload == "checkpoints";
  configured.optimizer_offload = c.memory.optimizer_offload == "cpu";
  const double reference = planner.seconds(planner.with(planner.input(configured.micro_batch), configured), configured);

  std::vector<Plan> plans;
  for (int64_t m = 1; m <= effective; ++m) {
    if (effective % m != 0) continue;
    const EstimateInput in = planner.input(m);
    for (const CheckpointingConfig& g : policies)
      for (bool act : {false, true}) {
        if (act && !g.enabled()) continue;  // activation offload moves checkpointed layers' inputs
        for (bool opt : {false, true}) {
          if (opt && planner.optimizer_pages) continue;  // a paged optimizer's states are in host memory already
          const Shape s{m, effective / m, g, act, opt};
          const EstimateInput planned = planner.with(in, s);
          Plan p;
          p.micro_batch = s.micro_batch;
          p.accumulation = s.accumulation;
          p.checkpointing = g;
          p.activation_offload = act;
          p.optimizer_offload = opt;
          p.peak_bytes = estimate_peak(planned);
          p.relative_time = planner.seconds(planned, s) / reference;
          p.configured = m == configured.micro_batch && same_checkpointing(g, configured.checkpointing) &&
                         act == configured.activation_offload && opt == configured.optimizer_offload;
          plans.push_back(p);
        }
      }
  }
  std::stable_sort(plans.begin(), plans.end(), [](const Plan& a, const Plan& b) {
    return a.relative_time != b.relative_time ? a.relative_time < b.relative_time : a.peak_bytes < b.peak_bytes;
  });
  return plans;
}

std::vector<Plan> fitting_plans(const std::vector<Plan>& candidates, int64_t budget) {
  std::vector<Plan> out;
  for (const Plan& p : candidates)
    if (p.peak_bytes <= budget && (out.empty() || p.peak_bytes < out.back().peak_bytes)) out.push_back(p);
  return out;
}

const Plan& smallest_plan(const std::vector<Plan>& candidates) {
  MEMTUNE_INTERNAL_ASSERT(!candidates.empty(), "no candidate plans");
  // min_element keeps the first of equal peaks: the faster, the candidates being by time.
  return *std::min_element(candidates.begin(), candidates.end(),
                           [](const Plan& a, const Plan& b) { return a.peak_bytes < b.peak_bytes; });
}

}  // namespace memtune::trainer
