#include "models/lora.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>
#include <set>

#include "models/module_regex.h"
#include "runtime/error.h"

namespace memtune::models {

bool is_plain_module_name(const std::string& s) {
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-')) return false;
  return true;
}

std::regex target_regex(const std::string& pattern, const std::string& where) {
  std::regex re;
  const std::string problem = compile_module_regex(pattern, re);
  MEMTUNE_CHECK(problem.empty(), where, ": target_modules '", pattern, "' is not a valid regular expression (",
                problem, "); PEFT reads a single string as a regex over full module names");
  return re;
}

std::regex lora_pattern_regex(const std::string& pattern, const std::string& where) {
  std::regex re;
  const std::string problem = compile_module_regex(pattern, re, "(.*\\.)?(", ")");
  MEMTUNE_CHECK(problem.empty(), where, ": pattern '", pattern, "' is not a valid regular expression (", problem,
                "); PEFT matches it as (.*\\.)?(pattern)$ over full module names");
  return re;
}

namespace {

// The value of the first pattern (in order) that matches `module`; none: nullptr.
template <class V>
const V* pattern_value(const std::vector<std::pair<std::string, V>>& patterns, const std::string& module,
                       const char* key) {
  for (const auto& [pattern, value] : patterns)
    if (std::regex_match(module, lora_pattern_regex(pattern, key))) return &value;
  return nullptr;
}

}  // namespace

LoraOptions LoraPatterns::options_for(LoraOptions base, const std::string& module) const {
  if (const int64_t* r = pattern_value(rank, module, "rank_pattern")) base.r = *r;
  if (const double* a = pattern_value(alpha, module, "alpha_pattern")) base.alpha = *a;
  return base;
}

bool inside_modules_to_save(const std::vector<std::string>& modules_to_save, const std::string& module) {
  for (const std::string& m : modules_to_save)
    if (module == m || module.rfind(m + ".", 0) == 0 || module.find("." + m + ".") != std::string::npos ||
        (module.size() > m.size() && module.compare(module.size() - m.size() - 1, m.size() + 1, "." + m) == 0))
      return true;
  return false;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool all_linear(const LoraTargets& t) { return t.target_modules.size() == 1 && t.target_modules[0] == "all-linear"; }

bool name_matches(const std::vector<std::string>& names, const std::string& module) {
  if (names.size() == 1 && !is_plain_module_name(names[0])) return std::regex_match(module, target_regex(names[0], "lora"));
  for (const auto& n : names) {
    if (module == n) return true;
    if (module.size() > n.size() && module.compare(module.size() - n.size(), n.size(), n) == 0 &&
        module[module.size() - n.size() - 1] == '.')
      return true;
  }
  return false;
}

std::string with_commas(int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3) s.insert(static_cast<size_t>(i), ",");
  return s;
}

}  // namespace

std::vector<std::string> peft_default_targets(const std::string& model_type) {
  static const std::map<std::string, std::vector<std::string>> kDefaults = {
      {"llama", {"q_proj", "v_proj"}}, {"mistral", {"q_proj", "v_proj"}}, {"mixtral", {"q_proj", "v_proj"}},
      {"qwen2", {"q_proj", "v_proj"}}, {"qwen3", {"q_proj", "v_proj"}},   {"gemma", {"q_proj", "v_proj"}},
      {"gemma2", {"q_proj", "v_proj"}}, {"gpt2", {"c_attn"}},
  };
  const auto it = kDefaults.find(model_type);
  return it == kDefaults.end() ? std::vector<std::string>{} : it->second;
}

bool lora_targets(const LoraTargets& t, const std::string& module, int layer) {
  if (!t.exclude_modules.empty() && name_matches(t.exclude_modules, module)) return false;
  // A module named in full is a target whatever layers_to_transform says (PEFT's exact-key
  // branch of check_target_module_exists); the layers filter suffixes, patterns, all-linear.
  if (std::find(t.target_modules.begin(), t.target_modules.end(), module) != t.target_modules.end()) return true;
  if (!t.layers_to_transform.empty() &&
      std::find(t.layers_to_transform.begin(), t.layers_to_transform.end(), layer) == t.layers_to_transform.end())
    return false;
  if (all_linear(t)) return true;
  return name_matches(t.target_modules, module);
}

std::string LoraSummary::describe() const {
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.4f", total_parameters ? 100.0 * trainable_parameters / total_parameters : 0.0);
  return "trainable params: " + with_commas(trainable_parameters) + " || all params: " +
         with_commas(total_parameters) + " || trainable%: " + pct;
}

