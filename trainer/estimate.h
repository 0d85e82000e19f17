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

// per_device_train_batch_size: auto: the largest micro-batch whose estimated peak stays
// under memory.warning_threshold of `budget` (the supervisor absorbs the estimate's error),
// between 1 and `cap` (the dataset's rows).
int64_t auto_micro_batch(const Config& config, const EstimateInput& in, int64_t budget, int64_t cap);

// Refuses (MemoryExhausted, a UserError) a run whose estimated peak at micro-batch 1 with every layer
// checkpointed exceeds `budget` bytes, saying what would fit: load_in_4bit, a shorter
// data.max_seq_length, fewer layers' adapters, or a device of the needed size.
// `world_size`: per rank of that many (distributed.sharding).
void check_fits(const Config& config, const models::ModelSpec& spec, int64_t budget, int64_t world_size = 1);

}  // namespace memtune::trainer
