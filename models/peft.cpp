#include "models/peft.h"

#include <fstream>
#include <sstream>
#include <map>
#include <regex>
#include <set>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include "models/io/safetensors.h"
#include "runtime/atomic_file.h"
#include "runtime/error.h"
#include "runtime/json_input.h"

namespace memtune::models {

namespace fs = std::filesystem;
using nlohmann::json;

std::string peft_key(const std::string& module, const char* which) {
  return "base_model.model." + module + "." + which + ".weight";
}

namespace {

// rank_pattern / alpha_pattern as the file has them: patterns to values, in the file's order
// (the first that matches a module decides). Patterns are checked as regexes here, values as
// ranks (integers >= 1) or alphas (numbers > 0).
template <class V>
std::vector<std::pair<std::string, V>> read_patterns(const nlohmann::ordered_json& c, const char* key,
                                                     const std::string& where) {
  std::vector<std::pair<std::string, V>> out;
  if (!c.contains(key) || c[key].is_null()) return out;
  const auto& patterns = c[key];
  MEMTUNE_CHECK(patterns.is_object(), where, ": ", key, " must map module name patterns to values, got ",
                patterns.dump().substr(0, 200));
  for (const auto& [pattern, value] : patterns.items()) {
    lora_pattern_regex(pattern, where + ": " + key);
    if constexpr (std::is_integral_v<V>) {
      MEMTUNE_CHECK(value.is_number_integer() && value.template get<int64_t>() >= 1 &&
                        value.template get<int64_t>() < (int64_t{1} << 20),
                    where, ": ", key, "['", pattern, "'] = ", value.dump(), ", not a rank (an integer >= 1)");
    } else {
      MEMTUNE_CHECK(value.is_number() && value.template get<double>() > 0, where, ": ", key, "['", pattern, "'] = ",
                    value.dump(), ", not a lora_alpha (a number > 0)");
    }
    out.emplace_back(pattern, value.template get<V>());
  }
  return out;
}

template <class V>
nlohmann::ordered_json patterns_json(const std::vector<std::pair<std::string, V>>& patterns) {
  nlohmann::ordered_json o = nlohmann::ordered_json::object();
  for (const auto& [pattern, value] : patterns) o[pattern] = value;
  return o;
}

}  // namespace

std::string peft_magnitude_key(const std::string& module) {
  return "base_model.model." + module + ".lora_magnitude_vector";
}

namespace {

// target_modules as PEFT reads it back: a str is a regex matched in full (or all-linear), a
// list holds names matched exactly or as a dotted suffix. PEFT refuses a str together with
// layers_to_transform, so there the list of the modules that were adapted is written.
json peft_target_modules(const LoraTargets& t, const std::vector<std::string>& adapted) {
  const auto& names = t.target_modules;
  const bool pattern = names.size() == 1 && (names[0] == "all-linear" || !is_plain_module_name(names[0]));
  if (!pattern) return json(names);  // one plain name stays a list: as a str it would be a regex
  if (t.layers_to_transform.empty()) return json(names[0]);
  return json(adapted);
}

// exclude_modules the same way: PEFT matches a str in full as a regex, and the entries of a
// list exactly or as a dotted suffix (a regex in a list would exclude nothing).
json peft_exclude_modules(const std::vector<std::string>& names) {
  if (names.empty()) return nullptr;
  if (names.size() == 1 && !is_plain_module_name(names[0])) return json(names[0]);
  return json(names);
}

}  // namespace

void save_adapter(const CausalLM& model, const AdapterConfig& config, const fs::path& dir) {
  create_output_directory(dir, "saving the adapter");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::string> adapted;
  bool dora = false;
  for (Linear* l : model.linears()) {
    if (!l->lora) continue;
    adapted.push_back(l->name());
    MEMTUNE_INTERNAL_ASSERT(l->lora->A.size(0) == config.options_for(l->name()).r, "save_adapter: ", l->name(),
                            " has rank ", l->lora->A.size(0), ", its config ", config.options_for(l->name()).r);
    tensors.emplace_back(peft_key(l->name(), "lora_A"), l->lora->A.detach().to(at::kFloat).contiguous());
    tensors.emplace_back(peft_key(l->name(), "lora_B"), l->lora->B.detach().to(at::kFloat).contiguous());
    if (l->lora->dora())
      tensors.emplace_back(peft_magnitude_key(l->name()), l->lora->magnitude.detach().to(at::kFloat).contiguous());
    MEMTUNE_INTERNAL_ASSERT(adapted.size() == 1 || l->lora->dora() == dora, "save_adapter: DoRA on some adapters only");
    dora = l->lora->dora();
  }
  MEMTUNE_CHECK(!tensors.empty(), "save_adapter: the model has no LoRA layers");
  // PEFT's get_peft_model_state_dict keeps "<module>.<param>" for modules_to_save.
  for (const TensorSlot* s : modules_to_save_tensors(model, config.modules_to_save, "lora.modules_to_save"))
    tensors.emplace_back("base_model.model." + s->name, s->tensor->detach().to(at::kFloat).contiguous());
  // And the biases of `bias`, an adapted projection's on its base layer.
  for (const TensorSlot* s : lora_bias_tensors(model, config.bias))
    tensors.emplace_back(peft_bias_key(*s), s->tensor->detach().to(at::kFloat).contiguous());
  const LoraOptions& o = config.lora;
  json target_modules = peft_target_modules(config.targets, adapted);
  json c = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"r", o.r},
            {"lora_alpha", o.alpha},
            {"lora_dropout", o.dropout},
            {"target_modules", target_modules},
            {"exclude_modules", peft_exclude_modules(config.targets.exclude_modules)},
            {"layers_to_transform", config.targets.layers_to_transform.empty() ? json(nullptr) : json(config.targets.layers_to_transform)},
            {"bias", config.bias},
            {"use_rslora", o.use_rslora},
            {"use_dora", dora},
            {"fan_in_fan_out", config.fan_in_fan_out},
            {"init_lora_weights", o.init == "gaussian" ? json("gaussian") : json(true)},
            {"base_model_name_or_path", config.base_model_name_or_path},
            {"modules_to_save", config.modules_to_save.empty() ? json(nullptr) : json(config.modules_to_save)},
            {"inference_mode", true},
            {"revision", nullptr}};
  save_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  // The keys in json's sorted order; the patterns keep theirs (the first that matches decides).
  nlohmann::ordered_json out;
  for (const auto& [key, value] : c.items()) out[key] = value;
  out["rank_pattern"] = patterns_json(config.patterns.rank);
  out["alpha_pattern"] = patterns_json(config.patterns.alpha);
  write_file_atomic(dir / "adapter_config.json", out.dump(2) + "\n");
}

