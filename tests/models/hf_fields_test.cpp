// config.json fields whose effect transformers defines and memtune reproduces: the embedding's
// padding row (pad_token_id) gets no gradient, and quantization_config describes the tensors
// stored beside it (refused over dense projections; dropped when the model is saved dense).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/lora.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using nlohmann::json;

// The embedding table's gradient after one forward and backward of a full fine-tune over ids
// that include `id` (untied, so only the lookup writes the table's gradient).
at::Tensor embedding_grad(std::optional<int64_t> pad_token_id, int32_t id) {
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.tie_word_embeddings = false;
  spec.pad_token_id = pad_token_id;
  auto model = models::init_random_model(spec, 3);
  models::make_all_trainable(*model);
  std::vector<data::Sample> samples(1);
  data::Sample& s = samples[0];
  for (int32_t t = 0; t < 16; ++t) {
    s.input_ids.push_back(t % 4 == 0 ? id : 20 + t);
    s.targets.push_back(t + 1 < 16 ? 30 + t : data::kIgnoreIndex);
    s.position_ids.push_back(t);
    s.segment_ids.push_back(0);
  }
  models::ForwardOptions fo;
  fo.training = true;
  model->forward(data::collate(samples, 1, 0), fo).loss_sum.backward();
  for (auto& [name, p] : model->trainable_parameters())
    if (name == "model.embed_tokens.weight") return p.grad();
  ADD_FAILURE() << "no model.embed_tokens.weight";
  return at::Tensor();
}

// transformers: nn.Embedding(vocab, hidden, padding_idx=pad_token_id).
TEST(HfFields, ThePaddingRowOfTheEmbeddingGetsNoGradient) {
  const at::Tensor with_pad = embedding_grad(7, 7), without = embedding_grad(std::nullopt, 7);
  EXPECT_EQ(with_pad[7].abs().max().item<float>(), 0.0f);
  EXPECT_GT(without[7].abs().max().item<float>(), 0.0f);
  // Every other row as without a padding index.
  EXPECT_TRUE(at::equal(with_pad.narrow(0, 8, with_pad.size(0) - 8), without.narrow(0, 8, without.size(0) - 8)));
  EXPECT_GT(with_pad[21].abs().max().item<float>(), 0.0f);
}

// transformers 5 writes the checkpoint's dtype as `dtype` (and reads it before torch_dtype): a
// model saved in another dtype than it was loaded in says the new one under both names, so
// model.torch_dtype: auto and transformers read what the file holds.
TEST(HfFields, TheSavedDtypeIsNamedUnderBothKeys) {
  const fs::path d = temp_dir();
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.extra["dtype"] = "float32";  // as transformers 5 wrote it
  auto model = models::init_random_model(spec, 1);
  models::SaveOptions o;
  o.dtype = at::kBFloat16;
  models::save_hf_model(*model, d / "half", o);
  const json written = json::parse(read_file(d / "half/config.json"));
  EXPECT_EQ(written["torch_dtype"], "bfloat16");
  EXPECT_EQ(written["dtype"], "bfloat16");
  models::save_hf_model(*models::init_random_model(*models::preset("tiny-llama"), 1), d / "plain", o);
  EXPECT_FALSE(json::parse(read_file(d / "plain/config.json")).contains("dtype"));  // not added where absent
}

TEST(HfFields, QuantizationConfigDescribesTheStoredTensors) {
  const fs::path d = temp_dir();
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.extra["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  auto model = models::init_random_model(spec, 1);
  models::save_hf_model(*model, d / "dense", models::SaveOptions{});
  const json written = json::parse(read_file(d / "dense/config.json"));
  EXPECT_FALSE(written.contains("quantization_config")) << written.dump();  // dense tensors: none

  // A config.json that claims quantized weights over the dense ones is refused by name.
  json claimed = written;
  claimed["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}};
  std::ofstream(d / "dense/config.json") << claimed.dump();
  try {
    models::load_hf_model(d / "dense", models::LoadOptions{});
    ADD_FAILURE() << "loaded dense tensors under a quantization_config";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("quantization_config (quant_method bitsandbytes) describes quantized "
                                         "weights, and the checkpoint's projections are dense"),
              std::string::npos)
        << e.what();
  }

  // Saved in bitsandbytes' 4-bit form, it carries bitsandbytes' quantization_config, with
  // the quant type the weights have, and loads back as those weights.
  for (QuantType type : {QuantType::kNF4, QuantType::kFP4}) {
    const std::string name = quant_type_name(type);
    auto quantized = models::init_random_model(spec, 1);
    for (models::Linear* l : quantized->linears()) l->quantize(64, true, type);
    models::save_hf_model(*quantized, d / name, models::SaveOptions{});
    const json q = json::parse(read_file(d / name / "config.json"))["quantization_config"];
    EXPECT_EQ(q["quant_method"], "bitsandbytes");
    EXPECT_EQ(q["bnb_4bit_quant_type"], name);
    models::LoadOptions other;  // what the config asks for does not re-quantize stored 4-bit weights
    other.quant_type = type == QuantType::kNF4 ? QuantType::kFP4 : QuantType::kNF4;
    auto back = models::load_hf_model(d / name, other);
    for (size_t i = 0; i < back->linears().size(); ++i) {
      ASSERT_TRUE(back->linears()[i]->quantized());
      EXPECT_EQ(back->linears()[i]->qweight()->quant_type, type) << name;
      EXPECT_TRUE(at::equal(back->linears()[i]->dense_weight(), quantized->linears()[i]->dense_weight())) << name;
    }
  }
}

}  // namespace
}  // namespace memtune::testing
