#pragma once
// Training checkpoints: everything needed to continue a run exactly. A checkpoint is a
// directory output_dir/checkpoints/step-N written under a temporary name, synced, then
// renamed, so a crash at any point leaves the previous checkpoint intact.
//   trainable.safetensors   trainable tensors (LoRA adapters or all weights), fp32
//   optimizer.safetensors   optimizer states; under distributed.sharding instead one shard per
//                           rank, optimizer-0000<r+1>-of-0000<W>.safetensors (written by rank r),
//                           named by optimizer.safetensors.index.json (HF's index format)
//   rng.safetensors         the CPU generator's state
//   state.json              step, sampler position, scaler, supervisor, optimizer scalars
//   config.yaml             the effective config of the run that wrote it
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include "trainer/config.h"

namespace memtune::trainer {

// What a checkpoint's state.json holds, named in one place. The parts owned by other
// objects (sampler, scaler, supervisor, optimizer scalars) stay JSON here and are checked
// field by field by their owner's load; a damaged or hand-edited file is refused with the
// key, the value seen and what was expected, never run.
struct TrainState {
  int64_t step = 0;                     // optimizer steps done
  nlohmann::json sampler;               // data::SamplerState
  nlohmann::json scaler;                // GradScaler::state()
  nlohmann::json supervisor;            // Supervisor::state()
  nlohmann::json optimizer;             // Optimizer::state_scalars()
  std::vector<bool> checkpoint_layers;  // the policy the ladder settled on; empty in old checkpoints
  bool activation_offload = false;      // the ladder's (or the config's) activation offload; false in old ones
  bool optimizer_offload = false;       // the optimizer's state in host memory (ladder or config)
  int64_t world_size = 0;               // ranks of the run that wrote it; 0 in old checkpoints (unknown)
  bool eval_due = false;                // a stop cut short the periodic evaluation at `step`: a resume runs it
  int64_t total_steps = 0;              // the run's length when it was written; 0 in old checkpoints
  nlohmann::json lr_scheduler;          // a stateful schedule's state (reduce_lr_on_plateau); null otherwise
  // metric_for_best_model's best value so far, the step of that evaluation, and the step of
  // the checkpoint it names (HF's best_metric, best_global_step, best_model_checkpoint); 0:
  // none. save_total_limit never prunes the best checkpoint.
  std::optional<double> best_metric;
  int64_t best_step = 0;
  int64_t best_checkpoint = 0;
  // What data.train_file made for the run that wrote it: the sampler's order is a permutation
  // of that many samples, so a resume on data that makes another count of samples or target
  // tokens would not continue it. 0 in old checkpoints (unknown; state.json then has no "data").
  int64_t data_samples = 0;
  int64_t data_target_tokens = 0;

  nlohmann::json to_json() const;
  // Every key present and of its type, step in range; `origin` names the file.
  static TrainState from_json(const nlohmann::json& j, const std::string& origin);
};

struct TrainingCheckpoint {
  TrainState state;                            // state.json
  // Read-only views of the files' mappings (outside the device budget: a run resumes under
  // the memory.device_limit it trained in): copy from them, never write to them.
  std::map<std::string, at::Tensor> trainable;
  std::map<std::string, at::Tensor> optimizer;
  at::Tensor rng_state;                        // CPU generator state (uint8)
  std::string config_yaml;
};

// Which of the checkpoints at `steps` (ascending) save_total_limit `limit` (> 0) removes, as
// transformers' rotate_checkpoints: the newest and the best (`best` > 0) stay, and the oldest
// of the others go until at most max(limit, the kept) remain. Indices into `steps`.
std::vector<size_t> checkpoints_to_prune(const std::vector<int64_t>& steps, int limit, int64_t best);

// Writes checkpoints/step-<step>; prunes the oldest beyond save_total_limit (> 0) only after
// the new one is complete. Returns the final directory. `optimizer_shards` > 0: the optimizer
// state is sharded over that many ranks, each of which has written its shard (atomically)
// at optimizer_shard_path() before this call (`optimizer` is then ignored): the shards move
// into the checkpoint, and the index naming every tensor's shard is written with them.
std::filesystem::path save_training_checkpoint(
    const std::filesystem::path& output_dir, const TrainState& state,
    const std::vector<std::pair<std::string, at::Tensor>>& trainable,
    const std::vector<std::pair<std::string, at::Tensor>>& optimizer, const at::Tensor& rng_state,
    const std::string& config_yaml, int save_total_limit, int optimizer_shards = 0);

// Where rank `rank` of `world` writes its optimizer-state shard for the checkpoint of `step`
// (checkpoints/step-<step>.shards/rank-<rank>/, a directory of its own so that no rank's
// clean-up of temporaries meets another's); save_training_checkpoint moves it in.
std::filesystem::path optimizer_shard_path(const std::filesystem::path& output_dir, int64_t step, int rank,
                                           int world);

// Reads and validates a checkpoint directory: every file present, state.json complete and
// in range, its step equal to the directory's step-N. Throws UserError naming the file.
// `want_optimizer` (optional) picks the optimizer tensors to read by name (a rank's share
// under sharding, whatever the sharding of the run that wrote it); the others stay on disk.
TrainingCheckpoint load_training_checkpoint(const std::filesystem::path& dir,
                                            const std::function<bool(const std::string&)>& want_optimizer = {});

// Removes step-N directories that lost their state.json (an interrupted delete of an
// older version) and stale temporaries under output_dir/checkpoints; returns how many
// checkpoints it removed. The trainer runs it at start; every save runs it too.
int remove_incomplete_checkpoints(const std::filesystem::path& output_dir);

// The complete checkpoint with the highest step under output_dir/checkpoints, or empty.
std::filesystem::path latest_checkpoint(const std::filesystem::path& output_dir);
// The complete checkpoints under output_dir/checkpoints past `step`, by step.
std::vector<std::filesystem::path> checkpoints_after(const std::filesystem::path& output_dir, int64_t step);

// Resuming compares the checkpoint's config (`then`) with this run's (`now`), key by key,
// and refuses a change that alters what a step computes, naming the key and both values.
// Free to change: where and how often the run writes, evaluates and logs; the device,
// threads and memory management; how a step's samples are split into micro-batches (their
// product must stay) and what is recomputed. The run's length may change, with a warning:
// the schedule after the checkpoint follows the new length, as in transformers' Trainer.
// With the world sizes (then: 0 when the checkpoint does not say), the samples of a step
// over all ranks must stay: 2 ranks x 3 samples may resume as 3 x 2.
void check_resume_compatible(const Config& now, const Config& then, const std::filesystem::path& checkpoint,
                             int64_t world_now = 1, int64_t world_then = 0);

}  // namespace memtune::trainer
