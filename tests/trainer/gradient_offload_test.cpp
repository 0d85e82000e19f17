// Gradient offload (trainer/gradient_offload.h, memory.optimizer_offload: cpu): gradients
// leave the device budget as backward produces them and accumulate in host memory to the
// same bits as AccumulateGrad's on the device.
#include <gtest/gtest.h>

#include <optional>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include "models/layers/cross_entropy.h"
#include "runtime/activation_checkpoint.h"
#include "runtime/cpu_budget_allocator.h"
#include "trainer/gradient_offload.h"

namespace memtune::trainer {
namespace {

constexpr int64_t kH = 192;  // three [kH, kH] weights and a [kH] bias: 3 * 192^2 + 192 parameters
constexpr int64_t kParams = 3 * kH * kH + kH;

struct Outcome {
  std::vector<at::Tensor> grads;  // after the step's micro-batches
  int64_t held = 0;               // budget bytes held by the gradients after the step
  int64_t peak = 0;               // the budget's peak over the later micro-batches, above the weights
  bool on_budget = false;         // a gradient's bytes are counted by the budget
};

// Three micro-batches of a small MLP (its middle weight used twice, as tied weights are; the
// last block checkpointed), gradients accumulated over them, with or without offload.
Outcome run(bool offload) {
  install_cpu_budget_allocator();
  at::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> params = {
      {"w1", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"w2", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"w3", at::randn({kH, kH}).div_(16).requires_grad_()},
      {"b", at::randn({kH}).requires_grad_()}};
  std::vector<at::Tensor> inputs;
  for (int m = 0; m < 3; ++m) inputs.push_back(at::randn({8 + 4 * m, kH}));
  const int64_t before = cpu_allocated_bytes();  // the host buffers come after: outside the budget
  GradientOffload go(params);
  if (offload) {
    EXPECT_EQ(go.enable(), kParams * 4);
  }
  const at::Tensor &w1 = params[0].second, &w2 = params[1].second, &w3 = params[2].second, &b = params[3].second;
  Outcome r;
  for (int m = 0; m < 3; ++m) {
    if (m == 1) reset_cpu_peak();
    at::Tensor h = at::tanh(at::matmul(inputs[m], w1) + b);
    h = at::tanh(at::matmul(h, w2));
    h = checkpoint([&](const at::Tensor& x) { return at::tanh(at::matmul(at::matmul(x, w3), w2)); }, h, {w3, w2});
    (h * h).sum().mul(0.5).backward();
  }
  r.peak = cpu_peak_bytes() - before;
  r.held = cpu_allocated_bytes() - before;
  for (const auto& [name, p] : params) {
    EXPECT_TRUE(p.grad().defined()) << name;
    r.grads.push_back(p.grad().clone());
  }
  const int64_t with_grads = cpu_allocated_bytes();
  for (const auto& [name, p] : params) p.mutable_grad() = at::Tensor();
  r.on_budget = cpu_allocated_bytes() < with_grads;
  return r;
}

TEST(GradientOffload, AccumulatesTheSameBitsOutsideTheBudget) {
  const Outcome kept = run(false), off = run(true);
  for (size_t i = 0; i < kept.grads.size(); ++i) EXPECT_TRUE(at::equal(kept.grads[i], off.grads[i])) << i;
  // Arithmetic, not the code's own count: every fp32 gradient, kParams x 4 bytes.
  EXPECT_EQ(kept.held, kParams * 4);
  EXPECT_EQ(off.held, 0) << "a gradient stayed in the budget";
  EXPECT_TRUE(kept.on_budget);
  EXPECT_FALSE(off.on_budget);
  // In the later micro-batches the device held every gradient besides the work; offloaded,
  // at most one tensor's (or the checkpointed block's two) while backward hands it over.
  const int64_t largest_two = 2 * kH * kH * 4;
  EXPECT_GE(kept.peak - off.peak, kParams * 4 - largest_two) << kept.peak << " vs " << off.peak;
  EXPECT_LE(kept.peak - off.peak, kParams * 4 + 4096) << kept.peak << " vs " << off.peak;
}

TEST(GradientOffload, DisableBringsAHeldGradientBackAndRemovesTheHook) {
  install_cpu_budget_allocator();
  at::Tensor w = at::ones({64, 64}).requires_grad_();
  GradientOffload go({{"w", w}});
  go.enable();
  (w * 3).sum().backward();
  const int64_t before = cpu_allocated_bytes();
  EXPECT_EQ(go.disable(), 64 * 64 * 4);
  EXPECT_EQ(cpu_allocated_bytes() - before, 64 * 64 * 4) << "the gradient is on the device again";
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 3.0f)));
  (w * 2).sum().backward();  // no hook: AccumulateGrad adds on the device
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 5.0f)));
  EXPECT_EQ(cpu_allocated_bytes() - before, 64 * 64 * 4);
}

