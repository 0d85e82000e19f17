// The chunked head + loss against ATen's linear and cross_entropy under autograd.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "models/layers/cpu_vec.h"
#include "models/layers/cross_entropy.h"
#include "runtime/cpu_budget_allocator.h"
#include "runtime/memory.h"
#include "test_util.h"

namespace {

using memtune::testing::expect_close;
using memtune::models::linear_cross_entropy_sum;

// Both the AVX2 row kernels (where the CPU has them) and the portable C++ ones.
class LinearCrossEntropyKernels : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { memtune::models::detail::use_portable_cpu_kernels(GetParam()); }
  void TearDown() override { memtune::models::detail::use_portable_cpu_kernels(false); }
};

TEST_P(LinearCrossEntropyKernels, MatchesAtenLossGradientsAndArgmax) {
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

// Label smoothing (transformers' label_smoothing_factor) against ATen's own
// cross_entropy(label_smoothing), which is transformers' LabelSmoother per token: the loss,
// the plain cross-entropy beside it, and both gradients, over chunk sizes.
TEST_P(LinearCrossEntropyKernels, LabelSmoothingIsAtensCrossEntropyWithLabelSmoothing) {
  torch::manual_seed(5);
  const int64_t n = 29, c = 16, v = 203;
  for (double eps : {0.1, 0.35}) {
    for (int64_t chunk : {4, 1024}) {
      SCOPED_TRACE(std::to_string(eps) + " chunk " + std::to_string(chunk));
      at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
      at::Tensor weight = at::randn({v, c}).requires_grad_(true);
      at::Tensor targets = at::randint(v, {n}, at::kLong);
      targets.index_put_({at::arange(0, n, 5)}, -100);
      at::Tensor unsmoothed;
      at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, nullptr, at::kFloat, eps, &unsmoothed);
      at::Tensor h_ref = hidden.detach().to(at::kDouble).requires_grad_(true);
      at::Tensor w_ref = weight.detach().to(at::kDouble).requires_grad_(true);
      at::Tensor logits = at::mm(h_ref, w_ref.t());
      at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100, eps);
      expect_close(loss, loss_ref.to(at::kFloat), 1e-5, "smoothed loss");
      expect_close(unsmoothed, at::cross_entropy_loss(logits.detach(), targets, {}, at::Reduction::Sum, -100)
                                   .to(at::kFloat), 1e-5, "plain cross-entropy");
      EXPECT_GT((loss - unsmoothed).abs().item<double>(), 1e-2) << "smoothing changed nothing";
      (loss * 0.5).backward();
      (loss_ref * 0.5).backward();
      expect_close(hidden.grad(), h_ref.grad().to(at::kFloat), 1e-5, "grad hidden");
      expect_close(weight.grad(), w_ref.grad().to(at::kFloat), 1e-5, "grad weight");
      EXPECT_EQ(hidden.grad().index_select(0, at::arange(0, n, 5)).abs().max().item<float>(), 0.0f);
    }
  }
}

