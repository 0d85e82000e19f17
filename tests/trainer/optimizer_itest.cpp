// memtune's AdamW (with weight decay and gradient clipping) against torch.optim.AdamW and
// clip_grad_norm_ in PyTorch (tests/reference/hf_reference.py train): ten steps of LoRA
// training on the same batch, losses and final adapter compared; and the same with PEFT's
// modules_to_save (whole modules trained beside the adapters, saved in the adapter).
#include <gtest/gtest.h>

#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/io/safetensors.h"
#include "models/peft.h"
#include "test_util.h"
#include "trainer/optimizer.h"

namespace memtune::testing {
namespace {

void py(const std::string& args) {
  auto r = run(python() + " " + (source_dir() / "tests/reference/hf_reference.py").string() + " " + args, 600);
  ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
}

// The batch the reference's make-batch command wrote.
data::Batch load_batch(const std::string& file) {
  models::SafetensorsFile bf(file);
  data::Batch batch;
  batch.input_ids = bf.load("input_ids");
  batch.targets = bf.load("targets");
  batch.position_ids = bf.load("position_ids");
  batch.segment_ids = bf.load("segment_ids");
  return batch;
}

// `steps` AdamW steps (betas 0.9, 0.95, eps 1e-8, decay `wd`) with clipping at `max_norm`
// on `batch`, as the reference's train command runs them; the losses are compared with the
// reference's (`ref_json`) and must fall.
void train_and_compare_losses(models::CausalLM& model, const data::Batch& batch, int steps, double lr, double wd,
                              double max_norm, const fs::path& ref_json) {
  trainer::OptimizerOptions o;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = wd;
  trainer::Optimizer opt(model.trainable_parameters(), o);
  std::vector<double> losses;
  models::ForwardOptions fo;
  fo.training = true;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto out = model.forward(batch, fo);
    at::Tensor loss = out.loss_sum / static_cast<double>(out.target_tokens);
    losses.push_back(loss.item<double>());
    loss.backward();
    const double norm = trainer::grad_norm(opt.params());
    opt.step(lr, norm > max_norm ? max_norm / (norm + 1e-6) : 1.0);
  }
  auto ref = nlohmann::json::parse(read_file(ref_json));
  ASSERT_EQ(ref["losses"].size(), losses.size());
  for (int s = 0; s < steps; ++s) EXPECT_NEAR(losses[s], ref["losses"][s].get<double>(), 1e-5) << "step " << s;
  EXPECT_LT(losses.back(), losses.front());
}

// The reference's side of a training comparison, in `d`: its model (init's arguments `init`),
// adapter (init-lora's `lora`) and batch, seeded from `seed`, and `steps` AdamW steps of them
// (betas 0.9, 0.95, eps 1e-8, fp32) with decay `wd` and clipping at `max_norm`: the losses in
// d/ref.json, the trained tensors in d/ref.safetensors.
struct Reference {
  std::string model, adapter, batch;
  int steps;
  double lr, wd, max_norm;
};
Reference train_reference(const fs::path& d, const std::string& init, const std::string& lora, int seed, int steps,
                          double lr, double wd, double max_norm) {
  const Reference r{(d / "model").string(), (d / "adapter").string(), (d / "batch.safetensors").string(),
                    steps, lr, wd, max_norm};
  py("init " + init + " --seed " + std::to_string(seed) + " --out " + r.model);
  py("init-lora --model " + r.model + " --out " + r.adapter + " " + lora + " --seed " + std::to_string(seed + 1));
  py("make-batch --out " + r.batch + " --vocab 256 --rows 2 --seq 24 --seed " + std::to_string(seed + 2));
  std::ostringstream args;
  args << "train --model " << r.model << " --batch " << r.batch << " --lora " << r.adapter << " --steps " << steps
       << " --lr " << lr << " --weight-decay " << wd << " --betas 0.9,0.95 --eps 1e-8 --max-grad-norm " << max_norm
       << " --dtype float32 --out " << (d / "ref.json").string() << " --out-tensors " << (d / "ref.safetensors").string();
  py(args.str());
  return r;
}

// memtune's side: the reference's model, adapter and batch, trained as the reference trained
// them (train_and_compare_losses; losses compared). Call in ASSERT_NO_FATAL_FAILURE.
struct Trained {
  std::unique_ptr<models::CausalLM> model;
  data::Batch batch;
};
void train_as_the_reference(const Reference& r, const fs::path& d, Trained& out) {
  out.model = models::load_hf_model(r.model, {});
  models::load_adapter(*out.model, r.adapter);
  out.batch = load_batch(r.batch);
  train_and_compare_losses(*out.model, out.batch, r.steps, r.lr, r.wd, r.max_norm, d / "ref.json");
}

// A trained tensor at the reference's value: within 2e-5 of the larger of 1 and its largest element.
void expect_as_trained(const at::Tensor& mine, const at::Tensor& theirs, const std::string& what) {
  EXPECT_LE((mine.detach() - theirs).abs().max().item<double>(), 2e-5 * std::max(1.0, theirs.abs().max().item<double>()))
      << what;
}

// The adapter memtune saves from `model`, read by the reference as PEFT lays the file out,
// gives the reference the loss memtune computes on `batch`.
void expect_saved_adapter_gives_the_same_loss(models::CausalLM& model, const Reference& r,
                                              const data::Batch& batch, const fs::path& d) {
  const fs::path saved = d / "saved";
  models::save_adapter(model, models::read_adapter_config(r.adapter), saved);
  py("forward --model " + r.model + " --batch " + r.batch + " --lora " + saved.string() +
     " --dtype float32 --no-grad --out " + (d / "fwd.safetensors").string());
  const auto out = model.forward(batch, models::ForwardOptions{});
  const double mine = (out.loss_sum / static_cast<double>(out.target_tokens)).item<double>();
  const double theirs = models::SafetensorsFile(d / "fwd.safetensors").load("loss").item<double>();
  EXPECT_NEAR(mine, theirs, 1e-5 * std::abs(theirs));
}

TEST(OptimizerReference, AdamWWithDecayAndClippingMatchesPyTorch) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const int steps = 10;
  const double lr = 3e-3, wd = 0.1, max_norm = 0.5;
  const Reference r = train_reference(d, "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256",
                                      "--r 4 --alpha 8 --targets q_proj,v_proj,gate_proj", 2, steps, lr, wd, max_norm);