namespace {

// True when the field is present with a value other than PEFT's "off" (null, false, empty).
bool set(const json& c, const char* key) {
  if (!c.contains(key)) return false;
  const json& v = c[key];
  return !(v.is_null() || (v.is_boolean() && !v.get<bool>()) || (v.is_structured() && v.empty()));
}

// The embedding modules of memtune's architectures (Llama's embed_tokens, GPT-2's wte/wpe):
// PEFT gives them lora_embedding_A/B, which memtune does not implement.
constexpr const char* kEmbeddings[] = {"model.embed_tokens", "transformer.wte", "transformer.wpe"};

// PEFT keeps its targets out of the modules modules_to_save names (they train whole).
bool targets_an_embedding(const json& t, const std::vector<std::string>& modules_to_save) {
  if (t.is_string()) {
    const std::string s = t.get<std::string>();
    if (s == "all-linear") return false;
    for (const char* e : kEmbeddings)
      if (!inside_modules_to_save(modules_to_save, e) && std::regex_match(e, target_regex(s, "adapter_config.json")))
        return true;  // PEFT: re.fullmatch
    return false;
  }
  for (const auto& entry : t) {
    if (!entry.is_string()) continue;
    const std::string n = entry.get<std::string>();
    for (std::string e : kEmbeddings)
      if (!inside_modules_to_save(modules_to_save, e) &&
          (e == n || (e.size() > n.size() && e.compare(e.size() - n.size(), n.size(), n) == 0 &&
                      e[e.size() - n.size() - 1] == '.')))
        return true;
  }
  return false;
}

// Every adapter_config.json field that changes PEFT's forward and that memtune does not
// implement is refused by name: loading it anyway would compute another model.
void refuse_unsupported_fields(const json& c, const std::string& where) {
  auto type = c.value("peft_type", std::string("LORA"));
  MEMTUNE_CHECK(type == "LORA", where, ": peft_type '", type, "' is not supported (LORA only)");
  // PEFT's bias is "none" | "all" | "lora_only"; absent or null means none. Any other type is
  // not a setting PEFT wrote (a type error, reported with the file).
  const std::string bias = c.contains("bias") && !c["bias"].is_null() ? c["bias"].get<std::string>() : "none";
  MEMTUNE_CHECK(bias == "none" || bias == "all" || bias == "lora_only", where, ": bias '", bias,
                "' is not one of PEFT's: none, all, lora_only");
  struct Field {
    const char* key;
    const char* what;
  };
  static const Field fields[] = {
      {"lora_bias", "a trained bias on lora_B"},
      {"layer_replication", "replicated layers"},
      {"trainable_token_indices", "trainable embedding rows"},
      {"use_qalora", "QA-LoRA's pooled adapter input"},
      {"target_parameters", "LoRA on parameters (not modules)"},
      {"alora_invocation_tokens", "activated LoRA (aLoRA)"},
  };
  for (const Field& f : fields)
    MEMTUNE_CHECK(!set(c, f.key), where, ": ", f.key, " = ", c[f.key].dump(), " (", f.what,
                  ") is not supported by memtune, which would compute a different model without it; "
                  "use an adapter saved without ", f.key);
  std::vector<std::string> modules_to_save;
  if (c.contains("modules_to_save") && c["modules_to_save"].is_array())
    for (const json& m : c["modules_to_save"])
      if (m.is_string()) modules_to_save.push_back(m.get<std::string>());
  if (c.contains("target_modules") && targets_an_embedding(c["target_modules"], modules_to_save))
    fail(where, ": target_modules = ", c["target_modules"].dump(),
         " puts LoRA on an embedding (embed_tokens / wte / wpe), which memtune does not support; "
         "use an adapter on the linear projections only");
}

}  // namespace