// Gemma 2's final_logit_softcapping: the loss of c tanh(logits / c) and its gradients through
// the cap, against ATen's ops under autograd in fp64, with and without label smoothing, over
// chunk sizes; the argmax is the capped logits' (the same: tanh is increasing).
TEST_P(LinearCrossEntropyKernels, SoftcappedLogitsAreAtensTanhCapUnderAutograd) {
  torch::manual_seed(6);
  const int64_t n = 31, c = 16, v = 211;
  for (double cap : {1.5, 30.0}) {
    for (double eps : {0.0, 0.2}) {
      for (int64_t chunk : {4, 1024}) {
        SCOPED_TRACE("cap " + std::to_string(cap) + " eps " + std::to_string(eps) + " chunk " + std::to_string(chunk));
        at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
        at::Tensor weight = at::randn({v, c}).requires_grad_(true);
        at::Tensor targets = at::randint(v, {n}, at::kLong);
        targets.index_put_({at::arange(0, n, 5)}, -100);
        int64_t correct = 0;
        at::Tensor loss =
            linear_cross_entropy_sum(hidden, weight, targets, chunk, &correct, at::kFloat, eps, nullptr, cap);
        at::Tensor h_ref = hidden.detach().to(at::kDouble).requires_grad_(true);
        at::Tensor w_ref = weight.detach().to(at::kDouble).requires_grad_(true);
        at::Tensor logits = at::tanh(at::mm(h_ref, w_ref.t()) / cap) * cap;
        at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100, eps);
        expect_close(loss, loss_ref.to(at::kFloat), 1e-5, "loss");
        const at::Tensor uncapped = linear_cross_entropy_sum(hidden.detach(), weight.detach(), targets, chunk,
                                                             nullptr, at::kFloat, eps);
        if (cap < 10) {
          EXPECT_GT((uncapped - loss).abs().item<double>(), 1.0) << "the cap changed nothing";
        }
        at::Tensor kept = targets != -100;
        EXPECT_EQ(correct, (logits.detach().argmax(1).masked_select(kept) == targets.masked_select(kept))
                               .sum()
                               .item<int64_t>());
        (loss * 0.5).backward();
        (loss_ref * 0.5).backward();
        expect_close(hidden.grad(), h_ref.grad().to(at::kFloat), 1e-5, "grad hidden");
        expect_close(weight.grad(), w_ref.grad().to(at::kFloat), 1e-5, "grad weight");
        EXPECT_EQ(hidden.grad().index_select(0, at::arange(0, n, 5)).abs().max().item<float>(), 0.0f);
      }
    }
  }
}

// Two vocabulary rows with the same embedding tie in every row's logits: the prediction is
// the first of them (ATen's argmax), so a target on the second never counts as correct.
TEST_P(LinearCrossEntropyKernels, TiedMaximaCountTheFirstIndex) {
  torch::manual_seed(8);
  const int64_t n = 9, c = 6, v = 19;
  // Small integers, so every logit is exact whatever order the GEMM sums in: ids 4 and 13
  // (all 3s) give 3 * sum(h) >= 54 against at most sum|h| <= 30 for the others (-1..1).
  at::Tensor weight = at::randint(-1, 2, {v, c}).to(at::kFloat);
  weight[4] = 3;
  weight[13] = 3;
  at::Tensor hidden = (at::randint(-1, 2, {n, c}) + 4).to(at::kFloat);
  at::Tensor logits = at::mm(hidden, weight.t());
  ASSERT_TRUE((logits.argmax(1) == 4).all().item<bool>());
  int64_t correct = 0;
  linear_cross_entropy_sum(hidden, weight, at::full({n}, 13, at::kLong), 4, &correct);
  EXPECT_EQ(correct, 0);
  correct = 0;
  linear_cross_entropy_sum(hidden, weight, at::full({n}, 4, at::kLong), 4, &correct);
  EXPECT_EQ(correct, n);
}

