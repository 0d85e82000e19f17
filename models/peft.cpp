#include "models/peft.h"

#include <fstream>
#include <sstream>
#include <map>

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

void save_adapter(const CausalLM& model, const AdapterConfig& config, const fs::path& dir) {
  create_output_directory(dir, "saving the adapter");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::string> short_targets;
  for (Linear* l : model.linears()) {
    if (!l->lora) continue;
    tensors.emplace_back(peft_key(l->name(), "lora_A"), l->lora->A.detach().to(at::kFloat).contiguous());
    tensors.emplace_back(peft_key(l->name(), "lora_B"), l->lora->B.detach().to(at::kFloat).contiguous());
  }
  MEMTUNE_CHECK(!tensors.empty(), "save_adapter: the model has no LoRA layers");
  const LoraOptions& o = config.lora;
  json target_modules = config.targets.target_modules.size() == 1
                            ? json(config.targets.target_modules[0])
                            : json(config.targets.target_modules);
  json c = {{"peft_type", "LORA"},
            {"task_type", "CAUSAL_LM"},
            {"r", o.r},
            {"lora_alpha", o.alpha},
            {"lora_dropout", o.dropout},
            {"target_modules", target_modules},
            {"exclude_modules", config.targets.exclude_modules.empty() ? json(nullptr) : json(config.targets.exclude_modules)},
            {"layers_to_transform", config.targets.layers_to_transform.empty() ? json(nullptr) : json(config.targets.layers_to_transform)},
            {"bias", "none"},
            {"use_rslora", o.use_rslora},
            {"use_dora", false},
            {"fan_in_fan_out", config.fan_in_fan_out},
            {"init_lora_weights", o.init == "gaussian" ? json("gaussian") : json(true)},
            {"base_model_name_or_path", config.base_model_name_or_path},
            {"modules_to_save", config.modules_to_save.empty() ? json(nullptr) : json(config.modules_to_save)},
            {"inference_mode", true},
            {"revision", nullptr}};
  save_safetensors(dir / "adapter_model.safetensors", tensors, {{"format", "pt"}});
  write_file_atomic(dir / "adapter_config.json", c.dump(2) + "\n");
}

namespace {

AdapterConfig adapter_config_from_json(const json& c, const std::string& where) {
  auto type = c.value("peft_type", std::string("LORA"));
  MEMTUNE_CHECK(type == "LORA", where, ": peft_type '", type, "' is not supported (LORA only)");
  MEMTUNE_CHECK(c.value("bias", std::string("none")) == "none", where, ": bias '", c.value("bias", std::string()),
                "' is not supported (none only)");
  MEMTUNE_CHECK(!c.value("use_dora", false), where, ": use_dora adapters are not supported");
  AdapterConfig a;
  a.lora.r = c.at("r").get<int64_t>();
  a.lora.alpha = c.value("lora_alpha", 8.0);
  a.lora.dropout = c.value("lora_dropout", 0.0);
  a.lora.use_rslora = c.value("use_rslora", false);
  a.fan_in_fan_out = c.value("fan_in_fan_out", false);
  a.base_model_name_or_path = c.contains("base_model_name_or_path") && c["base_model_name_or_path"].is_string()
                                  ? c["base_model_name_or_path"].get<std::string>() : "";
  const json& t = c.at("target_modules");
  if (t.is_string()) a.targets.target_modules = {t.get<std::string>()};
  else a.targets.target_modules = t.get<std::vector<std::string>>();
  if (c.contains("layers_to_transform") && !c["layers_to_transform"].is_null()) {
    const json& l = c["layers_to_transform"];
    a.targets.layers_to_transform = l.is_number() ? std::vector<int>{l.get<int>()} : l.get<std::vector<int>>();
  }
  if (c.contains("modules_to_save") && c["modules_to_save"].is_array())
    a.modules_to_save = c["modules_to_save"].get<std::vector<std::string>>();
  MEMTUNE_CHECK(a.lora.r > 0, where, ": r must be positive, got ", a.lora.r);
  MEMTUNE_CHECK(c.value("rank_pattern", json::object()).empty() && c.value("alpha_pattern", json::object()).empty(),
                where, ": rank_pattern / alpha_pattern are not supported");
  return a;
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
  // Every lookup below may meet a value of the wrong type: nlohmann's type errors become the file's.
  try {
    return adapter_config_from_json(c, where);
  } catch (const json::exception& e) {
    fail(where, ": ", e.what());
  }
}

LoraSummary load_adapter(CausalLM& model, const fs::path& dir) {
  AdapterConfig config = read_adapter_config(dir);
  SafetensorsFile file(dir / "adapter_model.safetensors");
  // PEFT keys, with or without ".default" adapter names, map to modules.
  std::map<std::string, std::pair<std::string, std::string>> modules;  // module -> (A key, B key)
  for (const auto& key : file.names()) {
    const std::string prefix = "base_model.model.";
    MEMTUNE_CHECK(key.rfind(prefix, 0) == 0, file.path().string(), ": key '", key,
                  "' does not start with base_model.model. (not a PEFT LoRA adapter?)");
    std::string rest = key.substr(prefix.size());
    for (const char* which : {".lora_A.", ".lora_B."}) {
      size_t at = rest.find(which);
      if (at == std::string::npos) continue;
      std::string module = rest.substr(0, at);
      (std::string(which) == ".lora_A." ? modules[module].first : modules[module].second) = key;
    }
  }
  MEMTUNE_CHECK(!modules.empty(), file.path().string(), ": no lora_A / lora_B tensors");
  for (auto& s : model.tensors())
    if (s.tensor->defined()) s.tensor->set_requires_grad(false);
  LoraSummary summary;
  at::NoGradGuard no_grad;
  for (const auto& [module, keys] : modules) {
    Linear* l = model.find_linear(module);
    MEMTUNE_CHECK(l != nullptr, file.path().string(), ": the adapter targets '", module,
                  "', which this model does not have (adapter for another architecture?)");
    MEMTUNE_CHECK(!keys.first.empty() && !keys.second.empty(), file.path().string(), ": '", module,
                  "' lacks its lora_A or lora_B tensor");
    at::Tensor A = file.load(keys.first).to(at::kFloat);
    at::Tensor B = file.load(keys.second).to(at::kFloat);
    MEMTUNE_CHECK(A.dim() == 2 && B.dim() == 2 && A.size(0) == config.lora.r && B.size(1) == config.lora.r &&
                      A.size(1) == l->in_features() && B.size(0) == l->out_features(),
                  file.path().string(), ": '", module, "' has lora_A ", A.sizes(), " and lora_B ", B.sizes(),
                  ", expected [", config.lora.r, ", ", l->in_features(), "] and [", l->out_features(), ", ",
                  config.lora.r, "]");
    l->add_lora(config.lora);
    l->lora->A.copy_(A);
    l->lora->B.copy_(B);
    summary.modules.push_back(module);
    summary.trainable_parameters += A.numel() + B.numel();
  }
  summary.total_parameters = model.base_parameter_count() + summary.trainable_parameters;
  return summary;
}

}  // namespace memtune::models
