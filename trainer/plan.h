#pragma once
// The fastest configurations that fit a device, keeping the math (`memtune estimate --plan`):
// every way of running the configured effective batch (micro-batch x accumulation, per
// rank) under each checkpointing policy, activation offload and optimizer offload, with the
// memory estimate's peak (trainer/estimate.h) and a predicted step time relative to the
// configured run by a small cost model (recompute, per-micro-batch overhead, host copies).
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "models/model_spec.h"
#include "trainer/config.h"

namespace memtune::trainer {

// What a step's time is made of, in the planner's model. A step's work is that of every
// token through every layer and the head, forward and backward; to it come the forward
// again of each checkpointed layer, a fixed cost per micro-batch, and the copies to and from
// host memory, which memtune does not overlap with compute.
struct PlanCostModel {
  std::string name;                   // "cpu" | "gpu", printed with the plans
  double flops_per_second = 0;        // the matmul throughput a training step achieves
  double host_bytes_per_second = 0;   // device <-> host copies (activation and optimizer offload)
  double micro_batch_overhead = 0;    // k: tokens of work each micro-batch costs beside its own
  bool host_is_device = false;        // the CPU: offloaded optimizer state is updated in place
};

// The cost model of a device kind, "cpu" or "gpu"; the constants and their sources are in
// plan.cpp.
PlanCostModel plan_cost_model(const std::string& kind);
// That of the device the config trains on (runtime.device).
PlanCostModel plan_cost_model(const Config& config);

// Share of a layer's forward+backward work that recomputing its forward costs: backward is
// about twice the forward (input and weight gradients). docs/performance.md measured
// checkpointing every layer at 0.81-0.87 of the speed (+15-23 % time), the layers being
// 70-80 % of the step's work there: 0.2-0.3 of their share.
inline constexpr double kRecomputeShare = 1.0 / 3.0;

struct Plan {
  int64_t micro_batch = 1;             // training.per_device_train_batch_size
  int64_t accumulation = 1;            // training.gradient_accumulation_steps
  CheckpointingConfig checkpointing;   // policy none | every_n (n) | all
  bool activation_offload = false;     // training.activation_offload: checkpoints
  bool optimizer_offload = false;      // memory.optimizer_offload: cpu
  int64_t peak_bytes = 0;              // the memory estimate's peak, per rank
  double relative_time = 1.0;          // predicted step time over the configured run's
  bool configured = false;             // the run as configured (every setting above)
};

// The key=value overrides that turn `config` into `plan`, only the keys that differ, as
// `memtune train CONFIG key=value ...` reads them (empty: the plan is the config).
std::vector<std::string> plan_overrides(const Config& config, const Plan& plan);

// Every candidate for `config` (per_device_train_batch_size a number), by predicted time,
// ties by lower peak: micro-batches dividing the effective batch, checkpointing none,
// every_n for n in {4, 3, 2} below the layer count, and all; activation offload with
// checkpointing; optimizer offload (not when training.optim pages its states already).
// Peaks per rank of `world_size`; times by `model` (default: the config's device's); with
// `data` (the training set's stats), shapes bounded by the data (fit_to_data).
std::vector<Plan> candidate_plans(const Config& config, const models::ModelSpec& spec, int64_t world_size,
                                  const PlanCostModel& model, const data::DatasetStats* data = nullptr);
std::vector<Plan> candidate_plans(const Config& config, const models::ModelSpec& spec, int64_t world_size = 1,
                                  const data::DatasetStats* data = nullptr);

// The candidates worth running under `budget` bytes, fastest first: those whose peak fits,
// each listed only if its peak is below every faster one's (a slower plan that saves no
// memory is never the better choice).
std::vector<Plan> fitting_plans(const std::vector<Plan>& candidates, int64_t budget);

// The candidate with the lowest peak (the faster one on a tie): what a device must hold at least.
const Plan& smallest_plan(const std::vector<Plan>& candidates);

}  // namespace memtune::trainer
