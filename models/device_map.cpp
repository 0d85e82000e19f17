#include "models/device_map.h"

#include "models/causal_lm.h"
#include "runtime/error.h"
#include "runtime/units.h"

namespace memtune::models {

std::string layer_prefix(const CausalLM& model, int layer) {
  for (const auto& s : model.tensors()) {
    if (s.layer != layer) continue;
    const std::string idx = "." + std::to_string(layer) + ".";
    size_t at = s.name.find(idx);
    if (at != std::string::npos) return s.name.substr(0, at + idx.size() - 1);
  }
  return "";
}

namespace {

// "model.layers.3" or "model.layers.0-15" against layer i's prefix.
bool entry_matches(const std::string& key, const std::string& prefix, int layer) {
  if (key == prefix) return true;
  size_t dot = key.rfind('.');
  if (dot == std::string::npos) return false;
  const std::string base = key.substr(0, dot + 1), range = key.substr(dot + 1);
  if (prefix.compare(0, base.size(), base) != 0 || prefix.size() == base.size()) return false;
  size_t dash = range.find('-');
  try {
    int lo = std::stoi(range.substr(0, dash));
    int hi = dash == std::string::npos ? lo : std::stoi(range.substr(dash + 1));
    return layer >= lo && layer <= hi;
  } catch (const std::exception&) {
    return false;
  }
}

bool has_trainable_base(const CausalLM& model, int layer) {
  for (const auto& s : model.tensors())
    if (s.layer == layer && s.tensor->defined() && s.tensor->requires_grad()) return true;
  return false;
}

std::string describe(const CausalLM& model, const c10::Device& compute) {
  std::string out;
  const int n = static_cast<int>(model.num_layers());
  for (int i = 0; i < n;) {
    int j = i;
    while (j + 1 < n && model.offloaded(j + 1) == model.offloaded(i)) ++j;
    out += str_cat(out.empty() ? "" : ", ", j > i ? "layers " : "layer ", i, j > i ? str_cat("-", j) : std::string(), ": ",
                   model.offloaded(i) ? "offload" : compute.str());
    i = j + 1;
  }
  return "device map: embeddings and head " + compute.str() + ", " + out;
}

}  // namespace

std::string apply_device_map(CausalLM& model, const std::string& single,
                             const std::vector<std::pair<std::string, std::string>>& entries,
                             const c10::Device& compute, int64_t budget_bytes, double weights_share) {
  const int n = static_cast<int>(model.num_layers());
  auto check_device = [&](const std::string& where, const std::string& dev) {
    if (dev == "offload" || dev == "auto") return;
    c10::Device d(dev);
    MEMTUNE_CHECK(d == compute || (d.is_cuda() && compute.is_cuda() && !d.has_index()), where, ": device '", dev,
                  "' differs from the compute device ", compute.str(),
                  "; spreading layers over several devices is not supported yet (use ", compute.str(),
                  " or offload)");
  };
  if (!entries.empty()) {
    for (const auto& [key, dev] : entries) {
      check_device("model.device_map." + key, dev);
      bool matched = key == "lm_head" || key.find("embed") != std::string::npos || key.find("wte") != std::string::npos ||
                     key.find("norm") != std::string::npos || key.find("ln_f") != std::string::npos;
      for (int i = 0; i < n; ++i)
        if (entry_matches(key, layer_prefix(model, i), i)) {
          matched = true;
          if (dev == "offload") {
            MEMTUNE_CHECK(!has_trainable_base(model, i), "model.device_map.", key,
                          ": offload needs a frozen base (training.finetune: lora)");
            model.set_offloaded(i, true);
          }
        }
      MEMTUNE_CHECK(matched, "model.device_map: '", key, "' names no module of this model (layers are '",
                    layer_prefix(model, 0), "' to '", layer_prefix(model, n - 1), "'; ranges like ",
                    layer_prefix(model, 0).substr(0, layer_prefix(model, 0).rfind('.') + 1), "0-3)");
      MEMTUNE_CHECK(dev != "offload" || key.find("layers") != std::string::npos || key.find(".h.") != std::string::npos,
                    "model.device_map.", key, ": only decoder layers can be offloaded");
    }
    return describe(model, compute);
  }
  if (single != "auto") {
    check_device("model.device_map", single);
    return describe(model, compute);
  }
  if (budget_bytes > 0) {
    int64_t on_device = model.base_storage_bytes();
    for (int i = n - 1; i >= 0 && on_device > static_cast<int64_t>(weights_share * budget_bytes); --i) {
      if (has_trainable_base(model, i)) break;
      on_device -= model.layer_weight_bytes(i);
      model.set_offloaded(i, true);
    }
  }
  return describe(model, compute);
}

std::string offload_one_more_layer(CausalLM& model) {
  for (int i = static_cast<int>(model.num_layers()) - 1; i >= 0; --i) {
    if (model.offloaded(i)) continue;
    if (has_trainable_base(model, i)) return "";
    const int64_t bytes = model.layer_weight_bytes(i);
    model.set_offloaded(i, true);
    return str_cat("offloaded layer ", i, " (", format_bytes(bytes), " of weights off the device)");
  }
  return "";
}

}  // namespace memtune::models
