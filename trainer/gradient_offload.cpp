#include "trainer/gradient_offload.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "runtime/error.h"
#include "runtime/offload.h"

namespace memtune::trainer {

using torch::autograd::Node;
using torch::autograd::variable_list;

// Runs before tensor i's AccumulateGrad: takes the gradient and passes on an undefined one,
// which AccumulateGrad ignores (it accumulates nothing and keeps no reference).
struct GradientOffload::Hook : torch::autograd::FunctionPreHook {
  Hook(GradientOffload* o, size_t i) : owner(o), index(i) {}
  variable_list operator()(const variable_list& grads) override {
    if (grads.size() != 1 || !grads[0].defined()) return grads;
    owner->take(index, grads[0]);
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

GradientOffload::~GradientOffload() {
  if (enabled()) disable();
}

int64_t GradientOffload::host_bytes() const {
  int64_t n = 0;
  for (const auto& t : host_) n += t.defined() ? t.numel() * 4 : 0;
  return n;
}

void GradientOffload::take(size_t i, const at::Tensor& g) {
  at::NoGradGuard no_grad;
  const at::Tensor& p = params_[i].second;
  MEMTUNE_INTERNAL_ASSERT(g.scalar_type() == at::kFloat && g.sizes() == p.sizes() && !g.is_sparse(),
                          "gradient offload: the gradient of ", params_[i].first, " is ", g.scalar_type(), " ",
                          g.sizes(), ", expected a dense fp32 ", p.sizes());
  at::Tensor& grad = p.mutable_grad();
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
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& pre = std::static_pointer_cast<Node>(accumulators_[i])->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(), [&](const auto& h) { return h.get() == hooks_[i]; }), pre.end());
    const at::Tensor& p = params_[i].second;
    at::Tensor& grad = p.mutable_grad();
    if (grad.defined() && grad.is_same(host_[i])) grad = fetch_from_offload(host_[i], p.device());
  }
  hooks_.clear();
  accumulators_.clear();
  host_.clear();
  return bytes;
}

}  // namespace memtune::trainer