// The CUDA softmax pass (models/layers/cuda/) against the CPU's kernels, which the tests
// above check against ATen: the loss, both gradients and the count of right predictions,
// over vocabularies the kernel reads four floats at a time (304) and one at a time (301),
// with chunks that split the rows unevenly, and the first of tied maxima.
TEST(LinearCrossEntropy, OnCudaEqualsTheCpuKernels_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(11);
  for (int64_t v : {301, 304}) {
    for (int64_t chunk : {7, 1024}) {
      SCOPED_TRACE("vocab " + std::to_string(v) + " chunk " + std::to_string(chunk));
      const int64_t n = 45, c = 32;
      at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
      at::Tensor weight = at::randn({v, c}).requires_grad_(true);
      at::Tensor targets = at::randint(v, {n}, at::kLong);
      targets.index_put_({at::arange(0, n, 5)}, -100);
      at::Tensor logits_now = at::mm(hidden.detach(), weight.detach().t());
      for (int64_t i = 1; i < n; i += 3)
        if (targets[i].item<int64_t>() >= 0) targets[i] = logits_now[i].argmax().item<int64_t>();

      int64_t correct = 0, correct_gpu = 0;
      at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, &correct);
      at::Tensor hg = hidden.detach().to(cuda).requires_grad_(true);
      at::Tensor wg = weight.detach().to(cuda).requires_grad_(true);
      at::Tensor loss_gpu = linear_cross_entropy_sum(hg, wg, targets.to(cuda), chunk, &correct_gpu);
      ASSERT_TRUE(loss_gpu.is_cuda());
      expect_close(loss_gpu.cpu(), loss, 1e-5, "loss");
      EXPECT_EQ(correct_gpu, correct);
      EXPECT_GT(correct, 5);
      loss.backward();
      loss_gpu.backward();
      expect_close(hg.grad().cpu(), hidden.grad(), 1e-5, "grad hidden");
      expect_close(wg.grad().cpu(), weight.grad(), 1e-5, "grad weight");
    }
  }
  // Tied maxima (TiedMaximaCountTheFirstIndex's construction, exact integer logits), read
  // one float at a time (19) and four at a time (20).
  for (int64_t v : {19, 20}) {
    at::Tensor weight = at::randint(-1, 2, {v, 6}).to(at::kFloat);
    weight[4] = 3;
    weight[13] = 3;
    const at::Tensor hidden = (at::randint(-1, 2, {9, 6}) + 4).to(at::kFloat).to(cuda);
    int64_t correct = 0;
    linear_cross_entropy_sum(hidden, weight.to(cuda), at::full({9}, 13, at::kLong).to(cuda), 4, &correct);
    EXPECT_EQ(correct, 0) << "vocab " << v;
    correct = 0;
    linear_cross_entropy_sum(hidden, weight.to(cuda), at::full({9}, 4, at::kLong).to(cuda), 4, &correct);
    EXPECT_EQ(correct, 9) << "vocab " << v;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, LinearCrossEntropyKernels, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Portable" : "Avx2WhereAvailable"; });

// In a bf16 run the head's products run in bf16, as Hugging Face's lm_head under bf16
// autocast: the reference is ATen's linear on bf16 copies, its logits taken to fp32 for
// cross_entropy, under autograd. The inputs are bf16 values held in fp32, so the fp32 path
// would differ from the reference only by the roundings the bf16 path must make (checked: it
// does differ, so the comparisons can tell the paths apart).
TEST(LinearCrossEntropy, Bf16ProductsAreThoseOfAutocast) {
  torch::manual_seed(21);
  const int64_t n = 37, c = 24, v = 301;
  for (int64_t chunk : {5, 1024}) {
    SCOPED_TRACE(chunk);
    const auto bf16_values = [](at::Tensor t) { return t.to(at::kBFloat16).to(at::kFloat); };
    at::Tensor hidden = bf16_values(at::randn({n, c})).requires_grad_(true);
    at::Tensor weight = bf16_values(at::randn({v, c}).div_(2)).requires_grad_(true);
    at::Tensor targets = at::randint(v, {n}, at::kLong);
    targets.index_put_({at::arange(0, n, 4)}, -100);

    int64_t correct = 0;
    at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, &correct, at::kBFloat16);
    at::Tensor h_ref = hidden.detach().clone().requires_grad_(true);
    at::Tensor w_ref = weight.detach().clone().requires_grad_(true);
    at::Tensor logits = at::mm(h_ref.to(at::kBFloat16), w_ref.to(at::kBFloat16).t()).to(at::kFloat);
    at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100);
    expect_close(loss, loss_ref, 1e-6, "loss");
    const at::Tensor loss_fp32 = linear_cross_entropy_sum(hidden.detach(), weight.detach(), targets, chunk);
    EXPECT_GT((loss_fp32 - loss_ref).abs().item<double>(), 4 * 1e-6 * loss_ref.abs().item<double>())
        << "the fp32 path is as close: the test cannot tell them apart";
    at::Tensor kept = targets != -100;
    EXPECT_EQ(correct,
              (logits.detach().argmax(1).masked_select(kept) == targets.masked_select(kept)).sum().item<int64_t>());

    loss.backward();
    loss_ref.backward();
    // d hidden is a bf16 product: bf16 values, equal to the reference's but where a
    // probability's fp32 rounding fell on the other side of a bf16 one.
    const at::Tensor dh = hidden.grad(), dh_ref = h_ref.grad();
    EXPECT_TRUE(at::equal(dh, bf16_values(dh))) << "d hidden is not a bf16 product";
    const double same = (dh == dh_ref).to(at::kDouble).mean().item<double>();
    EXPECT_GT(same, 0.9) << "d hidden equals the reference's in only " << same << " of its elements";
    expect_close(dh, dh_ref, 1e-2, "grad hidden");
    // dW sums the exact products of the bf16 d logits and hidden in fp32 (not rounded to
    // bf16 as autocast's is): against that sum in fp64.
    at::Tensor d_logits = at::softmax(logits.detach(), 1);
    d_logits.scatter_add_(1, targets.clamp_min(0).unsqueeze(1), -at::ones({n, 1}));
    d_logits.index_put_({targets == -100}, 0);
    const at::Tensor dw_exact =
        at::mm(bf16_values(d_logits).to(at::kDouble).t(), hidden.detach().to(at::kDouble)).to(at::kFloat);
    expect_close(weight.grad(), dw_exact, 2e-3, "grad weight");
    expect_close(w_ref.grad(), dw_exact, 1e-2, "the reference's grad weight");
  }
}

