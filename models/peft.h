#pragma once
// LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors with
// keys "base_model.model.<module>.lora_A.weight" ([r, in]) and ".lora_B.weight" ([out, r]).
#include <filesystem>
#include <string>
#include <vector>

#include "models/causal_lm.h"
#include "models/lora.h"

namespace memtune::models {

struct AdapterConfig {
  LoraOptions lora;
  LoraTargets targets;
  std::string base_model_name_or_path;
  bool fan_in_fan_out = false;
  // PEFT's modules_to_save as written in the config (e.g. {"lm_head"}): modules trained in
  // full, saved as "base_model.model.<tensor name>" (models/lora.h modules_to_save_tensors).
  std::vector<std::string> modules_to_save;
  // PEFT's bias: none, all or lora_only; the biases it selects (models/lora.h
  // lora_bias_tensors) are saved as PEFT saves them (peft_bias_key) and trained, fp32.
  std::string bias = "none";
  // PEFT's rank_pattern and alpha_pattern, in the file's order (models/lora.h).
  LoraPatterns patterns;
  // The adapter options of `module`: lora with its pattern's rank and alpha.
  LoraOptions options_for(const std::string& module) const { return patterns.options_for(lora, module); }
};

std::string peft_key(const std::string& module, const char* which);  // which: "lora_A" | "lora_B"
// DoRA's magnitude as PEFT saves it: "base_model.model.<module>.lora_magnitude_vector" ([out]).
std::string peft_magnitude_key(const std::string& module);

// Writes adapter_config.json and adapter_model.safetensors (fp32) into `dir`, atomically:
// the LoRA tensors and, for config.modules_to_save and config.bias, the whole tensors.
void save_adapter(const CausalLM& model, const AdapterConfig& config, const std::filesystem::path& dir);

// Reads adapter_config.json (throws UserError naming the file and key on bad input, and
// naming every field that changes PEFT's math and that memtune does not implement:
// lora_bias, LoRA on embeddings, ...). use_dora, rank_pattern, alpha_pattern and bias are read.
// fan_in_fan_out is read but PEFT itself sets it from the module type (Conv1D or Linear),
// as memtune does.
AdapterConfig read_adapter_config(const std::filesystem::path& dir);

// Adds the adapter's LoRA layers to `model` (freezing the base) and loads their weights;
// the modules_to_save tensors and the biases of `bias` replace the base's (and are
// trainable, as the adapters). Every
// module of the file must exist in the model with matching shapes; a tensor that is neither
// a lora_A / lora_B weight nor one of the modules_to_save is refused by name.
LoraSummary load_adapter(CausalLM& model, const std::filesystem::path& dir);

}  // namespace memtune::models
