#pragma once
// Optimizers over the trainable tensors only, with fp32 states: AdamW (decoupled weight
// decay, PyTorch's semantics) and SGD with momentum. The update allocates nothing: its
// workspace is planned when the optimizer is built, so an out-of-memory error can only
// happen before the first parameter changes, never half way through an update.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

namespace memtune::trainer {

struct OptimizerOptions {
  std::string kind = "adamw";  // adamw|sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;   // not applied to norms and biases (see decays())
  double momentum = 0.0;       // sgd
};

// Weight decay applies to matrices (LoRA A/B, projection and embedding weights), not to
// norm weights or biases.
bool decays(const std::string& name, const at::Tensor& t);

class Optimizer {
 public:
  Optimizer(std::vector<std::pair<std::string, at::Tensor>> params, OptimizerOptions options);

  // One update with learning rate `lr`, from the parameters' .grad (scaled by grad_scale,
  // e.g. the clipping coefficient). Parameters without a gradient are left alone.
  void step(double lr, double grad_scale = 1.0);
  void zero_grad();  // drops every .grad
  int64_t steps() const { return steps_; }
  const std::vector<std::pair<std::string, at::Tensor>>& params() const { return params_; }
  int64_t state_bytes() const;

  // State for training checkpoints: tensors (named "<param>.exp_avg", ...) and scalars.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  nlohmann::json state_scalars() const;
  void load_state(const std::map<std::string, at::Tensor>& tensors, const nlohmann::json& scalars);

 private:
  OptimizerOptions options_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> exp_avg_, exp_avg_sq_;  // adamw; exp_avg_ is the momentum buffer for sgd
  // Per device the parameters are on: the largest parameter's size there, fp32.
  std::map<std::string, at::Tensor> workspaces_;
  int64_t steps_ = 0;
};

// Global L2 norm of the gradients (fp32); undefined gradients count as zero.
double grad_norm(const std::vector<std::pair<std::string, at::Tensor>>& params);

}  // namespace memtune::trainer
