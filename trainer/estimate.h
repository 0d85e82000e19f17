#pragma once
// The memory estimate of a configured run (trainer/estimator.h), built from the config and
// the model's structure before anything is loaded: `memtune estimate`, the auto micro-batch, the
// pre-load check and the monitor's suggestions all ask here.
#include <cstdint>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "models/model_spec.h"
#include "trainer/estimator.h"
#include "trainer/config.h"

namespace memtune::trainer {

// The model's shape as model.name_or_path names it: config.json of a Hugging Face directory,
// else the preset (model.architecture applied). Reads no weights.
models::ModelSpec model_spec(const Config& config);

// Layers recomputed in backward under a gradient_checkpointing policy: the one plan the
// trainer runs and the estimate counts. A layer index past the model is a UserError.
std::vector<bool> checkpoint_plan(const CheckpointingConfig& c, int64_t layers);

// The estimator's input for this config and shape: micro_batch <= 0 takes the config's
// per_device_train_batch_size (1 when auto); sequence length is data.max_seq_length.
EstimateInput estimate_input(const Config& config, const models::ModelSpec& spec, int64_t micro_batch = 0);

// `in` bounded by the training data (the loaded dataset's stats): a micro-batch's rows are
// padded to its longest sample (data::collate), so no longer than the data's longest; and
// only trained positions form logits, at most the data's most per sample. Without it the
// estimate assumes rows of data.max_seq_length with every position trained, a bound that
// can be several times the real peak with packing off or prompt tokens masked.
EstimateInput fit_to_data(EstimateInput in, const data::DatasetStats& stats);

// Whether memory.optimizer_offload: cpu (and its ladder rung) takes the gradients off the
// device as well as the state (trainer/gradient_offload.h): everywhere but on several ranks
// of a GPU, whose collectives (NCCL) reduce device memory.
bool gradient_offload_applies(const Config& config, int64_t world_size);

// The same input with every saving enabled: every layer checkpointed.
EstimateInput with_every_saving(EstimateInput in);

// `in` with every saving memory.on_oom.ladder allows: micro-batch 1 where the supervisor may
// shrink, every layer checkpointed; under memory.supervise activation offload, optimizer
// offload (its gradients where they can leave the device) unless `optimizer_offload` is
// false, AdamW's state in 8 bits where optimizer_8bit is listed (and `optimizer_8bit`, and the
// state on the device), and (LoRA on a frozen base)
// every decoder layer off the device. Per rank of
// `world_size`. What the config sets itself stays set.
EstimateInput with_ladder(const Config& config, EstimateInput in, int64_t world_size, bool optimizer_offload = true,
                          bool optimizer_8bit = true);

// Whether the ladder's optimizer offload is taken before the first step (the trainer does,
// and ladder_plan says so): under memory.supervise with optimizer_offload in the ladder and
// not configured, when the estimate with every other saving the ladder allows (with_ladder
// without it) exceeds `budget`. The state is then made in host memory: made on the device
// first, it would not fit there.
bool optimizer_offload_at_start(const Config& config, const EstimateInput& in, int64_t budget, int64_t world_size);
// The same for the ladder's optimizer_8bit (listed, AdamW's state on the device) where optimizer
// offload is not taken: the optimizer then makes its state in 8 bits (zeros are the same in
// either form, so the run is the one configured with adamw_8bit).
bool optimizer_8bit_at_start(const Config& config, const EstimateInput& in, int64_t budget, int64_t world_size);

// What the supervisor settles on for `in` under `budget`, by the estimate: the optimizer
// offload before the first step, then the largest micro-batch that fits (where the ladder
// may shrink it), then the ladder's rungs in memory.on_oom.ladder's order, each as far as
// needed (checkpointing layer by layer, activation offload, optimizer offload, 8-bit AdamW
// state, layer offload from the last layer down for LoRA), as trainer.cpp's rungs take them after an
// out-of-memory error; where one rung alone would do (cheapest_fitting_rung), that rung only.
// `steps` says what was taken; none when `in` fits or the supervisor is off.
struct LadderPlan {
  EstimateInput settled;
  std::vector<std::string> steps;
  int64_t peak_bytes = 0;
  bool fits = false;
};
LadderPlan ladder_plan(const Config& config, EstimateInput in, int64_t budget, int64_t world_size);
// The cheapest rung that fits: the first of memory.on_oom.ladder (its order is the order of
// cost: recomputation, copies, the update on the CPU, weights fetched every step) that, taken
// as far as it goes, brings `in` under `budget` by the estimate; "" when none does alone, or
// when the estimate says `in` fits already (an error it did not predict: the ladder then
// climbs in order). The supervisor starts its climb there, so that rungs that would not have
// been enough are not paid for. activation_offload applies only where layers are checkpointed.
std::string cheapest_fitting_rung(const Config& config, const EstimateInput& in, int64_t budget, int64_t world_size);
// "step; step: peak (fits)", as `memtune estimate` and `memtune train` print it.
std::string describe(const LadderPlan& plan);

// per_device_train_batch_size: auto: the largest micro-batch whose estimated peak stays
// under memory.warning_threshold of `budget` (the supervisor absorbs the estimate's error),
// between 1 and `cap` (the dataset's rows).
int64_t auto_micro_batch(const Config& config, const EstimateInput& in, int64_t budget, int64_t cap);

// What would fit `budget` where `best` (a plan with every saving it may take) does not, by the
// estimate, as "; key: value (why)" clauses: load_in_4bit for a dense LoRA run, the longest
// data.max_seq_length that fits, and the device size the plan needs.
std::string what_would_fit(const EstimateInput& best, int64_t budget);

// Refuses (MemoryExhausted, a UserError) a run whose estimated peak at micro-batch 1 with every layer
// checkpointed exceeds `budget` bytes, saying what would fit: load_in_4bit, a shorter
// data.max_seq_length, fewer layers' adapters, or a device of the needed size.
// `world_size`: per rank of that many (distributed.sharding).
void check_fits(const Config& config, const models::ModelSpec& spec, int64_t budget, int64_t world_size = 1);

}  // namespace memtune::trainer
