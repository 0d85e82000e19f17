#pragma once
// Where each part of a model lives: device_map from the config (`auto`, one device, or
// module prefixes -> cuda:N | cpu | offload). On one compute device, a map chooses which
// layers are offloaded (host memory outside the device budget, fetched per use).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

namespace memtune::models {

class CausalLM;

// The module prefix of layer i ("model.layers.3", "transformer.h.3").
std::string layer_prefix(const CausalLM& model, int layer);

// Applies the map; `budget_bytes` (0: none) is the device budget `auto` plans with: layers
// are offloaded from the last one down until the base weights on the device take at most
// `weights_share` of it. Returns the plan, one line per run of layers, for the log.
std::string apply_device_map(CausalLM& model, const std::string& single,
                             const std::vector<std::pair<std::string, std::string>>& entries,
                             const c10::Device& compute, int64_t budget_bytes, double weights_share = 0.6);

// Offloads the last layer still on the device; "" when none is left (the supervisor's rung).
std::string offload_one_more_layer(CausalLM& model);

}  // namespace memtune::models
