// The chunked head + loss against ATen's linear and cross_entropy under autograd.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "models/layers/cross_entropy.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;
using memtune::models::linear_cross_entropy_sum;

TEST(LinearCrossEntropy, MatchesAtenLossGradientsAndArgmax) {
  torch::manual_seed(3);
  const int64_t n = 37, c = 24, v = 301;
  for (int64_t chunk : {5, 16, 1024}) {
    SCOPED_TRACE(chunk);
    at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
    at::Tensor weight = at::randn({v, c}).requires_grad_(true);
    at::Tensor targets = at::randint(v, {n}, at::kLong);
    targets.index_put_({at::arange(0, n, 4)}, -100);  // every 4th row is not trained
    // Make some rows right: their target gets the largest logit.
    at::Tensor logits_now = at::mm(hidden.detach(), weight.detach().t());
    for (int64_t i = 1; i < n; i += 3)
      if (targets[i].item<int64_t>() >= 0) targets[i] = logits_now[i].argmax().item<int64_t>();

    int64_t correct = 0;
    at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, &correct);
    at::Tensor h_ref = hidden.detach().clone().requires_grad_(true);
    at::Tensor w_ref = weight.detach().clone().requires_grad_(true);
    at::Tensor logits = at::mm(h_ref, w_ref.t());
    at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100);
    expect_close(loss, loss_ref, 1e-5, "loss");

    at::Tensor kept = targets != -100;
    const int64_t expected_correct =
        (logits.detach().argmax(1).masked_select(kept) == targets.masked_select(kept)).sum().item<int64_t>();
    EXPECT_EQ(correct, expected_correct);
    EXPECT_GT(correct, 5);

    (loss * 0.5).backward();
    (loss_ref * 0.5).backward();
    expect_close(hidden.grad(), h_ref.grad(), 1e-5, "grad hidden");
    expect_close(weight.grad(), w_ref.grad(), 1e-5, "grad weight");
    // Ignored rows get no gradient at all.
    EXPECT_EQ(hidden.grad().index_select(0, at::arange(0, n, 4)).abs().max().item<float>(), 0.0f);
  }
}

TEST(LinearCrossEntropy, FrozenWeightGetsNoGradient) {
  at::Tensor hidden = at::randn({6, 8}).requires_grad_(true);
  at::Tensor weight = at::randn({11, 8});
  at::Tensor loss = linear_cross_entropy_sum(hidden, weight, at::randint(11, {6}, at::kLong), 4);
  loss.backward();
  EXPECT_TRUE(hidden.grad().defined());
  EXPECT_FALSE(weight.grad().defined());
}

}  // namespace
