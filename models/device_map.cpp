#include "models/device_map.h"

#include <algorithm>

#include "models/causal_lm.h"
#include "runtime/cuda_info.h"
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

bool is_embedding_key(const std::string& key) {
  return key.find("embed") != std::string::npos || key.find("wte") != std::string::npos ||
         key.find("wpe") != std::string::npos;
}

bool is_head_key(const std::string& key) {
  return key == "lm_head" || key.find("norm") != std::string::npos || key.find("ln_f") != std::string::npos;
}

// "cuda" is the run's CUDA device (cuda:0 when the run is on the CPU); a named device must exist.
c10::Device resolve(const std::string& where, const std::string& name, const c10::Device& compute) {
  if (name == "cuda") return compute.is_cuda() ? compute : c10::Device(c10::kCUDA, 0);
  c10::Device d(name);
  if (d.is_cuda()) {
    const int visible = cuda_info().device_count;
    MEMTUNE_CHECK(d.index() < visible, where, ": device '", name, "' is not available here (", visible,
                  " CUDA devices visible). Hint: use cpu or offload, or a device below cuda:", visible);
  }
  return d;
}

}  // namespace

AutoPlan plan_auto(int64_t embedding_bytes, int64_t head_bytes, const std::vector<int64_t>& layer_bytes,
                   const std::vector<bool>& frozen, const std::vector<DeviceBudget>& budgets) {
  MEMTUNE_CHECK(!budgets.empty(), "device_map auto: no device to place the model on");
  const int n = static_cast<int>(layer_bytes.size());
  AutoPlan plan;
  plan.placement.embeddings = plan.placement.head = budgets[0].device;
  plan.offloaded.assign(n, false);
  size_t d = 0;
  int64_t left = budgets[0].bytes - embedding_bytes - head_bytes;
  for (int i = 0; i < n; ++i) {
    // The next device when this one is full (and there is one).
    while (budgets[d].bytes > 0 && layer_bytes[i] > left && d + 1 < budgets.size()) {
      ++d;
      left = budgets[d].bytes;
    }
    const bool fits = budgets[d].bytes <= 0 || layer_bytes[i] <= left;
    plan.placement.layers.push_back(budgets[d].device);
    if (fits || !frozen[i]) {
      left -= layer_bytes[i];
    } else {
      plan.offloaded[i] = true;
    }
  }
  return plan;
}

std::vector<c10::Device> devices_of(const Placement& p) {
  std::vector<c10::Device> out{p.embeddings};
  auto add = [&](const c10::Device& d) {
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  };
  for (const auto& d : p.layers) add(d);
  add(p.head);
  return out;
}

std::string describe_placement(const CausalLM& model) {
  const Placement& p = model.placement();
  auto where = [&](int i) {
    return model.offloaded(i) ? "offload to " + p.layers[i].str() : p.layers[i].str();
  };
  std::string out = "device map: embeddings " + p.embeddings.str();
  const int n = static_cast<int>(model.num_layers());
  for (int i = 0; i < n;) {
    int j = i;
    while (j + 1 < n && where(j + 1) == where(i)) ++j;
    out += str_cat(", ", j > i ? "layers " : "layer ", i, j > i ? str_cat("-", j) : std::string(), ": ", where(i));
    i = j + 1;
  }
  return out + ", head " + p.head.str();
}

