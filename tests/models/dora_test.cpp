// DoRA (lora.use_dora, models/layers/dora.h) against its definition: the magnitude starts at
// the base's row norms (so the model starts as the base), a 4-bit base computes as its
// dequantized weights do, merging gives the same model, the block-by-block norm is the norm,
// and PEFT's file layout round-trips. Values against transformers + PEFT's semantics are in
// hf_reference_itest (DoraMatches) and optimizer_itest (training).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "data/batch.h"
#include "models/causal_lm.h"
#include "models/hf_model.h"
#include "models/io/safetensors.h"
#include "models/layers/dora.h"
#include "models/lora.h"
#include "models/model_spec.h"
#include "models/peft.h"
#include "runtime/error.h"
#include "runtime/keyed_dropout.h"
#include "runtime/nf4.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

data::Batch batch_of(int64_t vocab, int64_t T, uint64_t seed) {
  at::Tensor ids = at::randint(vocab, {T}, at::detail::createCPUGenerator(seed), at::kInt);
  data::Sample s;
  for (int64_t t = 0; t < T; ++t) {
    s.input_ids.push_back(ids[t].item<int32_t>());
    s.targets.push_back(ids[(t + 1) % T].item<int32_t>());
    s.position_ids.push_back(static_cast<int32_t>(t));
    s.segment_ids.push_back(0);
  }
  return data::collate({s, s}, 8, 0);
}

models::ForwardOutput run(models::CausalLM& model, const data::Batch& batch, bool training = false) {
  models::ForwardOptions fo;
  fo.training = training;
  fo.return_logits = true;
  return model.forward(batch, fo);
}

std::unique_ptr<models::CausalLM> tiny(const std::string& preset, bool nf4) {
  auto model = models::init_random_model(*models::preset(preset), 5);
  if (nf4)
    for (models::Linear* l : model->linears()) l->quantize(64, true, QuantType::kNF4);
  return model;
}

// DoRA adapters on every projection, moved off their start: B random, magnitudes 20 % off
// the norms, so that every term of the forward takes part.
void add_trained_dora(models::CausalLM& model, uint64_t seed) {
  models::LoraOptions o;
  o.r = 4;
  o.alpha = 8;
  o.use_dora = true;
  at::manual_seed(seed);
  models::apply_lora(model, o, {});
  at::NoGradGuard g;
  for (models::Linear* l : model.linears()) {
    l->lora->B.normal_(0, 0.05);
    l->lora->magnitude.mul_(at::rand_like(l->lora->magnitude) * 0.4 + 0.8);
  }
}

TEST(Dora, TheMagnitudeStartsAtTheRowNormsAndTheModelAsTheBase) {
  for (const auto& [preset, nf4] : std::vector<std::pair<std::string, bool>>{
           {"tiny-llama", false}, {"tiny-llama", true}, {"tiny-gpt2", false}, {"tiny-qwen3", true}}) {
    const std::string what = preset + (nf4 ? " NF4" : " dense");
    auto model = tiny(preset, nf4);
    const data::Batch batch = batch_of(model->spec().vocab_size, 24, 3);
    const at::Tensor before = run(*model, batch).logits;
    models::LoraOptions o;
    o.use_dora = true;
    const models::LoraSummary summary = models::apply_lora(*model, o, {});
    int64_t expected = 0;
    for (models::Linear* l : model->linears()) {
      if (!l->lora) continue;
      ASSERT_TRUE(l->lora->dora()) << what;
      EXPECT_TRUE(l->lora->magnitude.requires_grad());
      // ||W|| over each output row in float64, W [out, in] as the projection multiplies it.
      const at::Tensor norms = l->dense_weight().to(at::kDouble).pow(2).sum(1).sqrt();
      expect_close(l->lora->magnitude, norms.to(at::kFloat), 1e-6, what + " " + l->name());
      expected += l->lora->A.numel() + l->lora->B.numel() + l->out_features();
    }
    EXPECT_EQ(summary.trainable_parameters, expected) << what;
    expect_close(run(*model, batch).logits, before, 1e-5, what);
  }
}

TEST(Dora, TheNormIsTakenBlockByBlock) {
  // Rows of 65,536: blocks of 16 rows, so 40 rows take three blocks.
  const int64_t out = 40, in = 65536, r = 3;
  ASSERT_LT(models::dora_norm_rows(in), out);
  at::manual_seed(2);
  const at::Tensor W = at::randn({out, in}), A = at::randn({r, in}) * 0.01, B = at::randn({out, r});
  const at::Tensor n = models::dora_weight_norm([&](int64_t r0, int64_t k) { return W.narrow(0, r0, k); }, out, A, B,
                                                1.5, at::kFloat);
  const at::Tensor expected = (W.to(at::kDouble) + 1.5 * at::mm(B.to(at::kDouble), A.to(at::kDouble))).norm(2, {1});
  expect_close(n, expected.to(at::kFloat), 1e-6, "blocked norm");
  EXPECT_FALSE(n.requires_grad());
}