namespace {

std::string module_of(const std::string& tensor) { return tensor.substr(0, tensor.rfind('.')); }

std::string joined(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}


// PEFT matches target_modules against every module's name, not only the linear layers', and a
// match it cannot adapt stops it ("Target module ... is not supported"); one it can that
// memtune does not (an embedding, lm_head) would be adapted there. memtune adapts the decoder
// layers' projections alone, so a target that also selects any other module is refused by
// name rather than dropped: a norm (Qwen3's q_norm under a pattern like .*q_.*), a block, an
// activation, the embeddings, lm_head.
void refuse_other_modules(const CausalLM& model, const LoraTargets& targets) {
  std::set<std::string> linears;
  for (Linear* l : model.linears()) linears.insert(l->name());
  // Every other module: those holding tensors (their role), the blocks around them and the
  // architecture's modules without tensors, each with its decoder layer when all it holds is
  // in one (layers_to_transform reads it).
  std::map<std::string, std::pair<int, std::string>> others;
  auto note = [&](const std::string& name, int layer, const std::string& what) {
    auto [it, fresh] = others.emplace(name, std::make_pair(layer, what));
    if (!fresh && it->second.first != layer) it->second.first = -1;
  };
  for (const auto& s : model.tensors()) {
    const std::string m = module_of(s.name);
    if (!linears.count(m))
      note(m, s.layer, s.role == TensorRole::kEmbedding           ? "an embedding"
                       : s.role == TensorRole::kPositionEmbedding ? "the position embedding"
                       : s.role == TensorRole::kNorm              ? "a norm"
                       : s.role == TensorRole::kHead              ? "the output layer (lm_head)"
                                                                  : "a module that is not a projection");
    for (size_t dot = m.find('.'); dot != std::string::npos; dot = m.find('.', dot + 1))
      note(m.substr(0, dot), s.layer, "a block of modules");
  }
  for (const auto& [name, layer] : model.modules_without_tensors()) note(name, layer, "a module without weights");
  // transformers' causal LMs have an lm_head module even when it shares the embedding's weight.
  note("lm_head", -1, "the output layer (lm_head)");
  const bool tied = model.spec().tie_word_embeddings;
  for (const auto& [name, at] : others) {
    if (inside_modules_to_save(targets.modules_to_save, name) || !lora_targets(targets, name, at.first)) continue;
    fail("lora.target_modules [", joined(targets.target_modules), "] selects '", name, "', ", at.second,
         "; memtune puts LoRA on the decoder layers' projections only (PEFT refuses a norm, a block or an "
         "activation too, and would put LoRA on an embedding or lm_head, which memtune does not",
         tied ? ")" : "; train those whole with lora.modules_to_save instead)",
         ". Narrow the names or the pattern to the projections, or exclude it with lora.exclude_modules");
  }
}

}  // namespace

void check_lora_targets(const CausalLM& model, const LoraTargets& targets) {
  if (!all_linear(targets)) refuse_other_modules(model, targets);
  bool any = false;
  for (const auto& slot : model.tensors())
    any = any || (slot.role == TensorRole::kLinearWeight && lora_targets(targets, slot.linear->name(), slot.layer));
  if (!any) {
    std::set<std::string> short_names;
    for (Linear* l : model.linears()) short_names.insert(l->name().substr(l->name().rfind('.') + 1));
    const std::vector<std::string> names(short_names.begin(), short_names.end());
    const bool filtered = !targets.layers_to_transform.empty() || !targets.exclude_modules.empty();
    fail("lora.target_modules [", joined(targets.target_modules), "] selects no projection of this model",
         filtered ? " once lora.layers_to_transform and lora.exclude_modules have filtered them" : "",
         "; its projections are: ", joined(names), " (or use all-linear)");
  }
}