// Smoothing in a bf16 run: the logits as bf16 products taken to fp32, then ATen's smoothed
// loss on them; d logits = softmax - (1 - e) onehot - e / V rounded to bf16 for the products.
TEST(LinearCrossEntropy, Bf16LabelSmoothingIsAtensOnTheBf16Logits) {
  torch::manual_seed(22);
  const int64_t n = 21, c = 16, v = 157;
  const double eps = 0.2;
  const auto bf16_values = [](at::Tensor t) { return t.to(at::kBFloat16).to(at::kFloat); };
  at::Tensor hidden = bf16_values(at::randn({n, c})).requires_grad_(true);
  at::Tensor weight = bf16_values(at::randn({v, c}).div_(2)).requires_grad_(true);
  at::Tensor targets = at::randint(v, {n}, at::kLong);
  targets.index_put_({at::arange(0, n, 4)}, -100);
  at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, 5, nullptr, at::kBFloat16, eps);
  at::Tensor h_ref = hidden.detach().clone().requires_grad_(true);
  at::Tensor w_ref = weight.detach().clone().requires_grad_(true);
  at::Tensor logits = at::mm(h_ref.to(at::kBFloat16), w_ref.to(at::kBFloat16).t()).to(at::kFloat);
  at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100, eps);
  expect_close(loss, loss_ref, 1e-6, "loss");
  loss.backward();
  loss_ref.backward();
  expect_close(hidden.grad(), h_ref.grad(), 1e-2, "grad hidden");
  at::Tensor d_logits = at::softmax(logits.detach(), 1).sub_(eps / v);
  d_logits.scatter_add_(1, targets.clamp_min(0).unsqueeze(1), -(1 - eps) * at::ones({n, 1}));
  d_logits.index_put_({targets == -100}, 0);
  const at::Tensor dw_exact =
      at::mm(bf16_values(d_logits).to(at::kDouble).t(), hidden.detach().to(at::kDouble)).to(at::kFloat);
  expect_close(weight.grad(), dw_exact, 2e-3, "grad weight");
}