AutoPlan plan_entries(const CausalLM& model, const std::vector<std::pair<std::string, std::string>>& entries,
                      const c10::Device& compute) {
  const int n = static_cast<int>(model.num_layers());
  AutoPlan plan;
  Placement& placement = plan.placement;
  placement.embeddings = placement.head = compute;
  placement.layers.assign(n, compute);
  std::vector<bool>& offload = plan.offloaded;
  offload.assign(n, false);
  for (const auto& [key, dev] : entries) {
    const std::string where = "model.device_map." + key;
    const bool to_offload = dev == "offload";
    const c10::Device device = to_offload ? compute : resolve(where, dev, compute);
    bool matched = false;
    for (int i = 0; i < n; ++i)
      if (entry_matches(key, layer_prefix(model, i), i)) {
        matched = true;
        MEMTUNE_CHECK(!to_offload || !has_trainable_base(model, i), where,
                      ": offload needs a frozen base (training.finetune: lora)");
        offload[i] = to_offload;
        if (!to_offload) placement.layers[i] = device;
      }
    for (int i = 0; i < n && !matched; ++i) {
      const std::string inside = layer_prefix(model, i) + ".";
      MEMTUNE_CHECK(key.compare(0, inside.size(), inside) != 0, where, ": names a part of layer ", i,
                    "; a layer is placed as a whole (", layer_prefix(model, i), ")");
    }
    if (!matched && (is_embedding_key(key) || is_head_key(key))) {  // outside the layers
      MEMTUNE_CHECK(!to_offload, where, ": only decoder layers can be offloaded");
      (is_embedding_key(key) ? placement.embeddings : placement.head) = device;
      matched = true;
    }
    MEMTUNE_CHECK(matched, "model.device_map: '", key, "' names no module of this model (layers are '",
                  layer_prefix(model, 0), "' to '", layer_prefix(model, n - 1), "'; ranges like ",
                  layer_prefix(model, 0).substr(0, layer_prefix(model, 0).rfind('.') + 1), "0-3)");
  }
  // An offloaded layer computes where the layer before it does.
  for (int i = 0; i < n; ++i)
    if (offload[i]) placement.layers[i] = i > 0 ? placement.layers[i - 1] : placement.embeddings;
  return plan;
}

std::string apply_device_map(CausalLM& model, const std::string& single,
                             const std::vector<std::pair<std::string, std::string>>& entries,
                             const c10::Device& compute, const std::vector<DeviceBudget>& budgets) {
  const int n = static_cast<int>(model.num_layers());
  Placement placement;
  placement.embeddings = placement.head = compute;
  placement.layers.assign(n, compute);
  std::vector<bool> offload(n, false);
  if (!entries.empty()) {
    AutoPlan plan = plan_entries(model, entries, compute);
    placement = plan.placement;
    offload = plan.offloaded;
  } else if (single != "auto") {
    const c10::Device device = resolve("model.device_map", single, compute);
    MEMTUNE_CHECK(device == compute, "model.device_map: '", single, "' differs from runtime.device (", compute.str(),
                  "). Hint: set runtime.device: ", single, ", or map modules to devices");
  } else if (!budgets.empty()) {
    std::vector<int64_t> layer_bytes;
    std::vector<bool> frozen;
    for (int i = 0; i < n; ++i) {
      layer_bytes.push_back(model.layer_weight_bytes(i));
      frozen.push_back(!has_trainable_base(model, i));
    }
    int64_t outside = model.base_storage_bytes();
    for (int64_t b : layer_bytes) outside -= b;
    AutoPlan plan = plan_auto(outside, 0, layer_bytes, frozen, budgets);
    placement = plan.placement;
    offload = plan.offloaded;
  }
  MEMTUNE_CHECK(!model.spec().tie_word_embeddings || placement.head == placement.embeddings,
                "model.device_map: the head is tied to the embeddings (tie_word_embeddings) and must share their "
                "device, ", placement.embeddings.str(), ", not ", placement.head.str());
  model.place(placement);
  for (int i = 0; i < n; ++i)
    if (offload[i]) model.set_offloaded(i, true);
  return describe_placement(model);
}

std::string offload_one_more_layer(CausalLM& model) {
  for (int i = static_cast<int>(model.num_layers()) - 1; i >= 0; --i) {
    if (model.offloaded(i)) continue;
    if (has_trainable_base(model, i)) return "";
    const int64_t bytes = model.layer_weight_bytes(i);
    model.set_offloaded(i, true);
    return str_cat("offloaded layer ", i, " (", format_bytes(bytes), " of weights off ",
                   model.placement().layers[i].str(), ")");
  }
  return "";
}

}  // namespace memtune::models
