#pragma once
// Hugging Face model directories: config.json + model.safetensors (or shards), read and
// written by walking the model's one tensor list.
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "models/causal_lm.h"
#include "models/skip_modules.h"
#include "runtime/nf4.h"

namespace memtune::models {

struct LoadOptions {
  bool load_in_4bit = false;       // quantize the projections to 4 bits as they arrive
  bool load_in_8bit = false;       // or to LLM.int8's 8 bits (runtime/int8.h)
  double int8_threshold = 6.0;     // llm_int8_threshold of the 8-bit projections
  // llm_int8_skip_modules: projections kept dense under load_in_4bit / load_in_8bit. A
  // checkpoint already quantized keeps its own config.json's list instead, as transformers.
  SkipModules skip_modules;
  QuantType quant_type = QuantType::kNF4;
  int64_t blocksize = 64;
  bool double_quant = true;
  at::ScalarType dense_dtype = at::kFloat;  // dtype kept for dense tensors
  // Which tensors to check but not read (another process holds them: distributed.sharding
  // full), one flag per tensor of the model just built; each becomes a meta tensor (shape
  // and dtype, no memory), or an NF4 weight of meta tensors. A checkpoint already in NF4 is
  // read whole.
  std::function<std::vector<bool>(const CausalLM& built)> skip;
  // Called after each tensor is loaded (progress bars, memory checks).
  std::function<void(const std::string& name, int64_t done, int64_t total)> on_tensor;
};

// Reads config.json (throws UserError naming the file on bad input).
ModelSpec read_hf_config(const std::filesystem::path& dir);

// True for a config.json whose quantization_config says bitsandbytes quantized the weights.
bool bnb_quantized(const ModelSpec& spec);

// The llm_int8_skip_modules of a model bitsandbytes quantized (config.json's); unset when
// null, absent, or the model is not so quantized. Throws UserError naming `config_file` for a
// value that is not a list of strings.
SkipModules stored_skip_modules(const ModelSpec& spec, const std::string& config_file);

// Builds the architecture and fills every tensor from the checkpoint, one tensor at a time:
// a projection is quantized straight from the memory-mapped file when load_in_4bit, so the
// peak host memory stays near the 4-bit size plus the largest single tensor. A checkpoint
// already in bitsandbytes' NF4 or 8-bit form is read as is, without re-quantizing: its
// projections are those its config.json's quantization_config (llm_int8_skip_modules) says,
// each stored in that form. Missing tensors and shape mismatches are errors naming the tensor
// and the file.
std::unique_ptr<CausalLM> load_hf_model(const std::filesystem::path& dir, const LoadOptions& options);

// A model with random weights from `seed` (presets, tests, init-model).
std::unique_ptr<CausalLM> init_random_model(const ModelSpec& spec, uint64_t seed);

struct SaveOptions {
  at::ScalarType dtype = at::kFloat;  // dense tensors' dtype on disk
  bool keep_4bit = true;              // NF4 projections in bitsandbytes' form; else dequantized
                                      // (8-bit projections are always written dequantized)
  uint64_t max_shard_bytes = 5'000'000'000;
};

// Writes config.json (with a quantization_config block when 4-bit projections are kept, whose
// llm_int8_skip_modules names lm_head and each projection written dense, or is null when
// none is) and the safetensors checkpoint into `dir`, atomically per file.
void save_hf_model(const CausalLM& model, const std::filesystem::path& dir, const SaveOptions& options);

}  // namespace memtune::models
