#pragma once
// Training checkpoints: everything needed to continue a run exactly. A checkpoint is a
// directory output_dir/checkpoints/step-N written under a temporary name, synced, then
// renamed, so a crash at any point leaves the previous checkpoint intact.
//   trainable.safetensors   trainable tensors (LoRA adapters or all weights), fp32
//   optimizer.safetensors   optimizer states
//   rng.safetensors         the CPU generator's state
//   state.json              step, sampler position, scaler, supervisor, optimizer scalars
//   config.yaml             the effective config of the run that wrote it
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

namespace memtune::trainer {

struct TrainingCheckpoint {
  nlohmann::json state;                        // state.json
  std::map<std::string, at::Tensor> trainable;
  std::map<std::string, at::Tensor> optimizer;
  at::Tensor rng_state;                        // CPU generator state (uint8)
  std::string config_yaml;
};

// Writes checkpoints/step-<step>; prunes the oldest beyond save_total_limit (> 0) only after
// the new one is complete. Returns the final directory.
std::filesystem::path save_training_checkpoint(
    const std::filesystem::path& output_dir, int64_t step, const nlohmann::json& state,
    const std::vector<std::pair<std::string, at::Tensor>>& trainable,
    const std::vector<std::pair<std::string, at::Tensor>>& optimizer, const at::Tensor& rng_state,
    const std::string& config_yaml, int save_total_limit);

TrainingCheckpoint load_training_checkpoint(const std::filesystem::path& dir);

// The complete checkpoint with the highest step under output_dir/checkpoints, or empty.
std::filesystem::path latest_checkpoint(const std::filesystem::path& output_dir);

}  // namespace memtune::trainer
