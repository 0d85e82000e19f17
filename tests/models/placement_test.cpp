// Device placement: the `auto` planner on given sizes, the map's checks, and (on a GPU) a
// model split over cuda:0 and the CPU, with an offloaded layer, against the same model on
// the CPU alone: loss and every adapter gradient equal.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "data/batch.h"
#include "models/device_map.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "runtime/cuda_info.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using models::DeviceBudget;
using models::plan_auto;

const c10::Device kGpu0(c10::kCUDA, 0), kGpu1(c10::kCUDA, 1), kCpu(c10::kCPU);

std::vector<std::string> names(const std::vector<c10::Device>& devices) {
  std::vector<std::string> out;
  for (const auto& d : devices) out.push_back(d.str());
  return out;
}

TEST(PlanAuto, UnlimitedDeviceTakesEverything) {
  auto p = plan_auto(100, 0, {50, 50, 50}, {true, true, true}, {{kGpu0, 0}});
  EXPECT_EQ(names(p.placement.layers), (std::vector<std::string>{"cuda:0", "cuda:0", "cuda:0"}));
  EXPECT_EQ(p.offloaded, (std::vector<bool>{false, false, false}));
  EXPECT_EQ(p.placement.embeddings, kGpu0);
  EXPECT_EQ(p.placement.head, kGpu0);
}

TEST(PlanAuto, OneDeviceOffloadsTheLayersThatDoNotFitAfterEmbeddingsAndHead) {
  // 1000 bytes: 300 for embeddings and head leave room for 3 layers of 200.
  auto p = plan_auto(200, 100, {200, 200, 200, 200, 200}, std::vector<bool>(5, true), {{kCpu, 1000}});
  EXPECT_EQ(p.offloaded, (std::vector<bool>{false, false, false, true, true}));
  for (const auto& d : p.placement.layers) EXPECT_EQ(d, kCpu);  // offloaded layers compute there too
}

TEST(PlanAuto, TrainableLayersAreNeverOffloaded) {
  auto p = plan_auto(0, 0, {200, 200, 200}, {true, false, true}, {{kGpu0, 250}});
  EXPECT_EQ(p.offloaded, (std::vector<bool>{false, false, true}));
}

TEST(PlanAuto, LayersFillTheDevicesInOrderThenOffload) {
  // cuda:0: 100 + 3 x 200 = 700 of 750; cuda:1: 2 x 200 of 450; one layer left over.
  auto p = plan_auto(100, 0, std::vector<int64_t>(6, 200), std::vector<bool>(6, true), {{kGpu0, 750}, {kGpu1, 450}});
  EXPECT_EQ(names(p.placement.layers),
            (std::vector<std::string>{"cuda:0", "cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:1"}));
  EXPECT_EQ(p.offloaded, (std::vector<bool>{false, false, false, false, false, true}));
  EXPECT_EQ(names(models::devices_of(p.placement)), (std::vector<std::string>{"cuda:0", "cuda:1"}));
}

TEST(PlanAuto, ADeviceTooSmallForOneLayerIsSkipped) {
  auto p = plan_auto(0, 0, {300, 300}, {true, true}, {{kGpu0, 100}, {kGpu1, 0}});
  EXPECT_EQ(names(p.placement.layers), (std::vector<std::string>{"cuda:1", "cuda:1"}));
  EXPECT_EQ(p.offloaded, (std::vector<bool>{false, false}));
}

std::unique_ptr<models::CausalLM> lora_llama(bool quantize, bool tied = false) {
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.tie_word_embeddings = tied;
  auto model = models::init_random_model(spec, 7);
  if (quantize)
    for (models::Linear* l : model->linears()) l->quantize(64, true, memtune::QuantType::kNF4);
  models::LoraOptions o;
  o.r = 4;
  at::manual_seed(3);
  models::apply_lora(*model, o, {});
  at::NoGradGuard g;
  for (models::Linear* l : model->linears()) l->lora->B.normal_(0, 0.02);
  return model;
}