// A 4-bit base computes as a dense model holding its dequantized weights: the same logits and
// the same gradients for A, B and the magnitudes.
TEST(Dora, A4BitBaseComputesAsItsDequantizedWeights) {
  for (const std::string preset : {"tiny-llama", "tiny-gpt2"}) {
    auto q = tiny(preset, true);
    auto dense = tiny(preset, false);
    {
      at::NoGradGuard g;
      for (size_t k = 0; k < q->linears().size(); ++k) {
        models::Linear* d = dense->linears()[k];
        const at::Tensor w = q->linears()[k]->dense_weight();
        d->weight = d->fan_in_fan_out() ? w.t().contiguous() : w;
      }
    }
    add_trained_dora(*q, 7);
    add_trained_dora(*dense, 7);
    {
      at::NoGradGuard g;
      for (size_t k = 0; k < q->linears().size(); ++k)
        dense->linears()[k]->lora->magnitude.copy_(q->linears()[k]->lora->magnitude);
    }
    const data::Batch batch = batch_of(q->spec().vocab_size, 24, 4);
    models::ForwardOutput a = run(*q, batch, true), b = run(*dense, batch, true);
    expect_close(a.logits, b.logits, 1e-5, preset + " logits");
    (a.loss_sum / static_cast<double>(a.target_tokens)).backward();
    (b.loss_sum / static_cast<double>(b.target_tokens)).backward();
    for (size_t k = 0; k < q->linears().size(); ++k) {
      const models::LoraAdapter &x = *q->linears()[k]->lora, &y = *dense->linears()[k]->lora;
      const std::string what = preset + " " + q->linears()[k]->name();
      expect_close(x.A.grad(), y.A.grad(), 1e-4, what + " A");
      expect_close(x.B.grad(), y.B.grad(), 1e-4, what + " B");
      expect_close(x.magnitude.grad(), y.magnitude.grad(), 1e-4, what + " magnitude");
      EXPECT_GT(x.magnitude.grad().abs().max().item<double>(), 0) << what;
    }
  }
}

// With LoRA dropout in training, PEFT's DoRA corrects the base's output with the dropped input's
// product: y = x W^T + b + (m/n - 1) (h W^T) + (m/n) s (h A^T) B^T, h the dropped x. One
// projection (dense and Conv1D-stored, with a bias) against that formula in float64, with the
// mask keyed dropout draws for it; and without dropout, m/n (x W^T + s (x A^T) B^T) + b.
TEST(Dora, DropoutCorrectsWithTheDroppedInputsProduct) {
  for (bool conv1d : {false, true}) {
    models::Linear l("model.layers.0.mlp.up_proj", 24, 40, true, conv1d);
    at::manual_seed(3);
    l.weight = conv1d ? at::randn({24, 40}) * 0.2 : at::randn({40, 24}) * 0.2;
    l.bias = at::randn({40}) * 0.1;
    models::LoraOptions o;
    o.r = 4;
    o.alpha = 8;
    o.dropout = 0.3;
    o.use_dora = true;
    l.add_lora(o);
    {
      at::NoGradGuard g;
      l.lora->B.normal_(0, 0.3);
      l.lora->magnitude.mul_(at::rand({40}) * 0.4 + 0.8);
    }
    const at::Tensor x = at::randn({2, 5, 24});
    DropoutKeysScope keys(DropoutKeys{{11, 12}, {5, 5}});
    const at::Tensor h = keyed_dropout(x, 0.3, dropout_site(l.name())).to(at::kDouble);
    auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
    const at::Tensor W = conv1d ? d(l.weight).t() : d(l.weight);
    const at::Tensor A = d(l.lora->A), B = d(l.lora->B), b = d(l.bias);
    const at::Tensor n = (W + 2.0 * at::mm(B, A)).norm(2, {1});
    const at::Tensor scale = d(l.lora->magnitude) / n;
    const at::Tensor xd = x.to(at::kDouble);
    const at::Tensor expected_train = at::matmul(xd, W.t()) + b + (scale - 1) * at::matmul(h, W.t()) +
                                      scale * 2.0 * at::matmul(at::matmul(h, A.t()), B.t());
    const at::Tensor expected_eval = scale * (at::matmul(xd, W.t()) + 2.0 * at::matmul(at::matmul(xd, A.t()), B.t())) + b;
    const std::string what = conv1d ? "Conv1D" : "Linear";
    ASSERT_FALSE(at::allclose(h, xd)) << "dropout dropped nothing";
    expect_close(l.forward(x, true), expected_train.to(at::kFloat), 1e-5, what + " training", 1.0);
    expect_close(l.forward(x, false), expected_eval.to(at::kFloat), 1e-5, what + " evaluation", 1.0);
  }
}

