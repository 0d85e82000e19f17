#include "runtime/activation_checkpoint.h"

#include <mutex>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "runtime/error.h"
#include "runtime/keyed_dropout.h"
#include "runtime/offload.h"

namespace memtune {

namespace {

using torch::autograd::variable_list;

at::Tensor get_rng_state(const c10::Device& device) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const c10::Device& device, const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The backward node of a checkpointed block. Its inputs are the block's input and every
// trainable tensor inside it, so their gradients flow through the node whatever the input
// needs (a custom autograd Function cannot take a list of tensors as inputs on 1.13).
struct CheckpointBackward : public torch::autograd::Node {
  BlockFn fn;
  at::Tensor x;                    // detached block input: all that is kept
  OffloadedTensor x_offloaded;     // or, with activation offload, x in host memory outside the budget
  // The offloaded block that ran before this one in the forward, whose input backward needs
  // next: this node's backward starts bringing it back (prefetched one block ahead).
  std::weak_ptr<CheckpointBackward> previous_offloaded;
  std::vector<at::Tensor> trainable;
  at::Tensor rng_state;            // the forward's generator state, for dropout replay
  DropoutKeys dropout_keys;        // the forward's rows (keyed dropout; backward may run on another thread)
  c10::Device device = c10::kCPU;
  bool x_needs_grad = false;

  std::string name() const override { return "memtune::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    MEMTUNE_INTERNAL_ASSERT(fn, "checkpointed block: backward ran twice (retain_graph is not supported)");
    at::Tensor input = (x_offloaded.defined() ? x_offloaded.fetch() : x.detach()).requires_grad_(x_needs_grad);
    x.reset();  // the reference is not needed past this point
    if (auto previous = previous_offloaded.lock()) previous->x_offloaded.prefetch();
    // Rerun with the forward's random state, then give the generator back its own.
    at::Tensor current = get_rng_state(device);
    set_rng_state(device, rng_state);
    at::Tensor y;
    {
      at::AutoGradMode grad_mode(true);
      DropoutKeysScope keys(dropout_keys);
      y = fn(input);
    }
    set_rng_state(device, current);

    variable_list inputs;
    if (x_needs_grad) inputs.push_back(input);
    for (const auto& t : trainable) inputs.push_back(t);
    variable_list computed;
    if (!inputs.empty() && y.requires_grad())
      computed = torch::autograd::grad({y}, inputs, {grads[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    variable_list out;
    size_t k = 0;
    out.push_back(x_needs_grad && k < computed.size() ? computed[k++] : at::Tensor());
    for (size_t i = 0; i < trainable.size(); ++i) out.push_back(k < computed.size() ? computed[k++] : at::Tensor());
    release_variables();
    return out;
  }

  void release_variables() override {
    fn = nullptr;
    x.reset();
    x_offloaded = OffloadedTensor();
    previous_offloaded.reset();
    trainable.clear();
  }
};

// The last offloaded block of the forward running on this thread: the next one links to it.
// A link to a block of an earlier graph is harmless: its backward has run (its input is
// gone, prefetch() does nothing) or never will (the graph was dropped with its nodes).
thread_local std::weak_ptr<CheckpointBackward> last_offloaded;

}  // namespace

at::Tensor checkpoint(const BlockFn& fn, const at::Tensor& x, const std::vector<at::Tensor>& trainable,
                      bool offload_input) {
  if (!at::GradMode::is_enabled()) return fn(x);
  std::vector<at::Tensor> needs;
  for (const auto& t : trainable)
    if (t.requires_grad()) needs.push_back(t);
  if (!x.requires_grad() && needs.empty()) return fn(x);

  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->device = x.device();
  node->rng_state = get_rng_state(node->device);
  node->dropout_keys = current_dropout_keys();
  // The copy out starts before the block runs (on CUDA it overlaps the block's forward).
  if (offload_input) node->x_offloaded = OffloadedTensor(x);
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = fn(x);
  }
  node->fn = fn;
  if (offload_input) {
    node->previous_offloaded = last_offloaded;
    last_offloaded = node;
  } else {
    node->x = x.detach();
  }
  node->x_needs_grad = x.requires_grad();
  node->trainable = needs;
  node->add_next_edge(torch::autograd::impl::gradient_edge(x));
  for (const auto& t : needs) node->add_next_edge(torch::autograd::impl::gradient_edge(t));
  torch::autograd::set_history(y, node);
  return y;
}

}  // namespace memtune