// The cap in a bf16 run as transformers' Gemma 2 head computes it: bf16 logits, `/ c`, tanh and
// `* c` each rounded to bf16, then fp32 for the loss; backward through the same bf16 ops.
// The reference is that op chain under autograd (its d logits rounded to bf16 where autograd
// rounds them), with dW summed in fp64 from the reference's own bf16 d logits.
TEST(LinearCrossEntropy, Bf16SoftcapIsTheBf16OpChainOfTransformers) {
  torch::manual_seed(24);
  const int64_t n = 21, c = 16, v = 157;
  const double cap = 2.5;
  const auto bf16_values = [](at::Tensor t) { return t.to(at::kBFloat16).to(at::kFloat); };
  at::Tensor hidden = bf16_values(at::randn({n, c})).requires_grad_(true);
  at::Tensor weight = bf16_values(at::randn({v, c}).div_(2)).requires_grad_(true);
  at::Tensor targets = at::randint(v, {n}, at::kLong);
  targets.index_put_({at::arange(0, n, 4)}, -100);
  at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, 5, nullptr, at::kBFloat16, 0, nullptr, cap);
  at::Tensor h_ref = hidden.detach().clone().requires_grad_(true);
  at::Tensor w_ref = weight.detach().clone().requires_grad_(true);
  at::Tensor raw = at::mm(h_ref.to(at::kBFloat16), w_ref.to(at::kBFloat16).t());
  raw.retain_grad();
  at::Tensor logits = (at::tanh(raw / cap) * cap).to(at::kFloat);
  at::Tensor loss_ref = at::cross_entropy_loss(logits, targets, {}, at::Reduction::Sum, -100);
  expect_close(loss, loss_ref, 1e-6, "loss");
  loss.backward();
  loss_ref.backward();
  expect_close(hidden.grad(), h_ref.grad(), 1e-2, "grad hidden");
  const at::Tensor dw_exact = at::mm(raw.grad().to(at::kDouble).t(), hidden.detach().to(at::kDouble)).to(at::kFloat);
  expect_close(weight.grad(), dw_exact, 2e-3, "grad weight");
  // Without the cap the loss differs: the test sees it.
  const at::Tensor uncapped = linear_cross_entropy_sum(hidden.detach(), weight.detach(), targets, 5, nullptr, at::kBFloat16);
  EXPECT_GT((uncapped - loss).abs().item<double>(), 1.0);
}

// The bf16 path on CUDA (dW through cuBLAS with an fp32 result) against the CPU's (dW as the
// fp32 product of the same bf16 values): the same sums in another order.
TEST(LinearCrossEntropy, Bf16OnCudaEqualsTheCpu_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  const c10::Device cuda(c10::kCUDA, 0);
  torch::manual_seed(12);
  const int64_t n = 45, c = 32, v = 304;
  at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
  at::Tensor weight = at::randn({v, c}).div_(2).requires_grad_(true);
  at::Tensor targets = at::randint(v, {n}, at::kLong);
  targets.index_put_({at::arange(0, n, 5)}, -100);
  for (int64_t chunk : {7, 1024}) {
    SCOPED_TRACE(chunk);
    hidden.mutable_grad() = at::Tensor();
    weight.mutable_grad() = at::Tensor();
    int64_t correct = 0, correct_gpu = 0;
    at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, chunk, &correct, at::kBFloat16);
    at::Tensor hg = hidden.detach().to(cuda).requires_grad_(true);
    at::Tensor wg = weight.detach().to(cuda).requires_grad_(true);
    at::Tensor loss_gpu = linear_cross_entropy_sum(hg, wg, targets.to(cuda), chunk, &correct_gpu, at::kBFloat16);
    expect_close(loss_gpu.cpu(), loss, 1e-5, "loss");
    EXPECT_EQ(correct_gpu, correct);
    loss.backward();
    loss_gpu.backward();
    expect_close(hg.grad().cpu(), hidden.grad(), 1e-2, "grad hidden");
    expect_close(wg.grad().cpu(), weight.grad(), 1e-4, "grad weight");
  }
}