std::string check_lora_patterns(const CausalLM& model, const LoraTargets& targets, const LoraPatterns& patterns,
                                const std::string& where) {
  std::string told;
  std::vector<std::string> adapted;
  for (const auto& slot : model.tensors())
    if (slot.role == TensorRole::kLinearWeight && lora_targets(targets, slot.linear->name(), slot.layer))
      adapted.push_back(slot.linear->name());
  auto check = [&](const auto& list, const char* key) {
    const std::string at = where + "." + key;
    std::vector<std::regex> res;
    for (const auto& entry : list) res.push_back(lora_pattern_regex(entry.first, at));
    // Each pattern must decide some module: match it, with no earlier pattern matching it.
    std::vector<std::string> first_match(list.size());  // an adapted module it matches
    std::vector<int> decides(list.size(), 0);            // the modules it decides
    for (const std::string& m : adapted) {
      bool decided = false;
      for (size_t k = 0; k < list.size(); ++k) {
        if (!std::regex_match(m, res[k])) continue;
        if (first_match[k].empty()) first_match[k] = m;
        if (!decided) ++decides[k], decided = true;
      }
    }
    std::string parts;
    for (size_t k = 0; k < list.size(); ++k)
      parts += str_cat(parts.empty() ? "" : ", ", list[k].first, " -> ", list[k].second, " (", decides[k],
                       decides[k] == 1 ? " module)" : " modules)");
    if (!parts.empty()) told += str_cat(told.empty() ? "" : "; ", key, ": ", parts);
    for (size_t k = 0; k < list.size(); ++k) {
      if (decides[k] > 0) continue;
      const std::string& pattern = list[k].first;
      if (!first_match[k].empty()) {
        std::string earlier;
        for (size_t j = 0; j < k && earlier.empty(); ++j)
          if (std::regex_match(first_match[k], res[j])) earlier = list[j].first;
        fail(at, ": '", pattern, "' decides no module: every module it matches (e.g. ", first_match[k],
             ") takes an earlier pattern ('", earlier, "'), as the first pattern in order that matches decides in ",
             "PEFT. Hint: put the more specific pattern first");
      }
      std::set<std::string> short_names;
      for (const std::string& m : adapted) short_names.insert(m.substr(m.rfind('.') + 1));
      fail(at, ": '", pattern, "' matches none of the ", adapted.size(), " adapted modules (", where,
           ".target_modules selects ", joined(std::vector<std::string>(short_names.begin(), short_names.end())),
           adapted.empty() ? "" : "; e.g. " + adapted.front(),
           "), so it would change nothing (PEFT ignores it). Hint: a pattern matches the end of a full module "
           "name, as (.*\\.)?(pattern)$");
    }
  };
  check(patterns.rank, "rank_pattern");
  check(patterns.alpha, "alpha_pattern");
  return told;
}

LoraSummary apply_lora(CausalLM& model, const LoraOptions& options, const LoraTargets& targets,
                       const LoraPatterns& patterns) {
  check_lora_targets(model, targets);
  for (auto& s : model.tensors())
    if (s.tensor->defined()) s.tensor->set_requires_grad(false);
  LoraSummary summary;
  for (const auto& slot : model.tensors()) {
    if (slot.role != TensorRole::kLinearWeight) continue;
    Linear* l = slot.linear;
    if (!lora_targets(targets, l->name(), slot.layer)) continue;
    l->add_lora(patterns.options_for(options, l->name()));
    summary.modules.push_back(l->name());
    summary.trainable_parameters += l->lora->parameters();
  }
  summary.total_parameters = model.base_parameter_count() + summary.trainable_parameters;
  return summary;
}

std::vector<const TensorSlot*> modules_to_save_tensors(const CausalLM& model, const std::vector<std::string>& names,
                                                       const std::string& where) {
  const bool tied = model.spec().tie_word_embeddings;
  std::set<std::string> leaves, blocks;  // modules holding tensors; modules holding modules
  for (const auto& s : model.tensors()) {
    const std::string m = module_of(s.name);
    leaves.insert(m);
    for (size_t dot = m.find('.'); dot != std::string::npos; dot = m.find('.', dot + 1)) blocks.insert(m.substr(0, dot));
  }
  std::set<std::string> selected;
  for (const std::string& entry : names) {
    MEMTUNE_CHECK(!entry.empty(), where, ": an empty module name");
    // transformers' tied models still have an lm_head module (sharing the embedding's weight).
    const bool head = ends_with("lm_head", entry);
    MEMTUNE_CHECK(!(tied && head), where, ": '", entry, "' selects lm_head, which this model ties to the input ",
                  "embedding (tie_word_embeddings: true); PEFT would train an untied copy of it, which memtune does ",
                  "not support; train the adapters alone, or untie the head in the base model first");
    for (const std::string& b : blocks)
      MEMTUNE_CHECK(!ends_with(b, entry), where, ": '", entry, "' selects the block '", b,
                    "' (PEFT would train every tensor in it); memtune's modules_to_save takes the embeddings, the ",
                    "final norm and an untied lm_head");
    bool any = false;
    for (const auto& s : model.tensors()) {
      const std::string m = module_of(s.name);
      if (!ends_with(m, entry)) continue;
      any = true;
      MEMTUNE_CHECK(s.linear == nullptr, where, ": '", entry, "' selects the projection '", m,
                    "'; memtune trains projections with LoRA (lora.target_modules), not as modules_to_save");
      MEMTUNE_CHECK(s.layer < 0, where, ": '", entry, "' selects '", m, "' inside decoder layer ", s.layer,
                    "; memtune's modules_to_save takes the modules outside the layers (the embeddings, the final "
                    "norm, an untied lm_head); to train the final norm alone, name it in full (e.g. model.norm)");
      MEMTUNE_CHECK(!(tied && s.role == TensorRole::kEmbedding), where, ": '", entry, "' selects '", m,
                    "', the input embedding that this model ties to lm_head (tie_word_embeddings: true); PEFT ",
                    "would train a copy used for the input only, which memtune does not support");
      selected.insert(s.name);
    }
    if (!any) {
      std::string known;
      for (const std::string& l : leaves)
        if (l.find(".layers.") == std::string::npos && l.find(".h.") == std::string::npos)
          known += (known.empty() ? "" : ", ") + l;
      fail(where, ": '", entry, "' selects no module of this model; modules outside the layers: ", known);
    }
  }
  std::vector<const TensorSlot*> out;
  for (const auto& s : model.tensors())
    if (selected.count(s.name)) out.push_back(&s);
  return out;
}

