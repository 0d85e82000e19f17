// Activation checkpointing: the gradients equal those of the plain forward (dropout on, so
// the rerun must replay the same random masks), and the memory kept between forward and
// backward falls as more layers are checkpointed.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "runtime/cpu_budget_allocator.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

data::Batch random_batch(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  std::vector<data::Sample> samples;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (int64_t b = 0; b < B; ++b) {
    data::Sample s;
    at::Tensor ids = at::randint(vocab, {T}, gen, at::kLong);
    for (int64_t t = 0; t < T; ++t) {
      s.input_ids.push_back(static_cast<int32_t>(ids[t].item<int64_t>()));
      s.targets.push_back(t + 1 < T ? static_cast<int32_t>(ids[(t + 1) % T].item<int64_t>()) : data::kIgnoreIndex);
      s.position_ids.push_back(static_cast<int32_t>(t));
      s.segment_ids.push_back(0);
    }
    samples.push_back(s);
  }
  return data::collate(samples, 1, 0);
}

std::unique_ptr<models::CausalLM> lora_model(const std::string& preset, double dropout) {
  auto model = models::init_random_model(*models::preset(preset), 11);
  models::LoraOptions o;
  o.r = 4;
  o.dropout = dropout;
  at::manual_seed(5);
  models::apply_lora(*model, o, {});
  // B starts at zero; give it values so the adapters shape the output and the gradients.
  at::NoGradGuard g;
  for (models::Linear* l : model->linears()) l->lora->B.normal_(0, 0.02);
  return model;
}

std::vector<at::Tensor> grads_of(models::CausalLM& model, const data::Batch& batch, bool checkpoint) {
  for (auto& [n, p] : model.trainable_parameters()) p.mutable_grad() = at::Tensor();
  models::ForwardOptions fo;
  fo.training = true;
  fo.checkpoint_layers.assign(model.num_layers(), checkpoint);
  at::manual_seed(1234);
  auto out = model.forward(batch, fo);
  out.loss_sum.backward();
  std::vector<at::Tensor> g;
  for (auto& [n, p] : model.trainable_parameters()) g.push_back(p.grad().clone());
  return g;
}

class Checkpointing : public ::testing::TestWithParam<std::string> {};

TEST_P(Checkpointing, GradientsEqualWithDropout) {
  auto model = lora_model(GetParam(), 0.1);
  data::Batch batch = random_batch(2, 32, 256, 3);
  auto plain = grads_of(*model, batch, false);
  auto ckpt = grads_of(*model, batch, true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    double scale = plain[i].abs().max().item<double>();
    EXPECT_GT(scale, 0) << i;
    EXPECT_LE((plain[i] - ckpt[i]).abs().max().item<double>(), 1e-6 * std::max(1.0, scale)) << i;
  }
  // Dropout really is on: another seed gives other gradients.
  for (auto& [n, p] : model->trainable_parameters()) p.mutable_grad() = at::Tensor();
  models::ForwardOptions fo;
  fo.training = true;
  at::manual_seed(999);
  model->forward(batch, fo).loss_sum.backward();
  double diff = 0;
  auto params = model->trainable_parameters();
  for (size_t i = 0; i < plain.size(); ++i) diff += (params[i].second.grad() - plain[i]).abs().sum().item<double>();
  EXPECT_GT(diff, 0);
}

INSTANTIATE_TEST_SUITE_P(Families, Checkpointing, ::testing::Values("tiny-llama", "tiny-gpt2"));

TEST(Checkpointing, KeptMemoryFallsWithMoreCheckpointedLayers) {
  install_cpu_budget_allocator();
  auto model = lora_model("tiny-llama", 0.0);
  data::Batch batch = random_batch(4, 128, 256, 3);
  std::vector<int64_t> kept;
  for (int every : {0, 2, 1}) {  // none, every 2nd, all
    models::ForwardOptions fo;
    fo.training = true;
    fo.checkpoint_layers.assign(model->num_layers(), false);
    for (int i = 0; every > 0 && i < model->num_layers(); i += every) fo.checkpoint_layers[i] = true;
    const int64_t before = cpu_allocated_bytes();
    auto out = model->forward(batch, fo);
    kept.push_back(cpu_allocated_bytes() - before);  // activations held for backward
    out.loss_sum.backward();
    for (auto& [n, p] : model->trainable_parameters()) p.mutable_grad() = at::Tensor();
    std::printf("checkpointing every %d: %lld bytes kept between forward and backward\n", every,
                static_cast<long long>(kept.back()));
  }
  EXPECT_GT(kept[0], kept[1]);
  EXPECT_GT(kept[1], kept[2]);
}

}  // namespace
}  // namespace memtune::testing