// Destroyed at the end of a run, gradient offload leaves the gradients it holds in host
// memory: nothing comes back to a device whose budget may be spent (a GPT-2 124M run at its
// floor ended in an out-of-memory abort after its last step when they did).
TEST(GradientOffload, DestructionMovesNothingToTheDevice) {
  install_cpu_budget_allocator();
  at::Tensor w = at::ones({64, 64}).requires_grad_();
  std::optional<GradientOffload> go;
  go.emplace(GradientOffload::Params{{"w", w}});
  go->enable();
  (w * 3).sum().backward();
  const int64_t before = cpu_allocated_bytes();
  {
    ScopedPeakReset peak;
    go.reset();
    EXPECT_EQ(peak.peak(), before) << "a gradient came back to the device";
  }
  EXPECT_EQ(cpu_allocated_bytes(), before);
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 3.0f)));
  (w * 2).sum().backward();  // no hook: AccumulateGrad adds where the gradient is
  EXPECT_TRUE(at::equal(w.grad(), at::full({64, 64}, 5.0f)));
}

// A tied embedding and head, as GPT-2's: W (V,C) embeds the ids and is the loss's head
// (models/layers/cross_entropy.h, whose backward hands over the head's gradient formed in the
// forward), with a trained (C,C) projection between.
constexpr int64_t kV = 4096, kC = 64, kTokens = 24;
constexpr int64_t kVC = kV * kC * 4;  // one (V,C) fp32 tensor: 1 MiB

enum class Tied { kKept, kOffloaded, kTapped };  // gradients on the device; offloaded; offloaded with the head tapped

struct TiedModel {
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<at::Tensor> ids, targets;  // per micro-batch

  TiedModel() {
    at::manual_seed(11);
    params = {{"wte", at::randn({kV, kC}).requires_grad_()},
              {"proj", at::randn({kC, kC}).div_(8).requires_grad_()}};
    for (int m = 0; m < 3; ++m) {
      ids.push_back(at::randint(kV, {kTokens}, at::kLong));
      targets.push_back(at::randint(kV, {kTokens}, at::kLong));
    }
  }
  const at::Tensor& wte() const { return params[0].second; }
  // One micro-batch's loss; `tap`: the head is tapped, as CausalLM::forward does, just before
  // the loss (so its backward runs right after the loss's). `through_embedding` false: the
  // embedding's gradient never comes; `fail`: the backward throws below the head.
  at::Tensor loss(int m, GradientOffload* tap = nullptr, bool through_embedding = true, bool fail = false) const {
    at::Tensor e = at::embedding(wte(), ids[m]);  // (N,C)
    if (!through_embedding) e = e.detach();
    if (fail) e.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("injected"); });
    at::Tensor h = at::tanh(at::matmul(e, params[1].second));
    return models::linear_cross_entropy_sum(h, tap ? tap->tap(wte()) : wte(), targets[m], 1024) * (1.0 / 64);
  }
};

struct TiedOutcome {
  std::vector<at::Tensor> grads;
  int64_t backward_peak = 0;  // over the later micro-batches' backward, above what was held before it
};

TiedOutcome run_tied(Tied how) {
  install_cpu_budget_allocator();
  TiedModel model;
  GradientOffload go(model.params);
  if (how != Tied::kKept) go.enable();
  TiedOutcome r;
  for (int m = 0; m < 3; ++m) {
    at::Tensor loss = model.loss(m, how == Tied::kTapped ? &go : nullptr);
    const int64_t before = cpu_allocated_bytes();
    ScopedPeakReset peak;
    loss.backward();
    if (m > 0) r.backward_peak = std::max(r.backward_peak, peak.peak() - before);
  }
  for (const auto& [name, p] : model.params) r.grads.push_back(p.grad().clone());
  return r;
}

// Three micro-batches: the tapped run's gradients are the device run's bits (head + emb on
// the first, prev + (head + emb) on the later ones); the backward's peak drops by the (V,C)
// tensors autograd held at its end: the head's waiting gradient and the two's sum.
TEST(GradientOffload, TappedTiedHeadAccumulatesTheSameBitsAndHoldsNoHeadGradientAtTheEndOfBackward) {
  const TiedOutcome kept = run_tied(Tied::kKept), off = run_tied(Tied::kOffloaded), tapped = run_tied(Tied::kTapped);
  for (size_t i = 0; i < kept.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(kept.grads[i], off.grads[i])) << i;
    EXPECT_TRUE(at::equal(kept.grads[i], tapped.grads[i])) << i;
  }
  // Before backward the loss's (V,C) dW, formed in the forward, is held; its backward scales
  // it in place and hands it on. Offloaded without the tap, the end of backward holds the
  // head's waiting gradient and the embedding's, and LibTorch 1.13's autograd sums them into a
  // third (V,C) tensor: 2 x kVC above that level (2.x adds the late one into the waiting one in
  // place: 1 x kVC). Tapped, the embedding's alone: nothing above it, besides small tensors.
  const double expected_off = TORCH_VERSION_MAJOR >= 2 ? 1.0 * kVC : 2.0 * kVC;
  EXPECT_NEAR(static_cast<double>(off.backward_peak), expected_off, kVC / 16.0);
  EXPECT_LT(static_cast<double>(tapped.backward_peak), kVC / 16.0)
      << off.backward_peak << " vs " << tapped.backward_peak;
}

