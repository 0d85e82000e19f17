#pragma once
// Where each part of a model lives: device_map from the config (`auto`, one device, or
// module prefixes -> cuda:N | cpu | offload). Embeddings, each decoder layer and the head
// (final norm + output projection) compute on a device of their own; activations cross
// device boundaries in forward and their gradients cross back in backward. An offloaded
// layer keeps its frozen weights in host memory outside the device budget and fetches
// them to its compute device for each use.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/Device.h>

#include "models/placement.h"

namespace memtune::models {

class CausalLM;

// A device `auto` may fill, and the bytes of base weights it may take there (<= 0: no limit).
struct DeviceBudget {
  c10::Device device;
  int64_t bytes = 0;
};

struct AutoPlan {
  Placement placement;
  std::vector<bool> offloaded;  // per layer
};

// `auto` on given sizes: embeddings and head on the first device; layers in order on the
// first device until its budget is spent, then the next device's; layers left over are
// offloaded (computing on the last device) when `frozen`, else stay on the last device.
AutoPlan plan_auto(int64_t embedding_bytes, int64_t head_bytes, const std::vector<int64_t>& layer_bytes,
                   const std::vector<bool>& frozen, const std::vector<DeviceBudget>& budgets);

// An explicit map's plan (module prefixes -> cuda:N | cpu | offload; not `auto`), checked as
// apply_device_map applies it: the memory estimate reads which layers are offloaded here.
AutoPlan plan_entries(const CausalLM& model, const std::vector<std::pair<std::string, std::string>>& entries,
                      const c10::Device& compute);

// The module prefix of layer i ("model.layers.3", "transformer.h.3").
std::string layer_prefix(const CausalLM& model, int layer);

// Applies the map to the model (places its tensors, offloads layers). `compute` is the run's
// device (runtime.device): `auto` and unnamed parts use it. `budgets` (for `auto`) lists the
// devices to fill in order, `compute` first; empty: everything on `compute`. Returns the
// plan, one line, for the log.
std::string apply_device_map(CausalLM& model, const std::string& single,
                             const std::vector<std::pair<std::string, std::string>>& entries,
                             const c10::Device& compute, const std::vector<DeviceBudget>& budgets);

// "embeddings cuda:0, layers 0-11: cuda:0, layers 12-15: offload to cuda:1, head cuda:0".
std::string describe_placement(const CausalLM& model);

// Offloads the last layer still on a device; "" when none is left (the supervisor's rung).
std::string offload_one_more_layer(CausalLM& model);

// The devices a placement computes on, the embeddings' first, each once.
std::vector<c10::Device> devices_of(const Placement& placement);

}  // namespace memtune::models