// On CUDA a bf16 loss forms the softmax and d loss / d logits in one kernel over the bf16
// logits (models/layers/cuda/cross_entropy_cuda_kernels.h), where the route it replaces took
// them to fp32 for the fp32 softmax pass and ATen's scaling and rounding. It must give that
// route's bits: the loss, the count of right predictions and both gradients, with and
// without gradients, over vocabularies read one element at a time (301, 4999) and four at a
// time (304, 5000; past one pass of the CTA's threads), chunks that split the rows unevenly,
// and the first of tied maxima. And it must hold no fp32 copy of the logits (the memory
// estimate counts 2 bytes per logit on CUDA): the forward's peak is that much lower.
TEST(LinearCrossEntropy, Bf16OnCudaTheOnePassKernelGivesTheFp32RoutesBits_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  namespace mm = memtune::models;
  const c10::Device cuda(c10::kCUDA, 0);
  struct Restore {
    ~Restore() { mm::detail::use_fused_bf16_softmax(true); }
  } restore;
  torch::manual_seed(13);
  struct Result {
    at::Tensor loss, dh, dw;
    int64_t correct = 0;
  };
  auto run = [&](bool fused, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                 int64_t chunk, bool grad) {
    mm::detail::use_fused_bf16_softmax(fused);
    Result r;
    at::Tensor h = hidden.detach().clone().requires_grad_(grad);
    at::Tensor w = weight.detach().clone().requires_grad_(grad);
    r.loss = linear_cross_entropy_sum(h, w, targets, chunk, &r.correct, at::kBFloat16);
    if (grad) {
      r.loss.backward();
      r.dh = h.grad();
      r.dw = w.grad();
    }
    return r;
  };
  for (int64_t v : {301, 304, 4999, 5000}) {
    for (int64_t chunk : {7, 1024}) {
      SCOPED_TRACE("vocab " + std::to_string(v) + " chunk " + std::to_string(chunk));
      const int64_t n = 45, c = 32;
      const at::Tensor hidden = at::randn({n, c}, cuda);
      const at::Tensor weight = at::randn({v, c}, cuda).div_(2);
      at::Tensor targets = at::randint(v, {n}, at::TensorOptions(cuda).dtype(at::kLong));
      targets.index_put_({at::arange(0, n, 5, targets.options())}, -100);
      const at::Tensor best = at::mm(hidden.to(at::kBFloat16), weight.to(at::kBFloat16).t()).argmax(1);
      for (int64_t i = 1; i < n; i += 3)
        if (targets[i].item<int64_t>() >= 0) targets[i] = best[i];
      for (bool grad : {true, false}) {
        SCOPED_TRACE(grad ? "with gradients" : "loss only");
        const Result ref = run(false, hidden, weight, targets, chunk, grad);
        const Result got = run(true, hidden, weight, targets, chunk, grad);
        EXPECT_TRUE(at::equal(got.loss, ref.loss)) << got.loss.item<float>() << " against " << ref.loss.item<float>();
        EXPECT_EQ(got.correct, ref.correct);
        EXPECT_GT(ref.correct, 5);
        if (!grad) continue;
        EXPECT_TRUE(at::equal(got.dh, ref.dh)) << "d hidden: " << (got.dh - ref.dh).abs().max().item<float>();
        EXPECT_TRUE(at::equal(got.dw, ref.dw)) << "d weight: " << (got.dw - ref.dw).abs().max().item<float>();
      }
    }
  }
  // Tied maxima (TiedMaximaCountTheFirstIndex's construction: small integers, exact in bf16).
  for (int64_t v : {19, 20}) {
    at::Tensor weight = at::randint(-1, 2, {v, 6}).to(at::kFloat);
    weight[4] = 3;
    weight[13] = 3;
    const at::Tensor hidden = (at::randint(-1, 2, {9, 6}) + 4).to(at::kFloat).to(cuda);
    for (int64_t target : {13, 4}) {
      const Result r = run(true, hidden, weight.to(cuda), at::full({9}, target, at::kLong).to(cuda), 4, true);
      EXPECT_EQ(r.correct, target == 4 ? 9 : 0) << "vocab " << v << ", every target " << target;
    }
  }
  // One chunk of 64 rows of a 8192 vocabulary: its fp32 copy is 2 MiB.
  memtune::MemoryBackend& memory = memtune::memory_backend(cuda);
  const int64_t n = 64, v = 8192;
  const at::Tensor hidden = at::randn({n, 32}, cuda), weight = at::randn({v, 32}, cuda);
  const at::Tensor targets = at::randint(v, {n}, at::TensorOptions(cuda).dtype(at::kLong));
  auto peak_of = [&](bool fused) {
    torch::cuda::synchronize();
    memory.reset_peak();
    const int64_t before = memory.stats().allocated;
    run(fused, hidden, weight, targets, n, true);
    torch::cuda::synchronize();
    return memory.stats().peak - before;
  };
  run(false, hidden, weight, targets, n, true);  // cuBLAS's workspace and the like, before either is measured
  run(true, hidden, weight, targets, n, true);
  const int64_t unfused = peak_of(false), fused = peak_of(true);
  EXPECT_GE(unfused - fused, n * v * 4 * 3 / 4) << "peak " << fused << " bytes against " << unfused;
}