void expect_equal_grads(const TiedModel& a, const TiedModel& b) {
  for (size_t i = 0; i < a.params.size(); ++i) {
    ASSERT_EQ(a.params[i].second.grad().defined(), b.params[i].second.grad().defined()) << a.params[i].first;
    if (a.params[i].second.grad().defined()) {
      EXPECT_TRUE(at::equal(a.params[i].second.grad(), b.params[i].second.grad())) << a.params[i].first;
    }
  }
}

// The embedding's gradient never arrives (the head alone trains W): the accumulator runs with
// nothing but the staged gradient, which is taken then, on the first micro-batch and later.
TEST(GradientOffload, AStagedHeadGradientWithoutTheEmbeddingsIsStillAccumulated) {
  install_cpu_budget_allocator();
  TiedModel kept, off;
  GradientOffload go(off.params);
  go.enable();
  for (int m = 0; m < 2; ++m) {
    kept.loss(m, nullptr, false).backward();
    off.loss(m, &go, false).backward();
    expect_equal_grads(kept, off);
  }
}

// Where the graph task captures gradients (autograd::grad) the tap passes the gradient on:
// the whole (head + embedding) gradient comes back and nothing is staged or accumulated.
TEST(GradientOffload, TapPassesTheGradientOnUnderAutogradGrad) {
  install_cpu_budget_allocator();
  TiedModel model;
  GradientOffload go(model.params);
  const at::Tensor whole = torch::autograd::grad({model.loss(0)}, {model.wte()})[0];
  go.enable();
  const at::Tensor tapped = torch::autograd::grad({model.loss(0, &go)}, {model.wte()})[0];
  EXPECT_TRUE(at::equal(whole, tapped));
  model.loss(1, nullptr, false).backward();  // no stale staged gradient joins this one
  TiedModel kept;
  kept.loss(1, nullptr, false).backward();
  expect_equal_grads(kept, model);
}

// tap() is the weight itself wherever there is nothing to hand over.
TEST(GradientOffload, TapIsTheWeightItselfWhenOffIdleOrNotOffloaded) {
  install_cpu_budget_allocator();
  TiedModel model;
  const at::Tensor other = at::ones({4}).requires_grad_();
  GradientOffload go(model.params);
  EXPECT_TRUE(go.tap(model.wte()).is_same(model.wte())) << "offload off";
  go.enable();
  EXPECT_TRUE(go.tap(other).is_same(other)) << "not one of its tensors";
  {
    at::NoGradGuard no_grad;
    EXPECT_TRUE(go.tap(model.wte()).is_same(model.wte())) << "no gradient recorded";
  }
  const at::Tensor t = go.tap(model.wte());
  EXPECT_FALSE(t.is_same(model.wte()));
  EXPECT_EQ(t.data_ptr(), model.wte().data_ptr()) << "a tap copies nothing";
}

// A backward that fails after the head's gradient was staged (an out-of-memory error below the
// head): as on the device, where autograd drops its input buffers, the staged gradient is void.
// The supervisor then drops the step's gradients and runs the micro-batches again (the next
// tap drops the stale one), or the ladder's undo turns the offload off (disable drops it).
TEST(GradientOffload, AFailedBackwardsStagedGradientIsDroppedByTheNextTapAndByDisable) {
  install_cpu_budget_allocator();
  TiedModel kept, off;
  for (int m = 0; m < 3; ++m) kept.loss(m).backward();
  GradientOffload go(off.params);
  go.enable();
  for (int failed_at : {0, 1}) {  // the first micro-batch (staged in the gradient's buffer) and a later one
    for (auto& [name, p] : off.params) p.mutable_grad() = at::Tensor();
    for (int m = 0; m < failed_at; ++m) off.loss(m, &go).backward();
    EXPECT_THROW(off.loss(failed_at, &go, true, true).backward(), std::exception);
    for (auto& [name, p] : off.params) p.mutable_grad() = at::Tensor();  // the supervisor's zero_grad
    for (int m = 0; m < 3; ++m) off.loss(m, &go).backward();
    expect_equal_grads(kept, off);
  }
  // disable() after a later micro-batch failed: the gradients come back as the device run's
  // after the same failure (W's without the failed head's; the projection's with its part).
  TiedModel device;
  device.loss(0).backward();
  EXPECT_THROW(device.loss(1, nullptr, true, true).backward(), std::exception);
  for (auto& [name, p] : off.params) p.mutable_grad() = at::Tensor();
  off.loss(0, &go).backward();
  EXPECT_THROW(off.loss(1, &go, true, true).backward(), std::exception);
  EXPECT_EQ(go.disable(), (kVC + kC * kC * 4) + kVC) << "the gradients' buffers and W's staging one";
  expect_equal_grads(device, off);
  for (int m = 1; m < 3; ++m) {  // on the device again
    device.loss(m).backward();
    off.loss(m).backward();
  }
  expect_equal_grads(device, off);
}

}  // namespace
}  // namespace memtune::trainer
