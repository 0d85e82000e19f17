// memtune's AdamW (with weight decay and gradient clipping) against torch.optim.AdamW and
// clip_grad_norm_ in PyTorch (tests/reference/hf_reference.py train): ten steps of LoRA
// training on the same batch, losses and final adapter compared; and the same with PEFT's
// modules_to_save (whole modules trained beside the adapters, saved in the adapter).
#include <gtest/gtest.h>

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

TEST(OptimizerReference, AdamWWithDecayAndClippingMatchesPyTorch) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const std::string m = (d / "model").string(), a = (d / "adapter").string(), b = (d / "batch.safetensors").string();
  py("init --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 --seed 2 --out " + m);
  py("init-lora --model " + m + " --out " + a + " --r 4 --alpha 8 --seed 3 --targets q_proj,v_proj,gate_proj");
  py("make-batch --out " + b + " --vocab 256 --rows 2 --seq 24 --seed 4");
  const int steps = 10;
  const double lr = 3e-3, wd = 0.1, max_norm = 0.5;
  py("train --model " + m + " --batch " + b + " --lora " + a + " --steps " + std::to_string(steps) +
     " --lr 3e-3 --weight-decay 0.1 --betas 0.9,0.95 --eps 1e-8 --max-grad-norm 0.5 --dtype float32 --out " +
     (d / "ref.json").string() + " --out-tensors " + (d / "ref.safetensors").string());

  auto model = models::load_hf_model(m, {});
  models::load_adapter(*model, a);
  const data::Batch batch = load_batch(b);
  ASSERT_NO_FATAL_FAILURE(train_and_compare_losses(*model, batch, steps, lr, wd, max_norm, d / "ref.json"));
  models::SafetensorsFile rt(d / "ref.safetensors");
  int compared = 0;
  for (models::Linear* l : model->linears()) {
    if (!l->lora) continue;
    for (const char* which : {"lora_A", "lora_B"}) {
      at::Tensor mine = std::string(which) == "lora_A" ? l->lora->A : l->lora->B;
      at::Tensor theirs = rt.load(models::peft_key(l->name(), which));
      EXPECT_LE((mine.detach() - theirs).abs().max().item<double>(), 2e-5 * std::max(1.0, theirs.abs().max().item<double>()))
          << l->name() << " " << which;
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
  const std::string m = (d / "model").string(), a = (d / "adapter").string(), b = (d / "batch.safetensors").string();
  py("init --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 --seed 5 --out " + m);
  py("init-lora --model " + m + " --out " + a +
     " --r 4 --alpha 8 --seed 6 --targets q_proj,v_proj --modules-to-save embed_tokens,model.norm,lm_head");
  py("make-batch --out " + b + " --vocab 256 --rows 2 --seq 24 --seed 7");
  const int steps = 8;
  const double lr = 3e-3, wd = 0.1, max_norm = 1.0;
  py("train --model " + m + " --batch " + b + " --lora " + a + " --steps " + std::to_string(steps) +
     " --lr 3e-3 --weight-decay 0.1 --betas 0.9,0.95 --eps 1e-8 --max-grad-norm 1.0 --dtype float32 --out " +
     (d / "ref.json").string() + " --out-tensors " + (d / "ref.safetensors").string());

  auto model = models::load_hf_model(m, {});
  models::LoraSummary summary = models::load_adapter(*model, a);
  EXPECT_EQ(summary.modules.size(), 4u + 3u);  // q, v in two layers; embedding, norm, head
  const data::Batch batch = load_batch(b);
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
  models::AdapterConfig config = models::read_adapter_config(a);
  const fs::path saved = d / "saved";
  models::save_adapter(*model, config, saved);
  py("forward --model " + m + " --batch " + b + " --lora " + saved.string() + " --dtype float32 --no-grad --out " +
     (d / "fwd.safetensors").string());
  models::ForwardOptions eval;
  const auto out = model->forward(batch, eval);
  const double mine = (out.loss_sum / static_cast<double>(out.target_tokens)).item<double>();
  const double theirs = models::SafetensorsFile(d / "fwd.safetensors").load("loss").item<double>();
  EXPECT_NEAR(mine, theirs, 1e-5 * std::abs(theirs));
}

// DoRA (use_dora): A, B and the magnitudes trained with AdamW against the reference's DoRA under
// PyTorch's AdamW, weight decay on the magnitudes too (Hugging Face's Trainer decays every
// parameter but biases and norms); the adapter memtune saves gives the reference the same loss.
TEST(OptimizerReference, DoraTrainsAsPeftWithDecayOnTheMagnitudes) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path d = temp_dir();
  const std::string m = (d / "model").string(), a = (d / "adapter").string(), b = (d / "batch.safetensors").string();
  py("init --arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 --seed 8 --out " + m);
  py("init-lora --model " + m + " --out " + a + " --r 4 --alpha 8 --seed 9 --targets q_proj,v_proj,down_proj --dora");
  py("make-batch --out " + b + " --vocab 256 --rows 2 --seq 24 --seed 10");
  const int steps = 10;
  py("train --model " + m + " --batch " + b + " --lora " + a + " --steps " + std::to_string(steps) +
     " --lr 3e-3 --weight-decay 0.5 --betas 0.9,0.95 --eps 1e-8 --max-grad-norm 0.5 --dtype float32 --out " +
     (d / "ref.json").string() + " --out-tensors " + (d / "ref.safetensors").string());

  auto model = models::load_hf_model(m, {});
  models::load_adapter(*model, a);
  const data::Batch batch = load_batch(b);
  ASSERT_NO_FATAL_FAILURE(train_and_compare_losses(*model, batch, steps, 3e-3, 0.5, 0.5, d / "ref.json"));
  models::SafetensorsFile rt(d / "ref.safetensors"), start(fs::path(a) / "adapter_model.safetensors");
  int magnitudes = 0;
  for (models::Linear* l : model->linears()) {
    if (!l->lora) continue;
    ASSERT_TRUE(l->lora->dora()) << l->name();
    const std::string key = models::peft_magnitude_key(l->name());
    const at::Tensor theirs = rt.load(key), mine = l->lora->magnitude.detach();
    EXPECT_LE((mine - theirs).abs().max().item<double>(), 2e-5 * std::max(1.0, theirs.abs().max().item<double>()))
        << key;
    EXPECT_GT((mine - start.load(key)).abs().max().item<double>(), 1e-3) << key << " did not train";
    for (const char* which : {"lora_A", "lora_B"}) {
      const at::Tensor t = rt.load(models::peft_key(l->name(), which));
      EXPECT_LE(((which[5] == 'A' ? l->lora->A : l->lora->B).detach() - t).abs().max().item<double>(),
                2e-5 * std::max(1.0, t.abs().max().item<double>()))
          << l->name() << " " << which;
    }
    ++magnitudes;
  }
  EXPECT_EQ(magnitudes, 6);

  const fs::path saved = d / "saved";
  models::save_adapter(*model, models::read_adapter_config(a), saved);
  EXPECT_TRUE(nlohmann::json::parse(read_file(saved / "adapter_config.json"))["use_dora"].get<bool>());
  py("forward --model " + m + " --batch " + b + " --lora " + saved.string() + " --dtype float32 --no-grad --out " +
     (d / "fwd.safetensors").string());
  const auto out = model->forward(batch, models::ForwardOptions{});
  const double mine = (out.loss_sum / static_cast<double>(out.target_tokens)).item<double>();
  const double theirs = models::SafetensorsFile(d / "fwd.safetensors").load("loss").item<double>();
  EXPECT_NEAR(mine, theirs, 1e-5 * std::abs(theirs));
}

}  // namespace
}  // namespace memtune::testing
