#pragma once
// Text continuation with a causal LM: greedy or temperature / top-p sampling.
#include <cstdint>
#include <optional>
#include <vector>

namespace memtune::models {

class CausalLM;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  bool greedy = true;
  double temperature = 1.0;
  double top_p = 1.0;            // nucleus: sample from the smallest set reaching this mass
  uint64_t seed = 0;
  std::optional<int32_t> eos_id;  // stop after generating it
  // Keep each layer's keys and values (models/layers/kv_cache.h), so that each new token's
  // forward reads one position, as transformers' generate with use_cache. False, or an
  // architecture whose layers do not attend through layer_attention: every token's forward
  // runs the whole sequence again. The tokens are the same up to rounding.
  bool use_cache = true;
};

// The new tokens only (eos included when it stopped there).
std::vector<int32_t> generate(CausalLM& model, const std::vector<int32_t>& prompt, const GenerateOptions& options);

}  // namespace memtune::models