TEST(DeviceMapChecks, UnavailableDeviceAndSplitTiedHeadAreRefused) {
  auto model = lora_llama(false);
  const int visible = cuda_info().device_count;
  const std::string missing = "cuda:" + std::to_string(visible);
  try {
    models::apply_device_map(*model, "auto", {{"model.layers.1", missing}}, kCpu, {});
    FAIL() << "expected an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("model.device_map.model.layers.1: device '" + missing +
                                         "' is not available here"),
              std::string::npos)
        << e.what();
  }
  try {
    models::apply_device_map(*model, "auto", {{"model.layers.1.input_layernorm", "cpu"}}, kCpu, {});
    FAIL() << "expected an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("names a part of layer 1; a layer is placed as a whole (model.layers.1)"),
              std::string::npos)
        << e.what();
  }
  auto tied = lora_llama(false, true);
  EXPECT_THROW(models::apply_device_map(*tied, "auto", {{"lm_head", "cpu"}}, kGpu0, {}), UserError);
}

TEST(Placement, PlaceKeepsTrainableTensorsLeavesOnTheirDevice) {
  auto model = lora_llama(false);
  models::Placement p;
  p.layers.assign(model->num_layers(), kCpu);
  model->place(p);
  for (const auto& [name, t] : model->trainable_parameters()) {
    EXPECT_TRUE(t.is_leaf()) << name;
    EXPECT_TRUE(t.requires_grad()) << name;
  }
}

data::Batch packed_batch() {
  // Two rows; the second holds two documents (positions restart, no attention across them).
  std::vector<data::Sample> samples(2);
  for (int b = 0; b < 2; ++b)
    for (int t = 0; t < 24; ++t) {
      samples[b].input_ids.push_back((7 * t + 13 * b + 1) % 1000);
      samples[b].targets.push_back(t + 1 < 24 ? (7 * (t + 1) + 13 * b + 1) % 1000 : data::kIgnoreIndex);
      const bool second = b == 1 && t >= 10;
      samples[b].position_ids.push_back(second ? t - 10 : t);
      samples[b].segment_ids.push_back(second ? 1 : 0);
    }
  return data::collate(samples, 1, 0);
}

std::pair<double, std::vector<at::Tensor>> loss_and_grads(models::CausalLM& model, const data::Batch& batch) {
  models::ForwardOptions fo;
  fo.training = true;
  fo.checkpoint_layers = {false, true, false, false};
  auto out = model.forward(batch, fo);
  out.loss_sum.backward();
  std::vector<at::Tensor> grads;
  for (auto& [name, t] : model.trainable_parameters()) grads.push_back(t.grad().to(kCpu));
  return {out.loss_sum.item<double>(), grads};
}

TEST(Placement, SplitOverCudaAndCpuWithAnOffloadedLayerEqualsTheCpu_CUDA) {
  MEMTUNE_SKIP_WITHOUT_CUDA();
  for (bool quantize : {false, true}) {
    SCOPED_TRACE(quantize ? "NF4 base" : "dense base");
    auto cpu = lora_llama(quantize);
    auto split = lora_llama(quantize);
    ASSERT_EQ(split->num_layers(), 4);
    // Embeddings and head on cuda:0; layers 0-1 on cuda:0 (layer 1 offloaded), 2-3 on the CPU.
    std::string plan = models::apply_device_map(
        *split, "auto", {{"model.layers.0-1", "cuda:0"}, {"model.layers.1", "offload"}, {"model.layers.2-3", "cpu"}},
        kGpu0, {});
    EXPECT_EQ(plan, "device map: embeddings cuda:0, layer 0: cuda:0, layer 1: offload to cuda:0, layers 2-3: cpu, "
                    "head cuda:0");
    for (const auto& [name, t] : split->trainable_parameters())
      EXPECT_EQ(t.device(), name.find("layers.2") != std::string::npos || name.find("layers.3") != std::string::npos
                                ? kCpu
                                : kGpu0)
          << name;
    const data::Batch batch = packed_batch();
    auto [loss_cpu, grads_cpu] = loss_and_grads(*cpu, batch);
    auto [loss_split, grads_split] = loss_and_grads(*split, batch);
    EXPECT_NEAR(loss_split, loss_cpu, 1e-4 * std::abs(loss_cpu));
    ASSERT_EQ(grads_cpu.size(), grads_split.size());
    for (size_t i = 0; i < grads_cpu.size(); ++i) {
      const double scale = grads_cpu[i].abs().max().item<double>();
      EXPECT_LT((grads_split[i] - grads_cpu[i]).abs().max().item<double>(), 1e-4 * scale + 1e-7) << i;
    }
  }
}

}  // namespace
}  // namespace memtune::testing