TEST(LinearCrossEntropy, FrozenWeightGetsNoGradient) {
  at::Tensor hidden = at::randn({6, 8}).requires_grad_(true);
  at::Tensor weight = at::randn({11, 8});
  at::Tensor loss = linear_cross_entropy_sum(hidden, weight, at::randint(11, {6}, at::kLong), 4);
  loss.backward();
  EXPECT_TRUE(hidden.grad().defined());
  EXPECT_FALSE(weight.grad().defined());
}

// The loss forms dW (V,C) and dh in the forward; its backward scales them by the loss's
// gradient in place, so no second (V,C) appears beside the saved one (the accumulators take
// them as they are: the backward allocates next to nothing). When the graph is kept for
// another backward it scales copies: the second backward gives the same gradient again.
TEST(LinearCrossEntropy, BackwardScalesInPlaceUnlessTheGraphIsKept) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(5);
  const int64_t n = 16, c = 64, v = 2048;
  const int64_t vc = v * c * 4;  // 512 KiB
  at::Tensor hidden = at::randn({n, c}).requires_grad_(true);
  at::Tensor weight = at::randn({v, c}).div_(8).requires_grad_(true);
  at::Tensor targets = at::randint(v, {n}, at::kLong);

  at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, 1024) * 0.5;
  loss.backward({}, /*retain_graph=*/true);
  const at::Tensor w1 = weight.grad().clone(), h1 = hidden.grad().clone();
  loss.backward();  // the last: in place
  EXPECT_TRUE(at::equal(weight.grad(), w1 * 2)) << "the kept graph's dW was changed by the first backward";
  EXPECT_TRUE(at::equal(hidden.grad(), h1 * 2));

  weight.mutable_grad() = at::Tensor();
  hidden.mutable_grad() = at::Tensor();
  at::Tensor again = linear_cross_entropy_sum(hidden, weight, targets, 1024) * 0.5;
  const int64_t before = memtune::cpu_allocated_bytes();
  memtune::ScopedPeakReset peak;
  again.backward();
  EXPECT_TRUE(at::equal(weight.grad(), w1)) << "in place: other bits";
  EXPECT_TRUE(at::equal(hidden.grad(), h1));
  EXPECT_LT(peak.peak() - before, vc / 8) << "a second (V,C) dW in the backward";
}

}  // namespace

namespace {

// The soft-capped loss's peak beyond its inputs is the memory model's (trainer/estimator.cpp):
// per logit of a chunk, in fp32 the logits and their tanh (8 bytes); in bf16 the fp32 logits,
// the bf16 tanh and the bf16 d logits (8 bytes): d logits taken through the cap in place.
TEST(LinearCrossEntropy, SoftcappedLossPeakIsTheMemoryModels) {
  memtune::install_cpu_budget_allocator();
  torch::manual_seed(7);
  const int64_t n = 256, c = 16, v = 4096;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    at::Tensor hidden = at::randn({n, c}).to(dtype).requires_grad_(true);
    at::Tensor weight = at::randn({v, c}).to(dtype);  // frozen: no dW
    at::Tensor targets = at::randint(v, {n}, at::kLong);
    const int64_t before = memtune::cpu_allocated_bytes();
    memtune::ScopedPeakReset peak;
    at::Tensor loss = linear_cross_entropy_sum(hidden, weight, targets, n, nullptr, dtype, 0, nullptr, 30.0);
    const int64_t logits = n * v * 8;
    const int64_t rest = peak.peak() - before - logits;  // rows, their gradient, row statistics
    std::cout << c10::toString(dtype) << ": peak beyond the inputs " << peak.peak() - before << " bytes, "
              << logits << " of them the chunk's logits\n";
    EXPECT_GE(rest, 0) << "below the model's bytes per logit";
    // A CPU bf16 product converts its operands to fp32 while it runs (the head: v c 4 bytes).
    EXPECT_LT(rest, n * v / 4 + v * c * 4) << "past the model's 8 bytes per logit";
  }
}

}  // namespace
