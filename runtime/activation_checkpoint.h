#pragma once
// Activation checkpointing for LibTorch's C++ API, which has none: a block runs without
// keeping its activations, and runs again in backward to rebuild them. The random number
// generator state is restored for the rerun, so dropout masks replay exactly.
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace memtune {

using BlockFn = std::function<at::Tensor(const at::Tensor&)>;

// y = fn(x), keeping only x for backward. `trainable` lists every tensor inside fn that
// needs a gradient (their gradients flow through this node, so they arrive even when x
// itself needs none, as for the first layer over a frozen embedding). `offload_input`
// (activation offload): x waits for backward in host memory outside the device's budget
// (runtime/offload.h) and comes back to its device just before the recomputation.
at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x, const std::vector<at::Tensor>& trainable,
                      bool offload_input = false);

}  // namespace memtune
