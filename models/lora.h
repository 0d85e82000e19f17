#pragma once
// Applying LoRA adapters to a model, with PEFT's targeting rules.
#include <cstdint>
#include <functional>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "models/causal_lm.h"

namespace memtune::models {

struct LoraTargets {
  // Module names matched exactly or as a dotted suffix ("q_proj" matches
  // "model.layers.0.self_attn.q_proj"); a single entry that is not a plain name is a regex
  // matched against the whole module name; "all-linear" is every projection (never the head).
  std::vector<std::string> target_modules = {"all-linear"};
  std::vector<std::string> exclude_modules;
  std::vector<int> layers_to_transform;  // empty: every layer (a target named in full ignores it, as in PEFT)
  // lora.modules_to_save: PEFT matches no target inside these modules (they train whole).
  std::vector<std::string> modules_to_save;
};

// PEFT's default target_modules for a model type (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
// for the types memtune builds: q_proj and v_proj for the Llama family, c_attn for GPT-2);
// empty for a type PEFT has no default for, where PEFT asks for target_modules.
std::vector<std::string> peft_default_targets(const std::string& model_type);

// A target_modules string as the regex PEFT makes of it (re.fullmatch over module names).
// A pattern std::regex cannot compile is a UserError naming `where` and the pattern.
std::regex target_regex(const std::string& pattern, const std::string& where);

// True when `s` is a module name rather than a regex (letters, digits, _ . -).
bool is_plain_module_name(const std::string& s);

// Whether `module` is, or is inside, a module modules_to_save names: PEFT's
// `re.match(rf"(^|.*\.){m}($|\..*)", key)`, which keeps its targets out of those.
bool inside_modules_to_save(const std::vector<std::string>& modules_to_save, const std::string& module);

// True when `module` (a full module name) is targeted, following PEFT.
bool lora_targets(const LoraTargets& targets, const std::string& module, int layer);

// PEFT's rank_pattern and alpha_pattern (LoraConfig): a module takes the rank (lora_alpha) of
// the first pattern, in order, that matches its full name as `(.*\.)?(pattern)$` (PEFT's
// get_pattern_key), else the config's. The order is the user's (a YAML or JSON object's key
// order), which PEFT keeps in training and memtune writes into adapter_config.json.
struct LoraPatterns {
  std::vector<std::pair<std::string, int64_t>> rank;
  std::vector<std::pair<std::string, double>> alpha;
  // `base` with the rank and alpha of `module`'s patterns.
  LoraOptions options_for(LoraOptions base, const std::string& module) const;
};

// A rank_pattern / alpha_pattern key as the regex PEFT matches it with. A pattern std::regex
// cannot compile is a UserError naming `where` (the file or key holding it).
std::regex lora_pattern_regex(const std::string& pattern, const std::string& where);

// Throws UserError when a pattern cannot compile, or decides the rank (alpha) of none of the
// modules `targets` adapt in `model`: it matches none (PEFT would ignore it), or an earlier
// pattern matches each. Names `where` ("lora": lora.rank_pattern, ...). Returns what each
// pattern decides, for the log ("rank_pattern: q_proj -> 16 (4 modules); ..."; empty: none).
std::string check_lora_patterns(const CausalLM& model, const LoraTargets& targets, const LoraPatterns& patterns,
                                const std::string& where);

struct LoraSummary {
  std::vector<std::string> modules;  // the projections that received adapters
  int64_t trainable_parameters = 0;
  int64_t total_parameters = 0;      // base + adapters
  std::string describe() const;      // "trainable params: 1,024 || all params: ... || trainable%: 0.05"
};

// Throws UserError when `targets` select no projection of `model` (listing its projections'
// names), or select any other module (a norm, a block, the embedding, lm_head): PEFT refuses
// the first kinds and would adapt the others, which memtune does not.
void check_lora_targets(const CausalLM& model, const LoraTargets& targets);

// Freezes the base and adds adapters (fp32, A random, B zero) to the targeted projections,
// once check_lora_targets accepts them; each with `options`, its rank and alpha from `patterns`.
LoraSummary apply_lora(CausalLM& model, const LoraOptions& options, const LoraTargets& targets,
                       const LoraPatterns& patterns = {});

// PEFT's modules_to_save: whole modules trained beside the adapters and saved in the adapter
// as "base_model.model.<module>.<param>" (PEFT drops its "modules_to_save.default" part on
// save). An entry selects every module whose name ends with it (PEFT's plain suffix test:
// "norm" selects model.norm and every layer's norms). memtune trains the modules outside the
// decoder layers: the embeddings, the final norm and an untied head. Returns the selected
// tensors in tensor-list order; throws UserError naming `where` when an entry selects
// nothing, a projection, a block of modules, a tensor inside a decoder layer, or an
// embedding tied to the head (PEFT would train an untied copy of it).
std::vector<const TensorSlot*> modules_to_save_tensors(const CausalLM& model, const std::vector<std::string>& names,
                                                       const std::string& where);

// The tensors modules_to_save_tensors selects become trainable, in fp32 (master weights
// with their own optimizer state). Returns their element count.
int64_t apply_modules_to_save(CausalLM& model, const std::vector<std::string>& names, const std::string& where);

// PEFT's bias: the base biases trained beside the adapters. "none"; "all": every tensor named
// *.bias (the projections' and the norms'); "lora_only": the biases of the projections
// `adapted` says have an adapter. In tensor-list order.
std::vector<const TensorSlot*> lora_bias_tensors(const CausalLM& model, const std::string& bias,
                                                 const std::function<bool(const Linear&)>& adapted);
// The same, lora_only taking the projections that have an adapter now.
std::vector<const TensorSlot*> lora_bias_tensors(const CausalLM& model, const std::string& bias);

// A trained bias's key in PEFT's adapter_model.safetensors: the bias of a projection with an adapter
// lives on its base layer ("base_model.model.<module>.base_layer.bias"), any other under
// its own name ("base_model.model.<tensor name>").
std::string peft_bias_key(const TensorSlot& bias);

// Makes lora_bias_tensors of the projections with adapters trainable, in fp32 (master
// weights, as modules_to_save). Returns their element count; throws UserError naming
// `where` when `bias` selects none (the model has no such bias, so the key would change
// nothing).
int64_t apply_lora_bias(CausalLM& model, const std::string& bias, const std::string& where);

// Full fine-tuning: every dense base tensor becomes trainable (fp32). Refuses a 4-bit base.
int64_t make_all_trainable(CausalLM& model);

}  // namespace memtune::models
