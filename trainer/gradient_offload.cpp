#include "trainer/gradient_offload.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "runtime/error.h"
#include "runtime/offload.h"

namespace memtune::trainer {

using torch::autograd::Node;
using torch::autograd::variable_list;

// Runs before tensor i's AccumulateGrad: takes the gradient and passes on an undefined one,
// which AccumulateGrad ignores (it accumulates nothing and keeps no reference). It runs with
// an undefined one too when a tap's gradient came alone: that one is taken then.
struct GradientOffload::Hook : torch::autograd::FunctionPreHook {
  Hook(GradientOffload* o, size_t i) : owner(o), index(i) {}
  variable_list operator()(const variable_list& grads) override {
    if (grads.size() != 1 || (!grads[0].defined() && !owner->staged_[index])) return grads;
    owner->take(index, grads[0]);
    return {at::Tensor()};
  }
  GradientOffload* owner;
  size_t index;
};

// A tap's backward: the gradient goes to the host, none to the tensor. Where the graph task
// captures gradients instead of accumulating them (autograd::grad, backward with inputs) it
// passes the gradient on, as it does when the offload was turned off after the forward.
struct GradientOffload::Tap : Node {
  Tap(GradientOffload* o, size_t i) : owner(o), index(i) {}
  std::string name() const override { return "memtune::GradientTap"; }
  variable_list apply(variable_list&& grads) override {
    const auto* capture = torch::autograd::get_current_graph_task_exec_info();
    if (!grads[0].defined() || !owner->enabled() || (capture && !capture->empty())) return std::move(grads);
    owner->stage(index, grads[0]);
    return {at::Tensor()};
  }
  GradientOffload* owner;
  size_t index;
};

GradientOffload::GradientOffload(Params params) : params_(std::move(params)) {
  for (const auto& [name, p] : params_)
    MEMTUNE_INTERNAL_ASSERT(p.is_leaf() && p.requires_grad() && p.scalar_type() == at::kFloat,
                            "gradient offload: ", name, " must be a trainable fp32 leaf");
}

// The hooks go; a gradient held stays where it is (in host memory, its tensor's .grad keeps
// it alive): a destructor allocates nothing on a device whose budget may be spent.
GradientOffload::~GradientOffload() { remove_hooks(); }

void GradientOffload::remove_hooks() {
  for (size_t i = 0; i < hooks_.size(); ++i) {
    auto& pre = std::static_pointer_cast<Node>(accumulators_[i])->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(), [&](const auto& h) { return h.get() == hooks_[i]; }), pre.end());
  }
  hooks_.clear();
  accumulators_.clear();
}

int64_t GradientOffload::host_bytes() const {
  int64_t n = 0;
  for (const auto& t : host_) n += t.defined() ? t.numel() * 4 : 0;
  for (const auto& t : staging_) n += t.defined() ? t.numel() * 4 : 0;
  return n;
}

namespace {

void check_gradient(const std::string& name, const at::Tensor& p, const at::Tensor& g) {
  MEMTUNE_INTERNAL_ASSERT(g.scalar_type() == at::kFloat && g.sizes() == p.sizes() && !g.is_sparse(),
                          "gradient offload: the gradient of ", name, " is ", g.scalar_type(), " ", g.sizes(),
                          ", expected a dense fp32 ", p.sizes());
}

}  // namespace

at::Tensor GradientOffload::tap(const at::Tensor& w) {
  if (!enabled() || !at::GradMode::is_enabled()) return w;
  size_t i = 0;
  while (i < params_.size() && !params_[i].second.is_same(w)) ++i;
  if (i == params_.size()) return w;
  staged_[i] = false;  // a backward between the last tap and this one failed: its gradient is void
  auto node = std::shared_ptr<Tap>(new Tap(this, i), torch::autograd::deleteNode);
  node->add_next_edge(torch::autograd::impl::gradient_edge(w));
  at::Tensor out = w.detach();  // the same storage, no copy
  torch::autograd::set_history(out, node);
  return out;
}

void GradientOffload::stage(size_t i, const at::Tensor& g) {
  at::NoGradGuard no_grad;
  const at::Tensor& p = params_[i].second;
  check_gradient(params_[i].first, p, g);
  at::Tensor& to = p.grad().defined() ? staging_[i] : host_[i];
  if (!to.defined()) to = offload_zeros(p.sizes(), at::kFloat);
  if (staged_[i])  // tapped twice in one backward: the same sum as autograd's, in another order
    to.add_(g.device() == to.device() ? g : g.to(to.device()));
  else
    to.copy_(g);
  staged_[i] = true;
}

void GradientOffload::take(size_t i, const at::Tensor& g) {
  at::NoGradGuard no_grad;
  const at::Tensor& p = params_[i].second;
  if (g.defined()) check_gradient(params_[i].first, p, g);
  at::Tensor& grad = p.mutable_grad();
  if (staged_[i]) {  // the tap's gradient plus this one: the sum autograd forms, formed here
    staged_[i] = false;
    at::Tensor& sum = grad.defined() ? staging_[i] : host_[i];
    if (g.defined()) sum.add_(g.device() == sum.device() ? g : g.to(sum.device()));
    if (grad.defined())
      grad.add_(sum);  // AccumulateGrad's `grad += new_grad`
    else
      grad = host_[i];
    return;
  }
  if (!grad.defined()) {  // the step's first gradient: AccumulateGrad would keep it as it is
    host_[i].copy_(g);
    grad = host_[i];
  } else {  // later micro-batches: AccumulateGrad's `grad += new_grad`, on the host
    grad.add_(g.device() == grad.device() ? g : g.to(grad.device()));
  }
}

int64_t GradientOffload::enable() {
  if (enabled()) return 0;
  at::NoGradGuard no_grad;
  accumulators_.clear();
  host_.clear();
  staging_.assign(params_.size(), at::Tensor());
  staged_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    std::shared_ptr<Node> acc = torch::autograd::impl::grad_accumulator(p);
    MEMTUNE_INTERNAL_ASSERT(acc != nullptr, "gradient offload: ", params_[i].first, " has no gradient accumulator");
    host_.push_back(offload_zeros(p.sizes(), at::kFloat));
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined()) {  // held already: it moves with the rest
      host_[i].copy_(grad);
      grad = host_[i];
    }
    auto hook = std::make_unique<Hook>(this, i);
    hooks_.push_back(hook.get());
    acc->add_pre_hook(std::move(hook));
    accumulators_.push_back(std::move(acc));
  }
  return host_bytes();
}

int64_t GradientOffload::disable() {
  if (!enabled()) return 0;
  at::NoGradGuard no_grad;
  const int64_t bytes = host_bytes();
  remove_hooks();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined() && grad.is_same(host_[i])) grad = fetch_from_offload(host_[i], p.device());
  }
  host_.clear();
  staging_.clear();  // a gradient staged here belongs to a backward that failed: void, as on the device
  staged_.clear();
  return bytes;
}

}  // namespace memtune::trainer
