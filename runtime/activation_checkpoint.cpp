#include "runtime/activation_checkpoint.h"

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

namespace memtune {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct BlockHolder : torch::CustomClassHolder {
  BlockFn fn;
  at::Tensor rng_state;
  c10::Device device = c10::kCPU;
};

at::Generator generator_for(const c10::Device& device) {
  return at::globalContext().defaultGenerator(device);
}

at::Tensor get_rng_state(const c10::Device& device) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = generator_for(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, variable_list trainable,
                            c10::intrusive_ptr<BlockHolder> holder) {
    holder->device = x.device();
    holder->rng_state = get_rng_state(holder->device);
    at::Tensor y;
    {
      at::NoGradGuard no_grad;
      y = holder->fn(x);
    }
    ctx->saved_data["block"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["x_needs_grad"] = x.requires_grad();
    variable_list saved = {x};
    saved.insert(saved.end(), trainable.begin(), trainable.end());
    ctx->save_for_backward(saved);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<BlockHolder>(ctx->saved_data["block"].toCapsule());
    const bool x_needs_grad = ctx->saved_data["x_needs_grad"].toBool();
    variable_list saved = ctx->get_saved_variables();
    at::Tensor x = saved[0].detach().requires_grad_(x_needs_grad);
    variable_list trainable(saved.begin() + 1, saved.end());

    // Rerun with the forward's random state, then give the generator back its own.
    at::Tensor current = get_rng_state(holder->device);
    set_rng_state(holder->device, holder->rng_state);
    at::Tensor y;
    {
      at::AutoGradMode grad_mode(true);
      y = holder->fn(x);
    }
    set_rng_state(holder->device, current);

    variable_list inputs;
    if (x_needs_grad) inputs.push_back(x);
    for (const auto& t : trainable)
      if (t.requires_grad()) inputs.push_back(t);
    variable_list computed;
    if (!inputs.empty() && y.requires_grad())
      computed = torch::autograd::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    variable_list out;
    size_t k = 0;
    out.push_back(x_needs_grad && k < computed.size() ? computed[k++] : at::Tensor());
    for (const auto& t : trainable)
      out.push_back(t.requires_grad() && k < computed.size() ? computed[k++] : at::Tensor());
    out.push_back(at::Tensor());  // holder
    return out;
  }
};

}  // namespace

at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x, const std::vector<at::Tensor>& trainable) {
  if (!at::GradMode::is_enabled()) return fn(x);
  auto holder = c10::make_intrusive<BlockHolder>();
  holder->fn = fn;
  return Checkpoint::apply(x, variable_list(trainable.begin(), trainable.end()), holder);
}

}  // namespace memtune
