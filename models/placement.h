#pragma once
// Where each part of a model computes: the embeddings, every decoder layer and the head.
// CausalLM::place applies one; models/device_map.h makes one from the config.
#include <cstdint>
#include <vector>

#include <c10/core/Device.h>

namespace memtune::models {

// Compute devices of a model's parts (CausalLM::place).
struct Placement {
  c10::Device embeddings = c10::kCPU;  // token (and learned position) embeddings
  c10::Device head = c10::kCPU;        // final norm and output head (tied: the embeddings' device)
  std::vector<c10::Device> layers;     // per decoder layer

  static Placement all_on(const c10::Device& device, int64_t num_layers) {
    return {device, device, std::vector<c10::Device>(static_cast<size_t>(num_layers), device)};
  }
};

}  // namespace memtune::models