AdapterConfig read_adapter_config(const fs::path& dir) {
  fs::path file = dir / "adapter_config.json";
  std::ifstream in(file);
  MEMTUNE_CHECK(in.good(), file.string(), ": cannot read (is '", dir.string(), "' a PEFT adapter directory?)");
  std::stringstream text;
  text << in.rdbuf();
  const json c = parse_json(text.str(), file.string());
  const std::string where = file.string();
  MEMTUNE_CHECK(c.is_object(), where, ": expected a JSON object, got ", c.dump().substr(0, 200));
  AdapterConfig a;
  try {  // every lookup may meet a value of the wrong type: nlohmann's type errors become the file's
    refuse_unsupported_fields(c, where);
    a.lora.r = json_int(c, "r", 1, int64_t{1} << 20, where);  // a float past int64 was UB
    a.lora.alpha = c.value("lora_alpha", 8.0);
    a.lora.dropout = c.value("lora_dropout", 0.0);
    a.lora.use_rslora = c.value("use_rslora", false);
    a.lora.use_dora = c.contains("use_dora") && !c["use_dora"].is_null() && c["use_dora"].get<bool>();
    const auto ordered = nlohmann::ordered_json::parse(text.str());
    a.patterns.rank = read_patterns<int64_t>(ordered, "rank_pattern", where);
    a.patterns.alpha = read_patterns<double>(ordered, "alpha_pattern", where);
    a.bias = c.contains("bias") && !c["bias"].is_null() ? c["bias"].get<std::string>() : "none";
    a.fan_in_fan_out = c.value("fan_in_fan_out", false);
    a.base_model_name_or_path = c.contains("base_model_name_or_path") && c["base_model_name_or_path"].is_string()
                                    ? c["base_model_name_or_path"].get<std::string>() : "";
    if (c.contains("modules_to_save") && !c["modules_to_save"].is_null()) {
      const json& m = c["modules_to_save"];
      MEMTUNE_CHECK(m.is_array(), where, ": modules_to_save must be a list of module names, got ", m.dump());
      a.modules_to_save = m.get<std::vector<std::string>>();
    }
    const json& t = c.at("target_modules");
    if (t.is_string()) a.targets.target_modules = {t.get<std::string>()};
    else a.targets.target_modules = t.get<std::vector<std::string>>();
    if (c.contains("layers_to_transform") && !c["layers_to_transform"].is_null()) {
      const json& l = c["layers_to_transform"];
      const json list = l.is_array() ? l : json::array({l});
      for (const json& x : list) {
        MEMTUNE_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0 && x.get<int64_t>() < (1 << 20), where,
                      ": layers_to_transform holds ", x.dump(), ", not a layer index");
        a.targets.layers_to_transform.push_back(static_cast<int>(x.get<int64_t>()));
      }
    }
  } catch (const json::exception& e) {
    fail(where, ": ", e.what());
  }
  MEMTUNE_CHECK(a.lora.r > 0, where, ": r must be positive, got ", a.lora.r);
  return a;
}