TEST(Dora, MergingGivesTheSameModel) {
  for (const auto& [preset, nf4] : std::vector<std::pair<std::string, bool>>{
           {"tiny-llama", false}, {"tiny-llama", true}, {"tiny-gpt2", false}}) {
    const std::string what = preset + (nf4 ? " NF4" : " dense");
    auto model = tiny(preset, nf4);
    add_trained_dora(*model, 9);
    const data::Batch batch = batch_of(model->spec().vocab_size, 24, 5);
    const at::Tensor adapted = run(*model, batch).logits;
    auto plain = tiny(preset, nf4);
    EXPECT_GT((run(*plain, batch).logits - adapted).abs().max().item<double>(), 1e-2) << what << ": DoRA changes nothing";
    for (models::Linear* l : model->linears()) l->merge_lora();
    for (models::Linear* l : model->linears()) ASSERT_FALSE(l->lora) << what;
    expect_close(run(*model, batch).logits, adapted, 2e-5, what);
  }
}

TEST(Dora, PeftsFileLayoutRoundTrips) {
  auto model = tiny("tiny-llama", true);
  add_trained_dora(*model, 11);
  const fs::path dir = temp_dir() / "adapter";
  models::AdapterConfig config;
  config.lora.r = 4;
  config.lora.alpha = 8;
  config.lora.use_dora = true;
  models::save_adapter(*model, config, dir);
  const auto json = nlohmann::json::parse(read_file(dir / "adapter_config.json"));
  EXPECT_TRUE(json["use_dora"].get<bool>());
  models::SafetensorsFile file(dir / "adapter_model.safetensors");
  for (models::Linear* l : model->linears()) {
    const at::Tensor m = file.load("base_model.model." + l->name() + ".lora_magnitude_vector");
    EXPECT_TRUE(same_bits(m, l->lora->magnitude.detach())) << l->name();
  }
  EXPECT_EQ(file.names().size(), 3 * model->linears().size());

  auto loaded = tiny("tiny-llama", true);
  const models::LoraSummary s = models::load_adapter(*loaded, dir);
  for (size_t k = 0; k < loaded->linears().size(); ++k) {
    const models::LoraAdapter& a = *loaded->linears()[k]->lora;
    ASSERT_TRUE(a.dora());
    EXPECT_TRUE(a.magnitude.requires_grad());
    EXPECT_TRUE(same_bits(a.magnitude.detach(), model->linears()[k]->lora->magnitude.detach()));
  }
  const data::Batch batch = batch_of(model->spec().vocab_size, 16, 6);
  expect_close(run(*loaded, batch).logits, run(*model, batch).logits, 0, "loaded");
  int64_t n = 0;
  for (const auto& [name, t] : loaded->trainable_parameters()) n += t.numel();
  EXPECT_EQ(s.trainable_parameters, n);
}

// An adapter file whose tensors and use_dora disagree is refused by name, as is DoRA on an
// 8-bit base, rather than loaded as another model.
TEST(Dora, FilesThatDisagreeWithUseDoraAreRefused) {
  auto model = tiny("tiny-llama", false);
  add_trained_dora(*model, 12);
  const fs::path root = temp_dir(), dir = root / "adapter";
  models::AdapterConfig config;
  config.lora.r = 4;
  config.lora.use_dora = true;
  models::save_adapter(*model, config, dir);
  auto rewrite = [&](bool use_dora, bool drop_one_magnitude) {
    auto c = nlohmann::json::parse(read_file(dir / "adapter_config.json"));
    c["use_dora"] = use_dora;
    const fs::path d = root / (use_dora ? "dropped" : "no_dora");
    fs::create_directories(d);
    write_file(d / "adapter_config.json", c.dump());
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    models::SafetensorsFile f(dir / "adapter_model.safetensors");
    bool dropped = false;
    for (const std::string& k : f.names()) {
      if (drop_one_magnitude && !dropped && k.find("lora_magnitude_vector") != std::string::npos) {
        dropped = true;
        continue;
      }
      tensors.emplace_back(k, f.load(k));
    }
    models::save_safetensors(d / "adapter_model.safetensors", tensors, {});
    return d;
  };
  auto error_of = [&](const fs::path& d, std::unique_ptr<models::CausalLM> target) {
    try {
      models::load_adapter(*target, d);
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(loaded)");
  };
  EXPECT_NE(error_of(rewrite(false, false), tiny("tiny-llama", false)).find("does not set use_dora: true"),
            std::string::npos);
  EXPECT_NE(error_of(rewrite(true, true), tiny("tiny-llama", false)).find("lacks its DoRA magnitude"),
            std::string::npos);
  auto int8 = tiny("tiny-llama", false);
  for (models::Linear* l : int8->linears()) l->quantize_int8(6.0);
  EXPECT_NE(error_of(dir, std::move(int8)).find("8-bit"), std::string::npos);
  EXPECT_EQ(error_of(dir, tiny("tiny-llama", false)), "(loaded)");
}

}  // namespace
}  // namespace memtune::testing