  Trained t;
  ASSERT_NO_FATAL_FAILURE(train_as_the_reference(r, d, t));
  models::SafetensorsFile rt(d / "ref.safetensors");
  int compared = 0;
  for (models::Linear* l : t.model->linears()) {
    if (!l->lora) continue;
    for (const char* which : {"lora_A", "lora_B"}) {
      expect_as_trained(std::string(which) == "lora_A" ? l->lora->A : l->lora->B,
                        rt.load(models::peft_key(l->name(), which)), l->name() + " " + which);
      ++compared;
    }
  }
  EXPECT_EQ(compared, 12);
}

// lora.modules_to_save: the embedding, the final norm and the head trained in full beside the
// adapters (fp32 master weights, their own AdamW state, no decay on the norm as Hugging Face's
// Trainer), against the reference's PEFT semantics; the adapter memtune saves is read by the
// reference as PEFT lays it out.
TEST(OptimizerReference, ModulesToSaveTrainAsPeftAndSaveAsPeft) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const int steps = 8;
  const double lr = 3e-3, wd = 0.1, max_norm = 1.0;
  const Reference r =
      train_reference(d, "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256",
                      "--r 4 --alpha 8 --targets q_proj,v_proj --modules-to-save embed_tokens,model.norm,lm_head", 5,
                      steps, lr, wd, max_norm);

  auto model = models::load_hf_model(r.model, {});
  models::LoraSummary summary = models::load_adapter(*model, r.adapter);
  EXPECT_EQ(summary.modules.size(), 4u + 3u);  // q, v in two layers; embedding, norm, head
  const data::Batch batch = load_batch(r.batch);
  ASSERT_NO_FATAL_FAILURE(train_and_compare_losses(*model, batch, steps, lr, wd, max_norm, d / "ref.json"));
  models::SafetensorsFile rt(d / "ref.safetensors");
  for (const char* name : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}) {
    at::Tensor mine = model->find_tensor(name)->tensor->detach();
    at::Tensor theirs = rt.load(std::string("base_model.model.") + name);
    // AdamW divides each element's step by that element's own gradient scale, so where a
    // gradient is the small remainder of a cancelling sum (a head entry of a token the batch
    // hardly predicts), the fp32 rounding of that sum (memtune's chunked loss and PyTorch's
    // matmul sum in other orders) moves the element by a visible fraction of lr: one entry of
    // lm_head's 16384 by 3.4e-5 on an AMD EPYC 9004 (AVX-512), none on others. Every element
    // within one step (lr), nearly all within 2e-5, and the mean far below that.
    const at::Tensor diff = (mine - theirs).abs();
    const double tol = 2e-5 * std::max(1.0, theirs.abs().max().item<double>());
    EXPECT_LE(diff.max().item<double>(), lr) << name;
    EXPECT_LE((diff > tol).sum().item<int64_t>(), std::max<int64_t>(1, diff.numel() / 2000)) << name;
    EXPECT_LE(diff.mean().item<double>(), tol / 100) << name;
  }

  // Saved by memtune, read by the reference as PEFT lays the file out: the same loss.
  expect_saved_adapter_gives_the_same_loss(*model, r, batch, d);
}