LoraSummary load_adapter(CausalLM& model, const fs::path& dir) {
  AdapterConfig config = read_adapter_config(dir);
  SafetensorsFile file(dir / "adapter_model.safetensors");
  // PEFT keys "<module>.lora_A[.default].weight" map to modules; "<tensor name>" holds a
  // modules_to_save tensor; any other tensor is refused by name, so nothing in the file is dropped.
  const std::string where = file.path().string();
  std::map<std::string, const TensorSlot*> saved;  // tensor name -> slot (modules_to_save)
  for (const TensorSlot* s : modules_to_save_tensors(model, config.modules_to_save,
                                                     (dir / "adapter_config.json").string() + ": modules_to_save"))
    saved[s->name] = s;
  struct Keys {
    std::string A, B, magnitude;
  };
  std::map<std::string, Keys> modules;  // module -> its tensors' keys
  std::map<std::string, std::string> full;                             // tensor name -> key
  std::map<std::string, std::string> biases;                           // name in the file -> key
  for (const auto& key : file.names()) {
    const std::string prefix = "base_model.model.";
    MEMTUNE_CHECK(key.rfind(prefix, 0) == 0, where, ": key '", key,
                  "' does not start with base_model.model. (not a PEFT LoRA adapter?)");
    std::string rest = key.substr(prefix.size());
    bool matched = false;
    for (const char* which : {"lora_A", "lora_B"})
      for (const std::string& tail : {std::string(".") + which + ".weight", std::string(".") + which + ".default.weight"})
        if (!matched && rest.size() > tail.size() && rest.compare(rest.size() - tail.size(), tail.size(), tail) == 0) {
          std::string module = rest.substr(0, rest.size() - tail.size());
          (which[5] == 'A' ? modules[module].A : modules[module].B) = key;
          matched = true;
        }
    if (matched) continue;
    // DoRA's magnitude: PEFT saves lora_magnitude_vector.default.weight as "<module>.lora_magnitude_vector".
    const std::string magnitude = ".lora_magnitude_vector";
    if (rest.size() > magnitude.size() && rest.compare(rest.size() - magnitude.size(), magnitude.size(), magnitude) == 0) {
      MEMTUNE_CHECK(config.lora.use_dora, where, ": tensor '", key, "' is a DoRA magnitude, but adapter_config.json ",
                    "does not set use_dora: true; PEFT would not load it (a config from another adapter?)");
      modules[rest.substr(0, rest.size() - magnitude.size())].magnitude = key;
      continue;
    }
    if (saved.count(rest)) {
      full[rest] = key;
      continue;
    }
    MEMTUNE_CHECK(rest.find(".lora_B.bias") == std::string::npos && rest.find(".lora_B.default.bias") == std::string::npos,
                  where, ": tensor '", key, "' is a bias on lora_B (lora_bias), which memtune does not support");
    // A trained bias (bias: all | lora_only): "<module>.base_layer.bias" on an adapted
    // projection, "<tensor name>" elsewhere; matched with what `bias` selects below.
    if (rest.size() > 5 && rest.compare(rest.size() - 5, 5, ".bias") == 0 &&
        (config.bias != "none" || rest.find(".base_layer.bias") != std::string::npos)) {
      MEMTUNE_CHECK(config.bias != "none", where, ": tensor '", key, "' is a trained base bias (PEFT's bias: all | ",
                    "lora_only), but adapter_config.json's bias is none; PEFT would not load it either");
      biases[rest] = key;
      continue;
    }
    MEMTUNE_CHECK(rest.find(".lora_embedding_") == std::string::npos, where, ": tensor '", key,
                  "' is LoRA on an embedding, which memtune does not support");
    MEMTUNE_CHECK(rest.find(".modules_to_save") == std::string::npos, where, ": tensor '", key,
                  "' is not how PEFT saves a module of modules_to_save (it writes base_model.model.<module>.<param>, "
                  "e.g. base_model.model.lm_head.weight, and could not load this name either)");
    MEMTUNE_CHECK(model.find_tensor(rest) == nullptr, where, ": tensor '", key, "' is the model's ", rest,
                  " saved in full, but adapter_config.json's modules_to_save (",
                  json(config.modules_to_save).dump(), ") does not select it; PEFT would not load it either");
    fail(where, ": tensor '", key, "' is not a lora_A / lora_B weight; memtune does not know what it does "
         "(an adapter type other than plain LoRA?)");
  }
  for (const auto& [name, slot] : saved)
    MEMTUNE_CHECK(full.count(name), where, ": adapter_config.json's modules_to_save selects ", name,
                  " but the file has no tensor 'base_model.model.", name, "'");
  MEMTUNE_CHECK(!modules.empty(), where, ": no lora_A / lora_B tensors");
  for (auto& s : model.tensors())
    if (s.tensor->defined()) s.tensor->set_requires_grad(false);
  LoraSummary summary;
  int64_t lora_parameters = 0;
  at::NoGradGuard no_grad;
  for (const auto& [module, keys] : modules) {
    Linear* l = model.find_linear(module);
    MEMTUNE_CHECK(l != nullptr, file.path().string(), ": the adapter targets '", module,
                  "', which this model does not have (adapter for another architecture?)");
    MEMTUNE_CHECK(!keys.A.empty() && !keys.B.empty(), file.path().string(), ": '", module,
                  "' lacks its lora_A or lora_B tensor");
    MEMTUNE_CHECK(!config.lora.use_dora || !keys.magnitude.empty(), where, ": '", module,
                  "' lacks its DoRA magnitude '", peft_magnitude_key(module), "' (adapter_config.json sets use_dora: true)");
    at::Tensor A = file.load(keys.A).to(at::kFloat);
    at::Tensor B = file.load(keys.B).to(at::kFloat);
    LoraOptions options = config.options_for(module);
    const int64_t r = options.r;
    MEMTUNE_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(0) == r && B.size(1) == r &&
                      A.size(1) == l->in_features() && B.size(0) == l->out_features(),
                  file.path().string(), ": '", module, "' has lora_A ", A.sizes(), " and lora_B ", B.sizes(),
                  ", expected [", r, ", ", l->in_features(), "] and [", l->out_features(), ", ", r, "]",
                  r != config.lora.r ? " (its rank from rank_pattern)" : "");
    options.use_dora = false;  // the magnitude is the file's, not the base's norms
    l->add_lora(options);
    l->lora->A.copy_(A);
    l->lora->B.copy_(B);
    if (config.lora.use_dora) {
      MEMTUNE_CHECK(!l->int8(), where, ": '", module, "' is an 8-bit (load_in_8bit) weight, and memtune does not ",
                    "support DoRA (use_dora) on one; load the base in 4 bits or dense");
      at::Tensor m = file.load(keys.magnitude).to(at::kFloat);
      MEMTUNE_CHECK(m.dim() == 1 && m.size(0) == l->out_features(), where, ": '", keys.magnitude, "' has shape ",
                    m.sizes(), ", expected [", l->out_features(), "]");
      l->lora->magnitude = m.contiguous().set_requires_grad(true);
    }
    summary.modules.push_back(module);
    summary.trainable_parameters += l->lora->parameters();
    lora_parameters += l->lora->parameters();
  }
  // The biases `bias` selects, each from its key; the file holds no other.
  std::set<std::string> bias_names;
  int64_t copies = 0;
  for (const TensorSlot* s : lora_bias_tensors(model, config.bias)) {
    if (full.count(s->name)) continue;  // a modules_to_save tensor, saved under its name
    const std::string key = peft_bias_key(*s);
    const auto it = biases.find(key.substr(std::string("base_model.model.").size()));
    MEMTUNE_CHECK(it != biases.end(), where, ": adapter_config.json's bias '", config.bias, "' trains ", s->name,
                  " but the file has no tensor '", key, "'");
    full[s->name] = it->second;
    saved[s->name] = s;
    bias_names.insert(s->name);
    biases.erase(it);
  }
  for (const auto& [rest, key] : biases)
    fail(where, ": tensor '", key, "' is a bias that adapter_config.json's bias '", config.bias, "' does not train ",
         config.bias == "lora_only" ? "(lora_only: the adapted projections' biases, saved as <module>.base_layer.bias)"
                                    : "(all: every bias, an adapted projection's saved as <module>.base_layer.bias)",
         "; PEFT would not load it either");
  for (const auto& [name, key] : full) {
    const TensorSlot& s = *saved.at(name);
    at::Tensor t = file.load(key);
    MEMTUNE_CHECK(t.sizes().vec() == s.shape, where, ": '", key, "' has shape ", t.sizes(), ", the model's ", name,
                  " has ", at::IntArrayRef(s.shape));
    *s.tensor = t.to(s.tensor->device(), at::kFloat).contiguous();  // fp32 master weights, as trained
    s.tensor->set_requires_grad(true);
    summary.modules.push_back(name);
    summary.trainable_parameters += t.numel();
    if (!bias_names.count(name)) copies += t.numel();
  }
  // As PEFT's print_trainable_parameters counts them: the base, the adapters and the copies
  // PEFT keeps of the modules_to_save beside the originals (trained biases are the base's own).
  summary.total_parameters = model.base_parameter_count() + lora_parameters + copies;
  return summary;
}

}  // namespace memtune::models