namespace {

// The tensors become trainable fp32 master weights, with their own optimizer state.
int64_t make_trainable_fp32(const std::vector<const TensorSlot*>& slots) {
  int64_t n = 0;
  for (const TensorSlot* s : slots) {
    at::Tensor& t = *s->tensor;
    if (t.scalar_type() != at::kFloat) t = t.to(at::kFloat);
    t.set_requires_grad(true);
    n += t.numel();
  }
  return n;
}

}  // namespace

int64_t apply_modules_to_save(CausalLM& model, const std::vector<std::string>& names, const std::string& where) {
  return make_trainable_fp32(modules_to_save_tensors(model, names, where));
}

std::vector<const TensorSlot*> lora_bias_tensors(const CausalLM& model, const std::string& bias,
                                                 const std::function<bool(const Linear&)>& adapted) {
  std::vector<const TensorSlot*> out;
  if (bias == "none") return out;
  MEMTUNE_INTERNAL_ASSERT(bias == "all" || bias == "lora_only", "lora_bias_tensors: bias '", bias, "'");
  for (const TensorSlot& s : model.tensors()) {
    // PEFT's "all": (n == "bias") or n.endswith(".bias") over the parameters' names.
    if (!ends_with(s.name, ".bias") || !s.tensor->defined()) continue;
    if (bias == "all" || (s.role == TensorRole::kLinearBias && adapted(*s.linear))) out.push_back(&s);
  }
  return out;
}

std::vector<const TensorSlot*> lora_bias_tensors(const CausalLM& model, const std::string& bias) {
  return lora_bias_tensors(model, bias, [](const Linear& l) { return l.lora != nullptr; });
}

std::string peft_bias_key(const TensorSlot& bias) {
  if (!bias.linear || !bias.linear->lora) return "base_model.model." + bias.name;
  return "base_model.model." + bias.linear->name() + ".base_layer.bias";
}

int64_t apply_lora_bias(CausalLM& model, const std::string& bias, const std::string& where) {
  const auto slots = lora_bias_tensors(model, bias);
  MEMTUNE_CHECK(bias == "none" || !slots.empty(), where, ": '", bias, "' selects no bias: ",
                bias == "all" ? "this model's projections and norms have none"
                              : "the projections with an adapter have none",
                ", so it would train nothing beside the adapters (PEFT would train nothing either). Hint: bias: none",
                bias == "lora_only" ? ", or target projections with biases" : "");
  return make_trainable_fp32(slots);
}

int64_t make_all_trainable(CausalLM& model) {
  int64_t n = 0;
  for (auto& s : model.tensors()) {
    MEMTUNE_CHECK(!(s.linear && s.linear->quantized()), "training.finetune: full needs dense weights, but ",
                  s.name, " is 4-bit; set model.quantization_config.load_in_4bit: false");
    MEMTUNE_CHECK(!(s.linear && s.linear->int8() && s.tensor == &s.linear->weight),
                  "training.finetune: full needs dense weights, but ", s.name,
                  " is 8-bit (LLM.int8: load_in_8bit, or a model stored in bitsandbytes' 8-bit form). Hint: "
                  "finetune: lora, or the model's dense checkpoint without load_in_8bit");
    if (!s.tensor->defined()) continue;
    if (s.tensor->scalar_type() != at::kFloat) *s.tensor = s.tensor->to(at::kFloat);
    s.tensor->set_requires_grad(true);
    n += s.tensor->numel();
  }
  return n;
}

}  // namespace memtune::models