// DoRA (use_dora): A, B and the magnitudes trained with AdamW against the reference's DoRA under
// PyTorch's AdamW, weight decay on the magnitudes too (Hugging Face's Trainer decays every
// parameter but biases and norms); the adapter memtune saves gives the reference the same loss.
TEST(OptimizerReference, DoraTrainsAsPeftWithDecayOnTheMagnitudes) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const int steps = 10;
  const Reference r = train_reference(d, "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256",
                                      "--r 4 --alpha 8 --targets q_proj,v_proj,down_proj --dora", 8, steps, 3e-3, 0.5, 0.5);

  Trained t;
  ASSERT_NO_FATAL_FAILURE(train_as_the_reference(r, d, t));
  models::SafetensorsFile rt(d / "ref.safetensors"), start(fs::path(r.adapter) / "adapter_model.safetensors");
  int magnitudes = 0;
  for (models::Linear* l : t.model->linears()) {
    if (!l->lora) continue;
    ASSERT_TRUE(l->lora->dora()) << l->name();
    const std::string key = models::peft_magnitude_key(l->name());
    const at::Tensor mine = l->lora->magnitude.detach();
    expect_as_trained(mine, rt.load(key), key);
    EXPECT_GT((mine - start.load(key)).abs().max().item<double>(), 1e-3) << key << " did not train";
    for (const char* which : {"lora_A", "lora_B"})
      expect_as_trained(which[5] == 'A' ? l->lora->A : l->lora->B, rt.load(models::peft_key(l->name(), which)),
                        l->name() + " " + which);
    ++magnitudes;
  }
  EXPECT_EQ(magnitudes, 6);

  expect_saved_adapter_gives_the_same_loss(*t.model, r, t.batch, d);
  EXPECT_TRUE(nlohmann::json::parse(read_file(d / "saved/adapter_config.json"))["use_dora"].get<bool>());
}

// PEFT's bias: all on GPT-2 (the projections', the LayerNorms' and ln_f's biases beside the
// adapters): 10 AdamW steps against PyTorch's on the reference, the biases without weight
// decay (the Trainer's rule), the adapters with it. The biases train off their start, to the
// reference's values, and the saved adapter holds them under PEFT's keys.
TEST(OptimizerReference, TrainedBiasesFollowPeftWithoutDecay) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const int steps = 10;
  const Reference r = train_reference(d, "--arch gpt2 --layers 2 --hidden 64 --heads 4 --vocab 256 --max-pos 64",
                                      "--r 4 --alpha 8 --targets c_attn,c_fc --bias all", 11, steps, 3e-3, 0.5, 0.5);

  Trained t;
  ASSERT_NO_FATAL_FAILURE(train_as_the_reference(r, d, t));
  models::SafetensorsFile rt(d / "ref.safetensors"), start(fs::path(r.adapter) / "adapter_model.safetensors");
  int biases = 0;
  for (const models::TensorSlot* s :
       models::lora_bias_tensors(*t.model, "all")) {
    const std::string key = models::peft_bias_key(*s);
    at::Tensor theirs = rt.load(key), mine = s->tensor->detach();
    EXPECT_GT((mine - start.load(key)).abs().max().item<double>(), 1e-3) << key << " did not train";
    if (key.find("c_attn") != std::string::npos) {
      // The key's bias (c_attn's middle third) has no gradient: softmax ignores what it adds to
      // every score of a query. Its gradients are float noise, which Adam's normalized steps
      // turn into moves of up to lr each in either implementation; compared to that bound.
      const int64_t C = mine.size(0) / 3;
      EXPECT_LE((mine.narrow(0, C, C) - theirs.narrow(0, C, C)).abs().max().item<double>(), 2 * steps * 3e-3) << key;
      mine = at::cat({mine.narrow(0, 0, C), mine.narrow(0, 2 * C, C)});
      theirs = at::cat({theirs.narrow(0, 0, C), theirs.narrow(0, 2 * C, C)});
    }
    expect_as_trained(mine, theirs, key);
    ++biases;
  }
  EXPECT_EQ(biases, 13);  // 6 per layer and ln_f

  expect_saved_adapter_gives_the_same_loss(*t.model, r, t.batch, d);
  EXPECT_EQ(nlohmann::json::parse(read_file(d / "saved/adapter_config.json"))["bias"], "all");
}

}  // namespace
}  // namespace memtune::testing
