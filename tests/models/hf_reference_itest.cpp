// memtune's Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma 3 / GPT-2 against an independent reference of Hugging Face's
// modeling semantics (tests/reference/hf_reference.py on Debian's python3-torch): logits,
// loss and every parameter gradient on random tiny models with packed, padded batches.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include <ATen/ATen.h>

#include "data/batch.h"
#include "models/hf_model.h"
#include "models/io/safetensors.h"
#include "models/lora.h"
#include "models/peft.h"
#include "runtime/error.h"
#include "test_util.h"

namespace memtune::testing {
namespace {

using models::CausalLM;

std::string ref_script() { return (source_dir() / "tests/reference/hf_reference.py").string(); }

void run_ref(const std::string& args) {
  auto r = run(python() + " " + ref_script() + " " + args, 600);
  ASSERT_EQ(r.exit_code, 0) << args << "\n" << r.output;
}

data::Batch load_batch(const fs::path& file) {
  models::SafetensorsFile f(file);
  data::Batch b;
  b.input_ids = f.load("input_ids");
  b.targets = f.load("targets");
  b.position_ids = f.load("position_ids");
  b.segment_ids = f.load("segment_ids");
  b.target_tokens = (b.targets != -100).sum().item<int64_t>();
  return b;
}

// A training forward of `batch` (every layer checkpointed or none), with the logits when asked.
models::ForwardOutput training_forward(models::CausalLM& model, const data::Batch& batch, bool checkpoint,
                                       bool logits = false) {
  models::ForwardOptions fo;
  fo.training = true;
  fo.return_logits = logits;
  fo.checkpoint_layers.assign(model.num_layers(), checkpoint);
  return model.forward(batch, fo);
}

// max |a - b| / max |b|: relative to the reference's scale.
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  double scale = b.abs().max().item<double>();
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>() / std::max(scale, 1e-30);
}

struct Case {
  std::string name;
  std::string init_args;
  bool checkpoint = false;
};

class HfReference : public ::testing::TestWithParam<Case> {};

TEST_P(HfReference, LogitsLossAndGradientsMatch) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  fs::path dir = temp_dir();
  run_ref("init " + c.init_args + " --out " + (dir / "model").string() + " --seed 3");
  run_ref("make-batch --out " + (dir / "batch.safetensors").string() + " --vocab 256 --rows 3 --seq 24 --seed 5");
  run_ref("forward --model " + (dir / "model").string() + " --batch " + (dir / "batch.safetensors").string() +
      " --out " + (dir / "ref.safetensors").string());

  auto model = models::load_hf_model(dir / "model", {});
  models::make_all_trainable(*model);
  data::Batch batch = load_batch(dir / "batch.safetensors");
  models::ForwardOutput out = training_forward(*model, batch, c.checkpoint, true);
  at::Tensor loss = out.loss_sum / static_cast<double>(out.target_tokens);
  loss.backward();

  models::SafetensorsFile r(dir / "ref.safetensors");
  EXPECT_LT(rel_err(loss, r.load("loss")), 1e-5) << loss.item<double>() << " vs " << r.load("loss").item<double>();
  at::Tensor valid = (batch.segment_ids >= 0).unsqueeze(-1);
  EXPECT_LT(rel_err(out.logits * valid, r.load("logits") * valid), 1e-4);
  int checked = 0;
  for (const auto& slot : model->tensors()) {
    const std::string key = slot.name + ".grad";
    ASSERT_TRUE(r.contains(key)) << key;
    ASSERT_TRUE(slot.tensor->grad().defined()) << slot.name;
    EXPECT_LT(rel_err(slot.tensor->grad(), r.load(key)), 1e-4) << slot.name;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(model->tensors().size()));
}

INSTANTIATE_TEST_SUITE_P(
    Families, HfReference,
    ::testing::Values(
        Case{"llama_gqa_llama3_rope",
             "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 --max-pos 64 "
             "--rope-scaling '{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
             "\"original_max_position_embeddings\":16}'"},
        Case{"llama_checkpointed", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 1 --intermediate 96 --vocab 256",
             true},
        Case{"llama_linear_rope_bias", "--arch llama --layers 1 --hidden 32 --heads 2 --kv-heads 2 --intermediate 64 "
                                       "--vocab 256 --attention-bias --rope-scaling '{\"type\":\"linear\",\"factor\":2.0}'"},
        Case{"llama_yarn_rope", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256 "
                                "--max-pos 64 --rope-scaling '{\"rope_type\":\"yarn\",\"factor\":4.0,"
                                "\"original_max_position_embeddings\":2048}'"},
        Case{"llama_yarn_mscale_untruncated",
             "--arch llama --layers 1 --hidden 64 --heads 4 --kv-heads 4 --intermediate 96 --vocab 256 --max-pos 64 "
             "--rope-theta 100 --rope-parameters --rope-scaling '{\"rope_type\":\"yarn\",\"factor\":8.0,"
             "\"original_max_position_embeddings\":64,\"beta_fast\":1,\"beta_slow\":0.25,\"mscale\":0.707,\"mscale_all_dim\":1.0,\"truncate\":false}'"},
        // dynamic within max_position_embeddings: transformers' NTK base is unchanged there.
        Case{"llama_dynamic_rope", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 "
                                   "--vocab 256 --max-pos 24 --rope-scaling '{\"rope_type\":\"dynamic\",\"factor\":4.0}'"},
        Case{"llama_attention_and_mlp_bias", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                                             "--intermediate 96 --vocab 256 --attention-bias --mlp-bias"},
        Case{"qwen2_tied", "--arch llama --qwen2 --tie --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256"},
        // Qwen3: per-head q and k norms, heads of 32 over a hidden of 64 with 4 of them (q_proj
        // widens to 128), biases on q, k, v and o; and checkpointed, tied.
        Case{"qwen3_wide_heads_bias", "--arch llama --qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 "
                                      "--intermediate 96 --vocab 256 --attention-bias"},
        Case{"qwen3_tied_checkpointed", "--arch llama --qwen3 --tie --layers 2 --hidden 64 --heads 4 --kv-heads 1 "
                                        "--head-dim 16 --intermediate 96 --vocab 256", true},
        Case{"mistral", "--arch llama --mistral --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256"},
        Case{"mistral_sliding_window", "--arch llama --mistral --sliding-window 5 --layers 2 --hidden 64 --heads 4 "
                                       "--kv-heads 2 --intermediate 96 --vocab 256"},
        // Gemma: (1 + weight) norms, scaled embeddings, GeGLU (exact and tanh's), heads of 32 over
        // a hidden of 64; tied with biases, linear rope and a padding index the batch holds.
        Case{"gemma_exact_gelu_wide_heads", "--arch llama --gemma --hidden-act gelu --layers 2 --hidden 64 --heads 4 "
                                            "--kv-heads 2 --head-dim 32 --intermediate 96 --vocab 256"},
        Case{"gemma_tied_bias_pad_linear_rope",
             "--arch llama --gemma --tie --attention-bias --pad-token-id 3 --layers 2 --hidden 64 --heads 4 "
             "--kv-heads 1 --intermediate 96 --vocab 256 --rope-scaling '{\"rope_type\":\"linear\",\"factor\":2.0}'"},
        // Gemma 3: sliding and full layers (a window of 5 in rows of 24), their two rotary bases
        // (linear scaling on the full ones), query_pre_attn_scalar 24 for heads of 32, the four
        // norms a layer and per-head q and k norms; then tied, nested rope_parameters, checkpointed.
        Case{"gemma3_sliding_and_full", "--arch llama --gemma3 --layers 4 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 "
                                        "--intermediate 96 --vocab 256 --layer-types sliding,full,sliding,full "
                                        "--sliding-window 5 --query-pre-attn-scalar 24 "
                                        "--rope-scaling '{\"rope_type\":\"linear\",\"factor\":2.0}'"},
        Case{"gemma3_nested_rope_tied_checkpointed",
             "--arch llama --gemma3 --tie --rope-parameters --rope-local-theta 20000 --layers 3 --hidden 64 --heads 4 "
             "--kv-heads 1 --head-dim 16 --intermediate 96 --vocab 256 --layer-types full,sliding,sliding "
             "--sliding-window 3 --pad-token-id 0",
             true},
        // Gemma 2: Gemma 3's layer without q and k norms, one rotary base, and tanh soft-capping of
        // the attention scores and the logits: caps of 1 and 2 that bend a small model's (taking
        // the attention cap away moves the loss by 1e-2); then tied, checkpointed, with
        // Gemma2Config's 50 and 30, linear rope and a padding index.
        Case{"gemma2_softcapped_sliding", "--arch llama --gemma2 --layers 4 --hidden 64 --heads 4 --kv-heads 2 "
                                          "--head-dim 32 --intermediate 96 --vocab 256 --sliding-window 5 "
                                          "--query-pre-attn-scalar 24 --attn-softcap 1.0 --final-softcap 2.0"},
        Case{"gemma2_default_caps_tied_checkpointed",
             "--arch llama --gemma2 --tie --layers 3 --hidden 64 --heads 4 --kv-heads 1 --head-dim 16 --intermediate 96 "
             "--vocab 256 --layer-types full,sliding,sliding --sliding-window 3 --pad-token-id 0 "
             "--rope-scaling '{\"rope_type\":\"linear\",\"factor\":2.0}'",
             true},
        Case{"gpt2", "--arch gpt2 --layers 2 --hidden 64 --heads 4 --vocab 256 --max-pos 64"},
        Case{"gpt2_checkpointed", "--arch gpt2 --layers 2 --hidden 64 --heads 4 --vocab 256 --max-pos 64", true}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// LoRA: the adapter's gradients against PEFT's semantics, for Linear and Conv1D targets.
class HfReferenceLora : public ::testing::TestWithParam<Case> {};

// The reference's model, adapter (q, v and down, or GPT-2's c_attn and c_fc) and batch in
// `dir`, and its forward of them (`forward_args`: more of its options) in dir/ref.safetensors.
// `lora_args`: more options of init-lora (--dora).
void make_lora_case(const Case& c, const fs::path& dir, const std::string& forward_args,
                    const std::string& lora_args = "") {
  run_ref("init " + c.init_args + " --out " + (dir / "model").string() + " --seed 4");
  const bool gpt2 = c.init_args.find("gpt2") != std::string::npos;
  run_ref("init-lora --model " + (dir / "model").string() + " --out " + (dir / "adapter").string() +
      " --r 4 --alpha 8 --seed 6 --targets " + (gpt2 ? "c_attn,c_fc" : "q_proj,v_proj,down_proj") + " " + lora_args);
  run_ref("make-batch --out " + (dir / "batch.safetensors").string() + " --vocab 256 --rows 2 --seq 20 --seed 7");
  run_ref("forward " + forward_args + " --model " + (dir / "model").string() + " --batch " +
      (dir / "batch.safetensors").string() + " --lora " + (dir / "adapter").string() + " --out " +
      (dir / "ref.safetensors").string());
}

TEST_P(HfReferenceLora, AdapterGradientsMatch) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  fs::path dir = temp_dir();
  make_lora_case(c, dir, "");

  auto model = models::load_hf_model(dir / "model", {});
  models::load_adapter(*model, dir / "adapter");
  data::Batch batch = load_batch(dir / "batch.safetensors");
  models::ForwardOutput out = training_forward(*model, batch, c.checkpoint);
  (out.loss_sum / static_cast<double>(out.target_tokens)).backward();
  models::SafetensorsFile r(dir / "ref.safetensors");
  int checked = 0;
  for (models::Linear* l : model->linears()) {
    if (!l->lora) continue;
    EXPECT_LT(rel_err(l->lora->A.grad(), r.load(models::peft_key(l->name(), "lora_A") + ".grad")), 1e-4) << l->name();
    EXPECT_LT(rel_err(l->lora->B.grad(), r.load(models::peft_key(l->name(), "lora_B") + ".grad")), 1e-4) << l->name();
    checked += 2;
  }
  EXPECT_GE(checked, 4);
  EXPECT_NEAR(out.loss_sum.item<double>() / out.target_tokens, r.load("loss").item<double>(), 1e-5);
}

// PEFT's bias (all, lora_only): the base biases it selects train beside the adapters. The
// reference picks them by PEFT's rule and saves them as PEFT does (an adapted projection's on
// its base_layer), moved off the base's values; memtune trains the same set from the file, with
// the reference's gradients. An adapter's fp32 biases loaded onto a bf16 model (GPT-2's
// LayerNorms' among them) compute in the model's dtype, as PEFT's bf16 parameters would
// (training refuses a 16-bit model with lora.bias: PEFT would train them in 16 bits).
TEST_P(HfReferenceLora, BiasesTrainAsPefts) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  const bool gpt2 = c.init_args.find("gpt2") != std::string::npos;
  if (!gpt2 && c.init_args.find("-bias") == std::string::npos) GTEST_SKIP() << "a model without biases";
  for (const std::string bias : {"all", "lora_only"}) {
    SCOPED_TRACE(bias);
    fs::path dir = temp_dir();
    make_lora_case(c, dir, "", "--bias " + bias);
    auto model = models::load_hf_model(dir / "model", {});
    models::load_adapter(*model, dir / "adapter");
    std::set<std::string> theirs, mine;
    const models::SafetensorsFile file(dir / "adapter/adapter_model.safetensors");
    for (const std::string& k : file.names())
      if (k.size() > 5 && k.compare(k.size() - 5, 5, ".bias") == 0) theirs.insert(k);
    std::map<std::string, at::Tensor> trained;
    for (const models::TensorSlot* s :
         models::lora_bias_tensors(*model, bias)) {
      const std::string key = models::peft_bias_key(*s);
      mine.insert(key);
      trained[key] = *s->tensor;
      EXPECT_TRUE(s->tensor->requires_grad()) << s->name;
    }
    EXPECT_EQ(mine, theirs);
    EXPECT_GE(theirs.size(), bias == "all" ? 8u : 2u);
    data::Batch batch = load_batch(dir / "batch.safetensors");
    models::ForwardOutput out = training_forward(*model, batch, c.checkpoint);
    (out.loss_sum / static_cast<double>(out.target_tokens)).backward();
    models::SafetensorsFile r(dir / "ref.safetensors");
    EXPECT_NEAR(out.loss_sum.item<double>() / out.target_tokens, r.load("loss").item<double>(), 1e-5);
    for (const auto& [key, t] : trained) {
      ASSERT_TRUE(t.grad().defined()) << key;
      EXPECT_LT(rel_err(t.grad(), r.load(key + ".grad")), 1e-4) << key;
    }
    for (models::Linear* l : model->linears()) {
      if (!l->lora) continue;
      EXPECT_LT(rel_err(l->lora->A.grad(), r.load(models::peft_key(l->name(), "lora_A") + ".grad")), 1e-4) << l->name();
    }
    if (bias == "all") {  // a bf16 model: the loss and the biases' gradients, to bf16's precision
      run_ref("forward --dtype bfloat16 --model " + (dir / "model").string() + " --batch " +
              (dir / "batch.safetensors").string() + " --lora " + (dir / "adapter").string() + " --out " +
              (dir / "ref_bf16.safetensors").string());
      models::LoadOptions o;
      o.dense_dtype = at::kBFloat16;
      auto bf = models::load_hf_model(dir / "model", o);
      models::load_adapter(*bf, dir / "adapter");
      bf->set_compute_dtype(at::kBFloat16, false);
      models::ForwardOutput y = training_forward(*bf, batch, c.checkpoint);
      (y.loss_sum / static_cast<double>(y.target_tokens)).backward();
      models::SafetensorsFile rb(dir / "ref_bf16.safetensors");
      const double ref = rb.load("loss").item<double>();
      EXPECT_LT(std::abs(y.loss_sum.item<double>() / y.target_tokens - ref) / ref, 1e-3);
      for (const models::TensorSlot* s :
           models::lora_bias_tensors(*bf, bias)) {
        EXPECT_EQ(s->tensor->scalar_type(), at::kFloat) << s->name;
        const std::string key = models::peft_bias_key(*s);
        EXPECT_LT(rel_err(s->tensor->grad(), rb.load(key + ".grad")), 5e-2) << key;
      }
    }
  }
}

struct Bf16Errors {
  double loss = 0, grad = 0;  // |loss - ref| / ref; the largest |g - ref| / |ref| (2-norms) over the adapters' tensors
  double logits_equal = 0;    // the share of the logits (of tokens in a document) equal to the reference's, bit for bit
};

// memtune's loss and adapter gradients on the case in `dir` against the reference's there,
// its dense tensors in `dense`, its products in bf16, under autocast or not.
Bf16Errors bf16_errors(const Case& c, const fs::path& dir, at::ScalarType dense, bool autocast) {
  models::SafetensorsFile r(dir / "ref.safetensors");
  data::Batch batch = load_batch(dir / "batch.safetensors");
  models::LoadOptions o;
  o.dense_dtype = dense;
  auto model = models::load_hf_model(dir / "model", o);
  models::load_adapter(*model, dir / "adapter");
  model->set_compute_dtype(at::kBFloat16, autocast);
  models::ForwardOutput out = training_forward(*model, batch, c.checkpoint, /*logits=*/true);
  (out.loss_sum / static_cast<double>(out.target_tokens)).backward();
  Bf16Errors e;
  const at::Tensor valid = (batch.segment_ids >= 0).unsqueeze(-1).expand_as(out.logits);
  e.logits_equal = (out.logits.to(at::kFloat) == r.load("logits")).logical_and(valid).sum().item<double>() /
                   valid.sum().item<double>();
  const double ref_loss = r.load("loss").item<double>();
  e.loss = std::abs(out.loss_sum.item<double>() / out.target_tokens - ref_loss) / ref_loss;
  int checked = 0;
  for (models::Linear* l : model->linears()) {
    if (!l->lora) continue;
    EXPECT_EQ(l->lora->A.grad().scalar_type(), at::kFloat);
    auto compare = [&](const at::Tensor& g, const std::string& key) {
      const at::Tensor ref = r.load(key + ".grad").to(at::kDouble);
      e.grad = std::max(e.grad, ((g.to(at::kDouble) - ref).norm() / ref.norm()).item<double>());
    };
    compare(l->lora->A.grad(), models::peft_key(l->name(), "lora_A"));
    compare(l->lora->B.grad(), models::peft_key(l->name(), "lora_B"));
    if (l->lora->dora()) compare(l->lora->magnitude.grad(), models::peft_magnitude_key(l->name()));
    checked += 2;
  }
  EXPECT_GE(checked, 4);
  return e;
}

// A bf16 model (model.torch_dtype: bfloat16 with bnb_4bit_compute_dtype: bfloat16, no
// autocast) against transformers' model loaded in bf16 with PEFT's fp32 adapters: every dense
// tensor and activation in bf16, the adapters taking their input in fp32 and multiplying in
// fp32. The same model kept in fp32 (bf16 products) lands a hundred times further from the
// reference's loss: the tolerance tells the two apart.
TEST_P(HfReferenceLora, AdapterGradientsMatchInABf16Model) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  fs::path dir = temp_dir();
  make_lora_case(c, dir, "--dtype bfloat16");
  const Bf16Errors bf16 = bf16_errors(c, dir, at::kBFloat16, false), fp32 = bf16_errors(c, dir, at::kFloat, false);
  std::cout << "bf16 model: loss " << bf16.loss << ", gradients " << bf16.grad << ", logits equal " << bf16.logits_equal
            << "; fp32 model: loss " << fp32.loss << ", gradients " << fp32.grad << ", logits equal " << fp32.logits_equal
            << "\n";
  // The forward is the reference's to the last bits but where an fp32 adapter's output sits on
  // a bf16 rounding boundary: memtune's narrow kernel (x A^T, cpu_gemm.h) sums in its own order,
  // and one element rounded the other way moves later logits by an ulp (with the portable
  // kernels every logit of these cases is equal, measured 2026-11-29; the fp32 model's share is
  // under a quarter). Backward's roundings sit elsewhere in places (attention's backward forms
  // its row sums from the bf16 output, as SDPA's kernels do, where the reference's eager ops
  // keep the fp32 softmax), about 1 % of the gradients' norm.
  EXPECT_GT(bf16.logits_equal, 0.9);
  EXPECT_LT(fp32.logits_equal, 0.5) << "the test does not tell a bf16 model from an fp32 one";
  EXPECT_LT(bf16.loss, 1e-4);
  EXPECT_GT(fp32.loss, 1e-5);
  EXPECT_LT(bf16.grad, 2e-2);
}

// The same model under the Trainer's bf16 autocast (training.bf16) against PEFT's adapters
// run under torch.autocast: their products in bf16 from bf16 copies of x, A and B, the
// adapter's output summed with the base's in bf16 (the loss to the last bits or nearly). A's
// and B's gradients: PyTorch rounds them to bf16, memtune sums the same bf16 products in fp32
// (within the tolerance; LoraLinear's autocast test checks what that buys).
TEST_P(HfReferenceLora, AdapterGradientsMatchUnderBf16Autocast) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  fs::path dir = temp_dir();
  make_lora_case(c, dir, "--dtype bfloat16 --autocast");
  const Bf16Errors on = bf16_errors(c, dir, at::kBFloat16, true), off = bf16_errors(c, dir, at::kBFloat16, false);
  std::cout << "autocast: loss " << on.loss << ", gradients " << on.grad << ", logits equal " << on.logits_equal
            << "; without: loss " << off.loss << ", gradients " << off.grad << ", logits equal " << off.logits_equal << "\n";
  EXPECT_EQ(on.logits_equal, 1.0);  // bf16 adapters: no fp32 sum to round (above)
  EXPECT_LT(off.logits_equal, 0.5);
  EXPECT_LT(on.loss, 1e-6);
  EXPECT_GT(off.loss, 1e-5) << "the test does not tell autocast's adapters from fp32 ones";
  EXPECT_LT(on.grad, 2e-2);
}

// DoRA (use_dora): the loss, logits and the gradients of A, B and the magnitude against the
// reference's DoRA (the adapted weight rescaled row by row to the magnitude, its norms constant;
// its selftest checks it against the merged weights). The adapter's magnitudes sit 20 % off the
// norms, so that the rescaling is not the identity.
TEST_P(HfReferenceLora, DoraMatches) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  fs::path dir = temp_dir();
  make_lora_case(c, dir, "", "--dora");
  auto model = models::load_hf_model(dir / "model", {});
  models::load_adapter(*model, dir / "adapter");
  data::Batch batch = load_batch(dir / "batch.safetensors");
  models::ForwardOutput out = training_forward(*model, batch, c.checkpoint, true);
  (out.loss_sum / static_cast<double>(out.target_tokens)).backward();
  models::SafetensorsFile r(dir / "ref.safetensors");
  const at::Tensor valid = batch.segment_ids.ge(0);
  EXPECT_LT(rel_err(out.logits.index({valid}), r.load("logits").index({valid})), 1e-5);
  EXPECT_NEAR(out.loss_sum.item<double>() / out.target_tokens, r.load("loss").item<double>(), 1e-5);
  int magnitudes = 0;
  for (models::Linear* l : model->linears()) {
    if (!l->lora) continue;
    ASSERT_TRUE(l->lora->dora()) << l->name();
    EXPECT_LT(rel_err(l->lora->A.grad(), r.load(models::peft_key(l->name(), "lora_A") + ".grad")), 1e-4) << l->name();
    EXPECT_LT(rel_err(l->lora->B.grad(), r.load(models::peft_key(l->name(), "lora_B") + ".grad")), 1e-4) << l->name();
    EXPECT_LT(rel_err(l->lora->magnitude.grad(), r.load(models::peft_magnitude_key(l->name()) + ".grad")), 1e-4)
        << l->name();
    ++magnitudes;
  }
  EXPECT_GE(magnitudes, 2);
}

// PEFT's rank_pattern and alpha_pattern: each module's rank and lora_alpha from the first
// pattern (in the file's order, which PEFT writes sorted) matching its name as (.*\.)?(pattern)$.
// Layer 1's v_proj (c_fc) is named in full, sorting before the bare v_proj (c_fc), which
// matches it too (so the order decides); down_proj gets its own rank,
// q_proj (GPT-2: c_attn) its own alpha; plain LoRA and DoRA, whose norms take each module's
// scaling. Loss and gradients against the reference's reading of the same file.
TEST_P(HfReferenceLora, RankAndAlphaPatternsMatch) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  const bool gpt2 = c.init_args.find("gpt2") != std::string::npos;
  const std::string rank_json = gpt2 ? R"({".*h\\.1\\.mlp\\.c_fc": 3, "c_fc": 6})"
                                    : R"({"model\\.layers\\.1\\.self_attn\\.v_proj": 3, "v_proj": 2, "down_proj": 6})";
  const std::string alpha_json = gpt2 ? R"({"c_attn": 2.5})" : R"({"q_proj": 3})";
  const std::string patterns = " --rank-pattern '" + rank_json + "' --alpha-pattern '" + alpha_json + "'";
  for (const std::string dora : {"", " --dora"}) {
    fs::path dir = temp_dir();
    make_lora_case(c, dir, "", patterns + dora);
    auto model = models::load_hf_model(dir / "model", {});
    models::load_adapter(*model, dir / "adapter");
    std::set<int64_t> ranks;
    for (models::Linear* l : model->linears())
      if (l->lora) ranks.insert(l->lora->A.size(0));
    EXPECT_EQ(ranks, (gpt2 ? std::set<int64_t>{3, 4, 6} : std::set<int64_t>{2, 3, 4, 6})) << dora;
    // The training config's patterns (apply_lora), in the order the reference read them
    // (sorted, as PEFT writes them), give each module the reference's rank and scaling.
    {
      const models::AdapterConfig file = models::read_adapter_config(dir / "adapter");
      models::LoraPatterns p;
      const nlohmann::json rank = nlohmann::json::parse(rank_json), alpha = nlohmann::json::parse(alpha_json);
      for (const auto& [k, v] : rank.items()) p.rank.emplace_back(k, v.get<int64_t>());
      for (const auto& [k, v] : alpha.items()) p.alpha.emplace_back(k, v.get<double>());
      auto trained = models::load_hf_model(dir / "model", {});
      models::check_lora_patterns(*trained, file.targets, p, "lora");
      models::apply_lora(*trained, file.lora, file.targets, p);
      for (models::Linear* l : model->linears()) {
        models::Linear* t = trained->find_linear(l->name());
        ASSERT_EQ(static_cast<bool>(l->lora), static_cast<bool>(t->lora)) << l->name();
        if (!l->lora) continue;
        EXPECT_EQ(t->lora->A.size(0), l->lora->A.size(0)) << l->name();
        EXPECT_DOUBLE_EQ(t->lora->scaling, l->lora->scaling) << l->name();
      }
    }
    data::Batch batch = load_batch(dir / "batch.safetensors");
    models::ForwardOutput out = training_forward(*model, batch, c.checkpoint);
    (out.loss_sum / static_cast<double>(out.target_tokens)).backward();
    models::SafetensorsFile r(dir / "ref.safetensors");
    EXPECT_NEAR(out.loss_sum.item<double>() / out.target_tokens, r.load("loss").item<double>(), 1e-5) << dora;
    for (models::Linear* l : model->linears()) {
      if (!l->lora) continue;
      EXPECT_LT(rel_err(l->lora->A.grad(), r.load(models::peft_key(l->name(), "lora_A") + ".grad")), 1e-4) << l->name();
      EXPECT_LT(rel_err(l->lora->B.grad(), r.load(models::peft_key(l->name(), "lora_B") + ".grad")), 1e-4) << l->name();
    }
  }
}

// DoRA on a bf16 model (fp32 adapters and magnitudes) and under bf16 autocast, against the
// reference run the same way.
TEST_P(HfReferenceLora, DoraMatchesInBf16) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  const Case& c = GetParam();
  for (bool autocast : {false, true}) {
    fs::path dir = temp_dir();
    make_lora_case(c, dir, autocast ? "--dtype bfloat16 --autocast" : "--dtype bfloat16", "--dora");
    const Bf16Errors e = bf16_errors(c, dir, at::kBFloat16, autocast);
    std::cout << (autocast ? "autocast" : "bf16 model") << ": loss " << e.loss << ", gradients " << e.grad << "\n";
    EXPECT_LT(e.loss, 1e-6) << (autocast ? "autocast" : "bf16 model");
    EXPECT_LT(e.grad, 3e-2) << (autocast ? "autocast" : "bf16 model");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Families, HfReferenceLora,
    ::testing::Values(Case{"llama", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256"},
                      Case{"llama_checkpointed",
                           "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 96 --vocab 256", true},
                      // Heads of 32 (4 over a hidden of 64): an attention scale bf16 rounds.
                      Case{"llama_biases_wide_heads", "--arch llama --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 "
                                                      "--intermediate 96 --vocab 256 --attention-bias --mlp-bias"},
                      // head_dim 32: a scale of 32^-0.5, which bf16 rounds (16's is a power of two).
                      Case{"qwen3", "--arch llama --qwen3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 "
                                    "--intermediate 96 --vocab 256"},
                      Case{"gemma3", "--arch llama --gemma3 --layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 32 "
                                     "--intermediate 96 --vocab 256 --layer-types sliding,full --sliding-window 6 "
                                     "--query-pre-attn-scalar 24"},
                      Case{"gemma2_softcapped", "--arch llama --gemma2 --layers 2 --hidden 64 --heads 4 --kv-heads 2 "
                                                "--head-dim 32 --intermediate 96 --vocab 256 --sliding-window 6 "
                                                "--query-pre-attn-scalar 24 --attn-softcap 1.0 --final-softcap 2.0"},
                      Case{"gpt2_conv1d", "--arch gpt2 --layers 2 --hidden 64 --heads 4 --vocab 256 --max-pos 64"}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// memtune's loss and the reference's (no gradients) for the model in dir/model, on a batch of
// two rows it writes to dir/batch.safetensors.
std::pair<double, double> losses_on_a_batch(const fs::path& dir, int64_t vocab) {
  run_ref("make-batch --out " + (dir / "batch.safetensors").string() + " --vocab " + std::to_string(vocab) +
          " --rows 2 --seq 16 --seed 5");
  run_ref("forward --model " + (dir / "model").string() + " --batch " + (dir / "batch.safetensors").string() +
      " --out " + (dir / "ref.safetensors").string() + " --no-grad");
  models::ForwardOutput out = models::load_hf_model(dir / "model", {})->forward(load_batch(dir / "batch.safetensors"), {});
  return {out.loss_sum.item<double>() / out.target_tokens,
          models::SafetensorsFile(dir / "ref.safetensors").load("loss").item<double>()};
}

// `memtune init-model` of a Llama config with attention_bias and mlp_bias writes every bias
// tensor transformers expects (zero, as transformers initialises them): the reference, which
// refuses missing or unexpected tensors, loads the model and computes memtune's loss.
TEST(HfReferenceInitModel, LlamaBiasesAreWrittenAndRead) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path dir = temp_dir();
  write_file(dir / "config.json",
             nlohmann::json{{"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", 256},
                            {"hidden_size", 64}, {"intermediate_size", 96}, {"num_hidden_layers", 2},
                            {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"attention_bias", true},
                            {"mlp_bias", true}}
                 .dump());
  auto r = run(memtune_bin() + " init-model --config " + (dir / "config.json").string() + " --out " +
               (dir / "model").string() + " --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  models::SafetensorsFile written(dir / "model/model.safetensors");
  for (const char* name : {"model.layers.1.mlp.gate_proj.bias", "model.layers.1.mlp.up_proj.bias",
                           "model.layers.1.mlp.down_proj.bias", "model.layers.1.self_attn.o_proj.bias"})
    EXPECT_TRUE(written.contains(name)) << name;
  const auto [loss, ref] = losses_on_a_batch(dir, 256);
  EXPECT_NEAR(loss, ref, 1e-5);
}

// `memtune init-model --preset tiny-qwen3` writes the q and k norms under transformers' names
// and a config the reference reads as Qwen3 (heads of 64 over a hidden of 128): it computes
// memtune's loss. Its norms are given other weights than ones first, so a norm read from the
// wrong tensor, or skipped, shows.
TEST(HfReferenceInitModel, Qwen3PresetIsWrittenAndRead) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path dir = temp_dir();
  auto r = run(memtune_bin() + " init-model --preset tiny-qwen3 --out " + (dir / "init").string() + " --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json config = nlohmann::json::parse(read_file(dir / "init/config.json"));
  EXPECT_EQ(config["model_type"], "qwen3");
  EXPECT_EQ(config["head_dim"], 64);
  models::SafetensorsFile written(dir / "init/model.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int norms = 0;
  for (const std::string& name : written.names()) {
    at::Tensor t = written.load(name);
    if (name.find("_norm.weight") != std::string::npos && name.find("self_attn.") != std::string::npos) {
      EXPECT_EQ(t.sizes(), at::IntArrayRef({64})) << name;
      t = at::linspace(0.5, 1.5, 64) + 0.1 * (norms++);
    }
    tensors.emplace_back(name, t);
  }
  EXPECT_EQ(norms, 2 * 4) << "a q_norm and a k_norm in each of the 4 layers";
  fs::create_directories(dir / "model");
  fs::copy_file(dir / "init/config.json", dir / "model/config.json");
  models::save_safetensors(dir / "model/model.safetensors", tensors);
  const auto [loss, ref] = losses_on_a_batch(dir, 1024);
  EXPECT_NEAR(loss, ref, 1e-5);
  models::ForwardOutput plain =
      models::load_hf_model(dir / "init", {})->forward(load_batch(dir / "batch.safetensors"), {});
  EXPECT_GT(std::abs(plain.loss_sum.item<double>() / plain.target_tokens - loss), 1e-4)
      << "the norms' weights do not change the loss";
}

// dynamic past max_position_embeddings: transformers' frequencies then depend on the forwards
// before (its cached base is never reset), so memtune refuses the batch by name.
TEST(HfReferenceDynamicRope, PositionsPastMaxPositionEmbeddingsAreRefused) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  fs::path dir = temp_dir();
  run_ref("init --arch llama --layers 1 --hidden 32 --heads 2 --kv-heads 2 --intermediate 48 --vocab 256 --max-pos 8 "
          "--rope-scaling '{\"rope_type\":\"dynamic\",\"factor\":2.0}' --out " + (dir / "model").string() + " --seed 3");
  run_ref("make-batch --out " + (dir / "batch.safetensors").string() +
          " --vocab 256 --rows 1 --seq 16 --max-docs 1 --no-pad --ignore-frac 0 --seed 5");
  auto model = models::load_hf_model(dir / "model", {});
  try {
    model->forward(load_batch(dir / "batch.safetensors"), {});
    ADD_FAILURE() << "a 16-position row ran on a dynamic-rope model with max_position_embeddings 8";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("rope_scaling dynamic: a sequence reaches 16 positions, past "
                                         "max_position_embeddings 8"), std::string::npos) << e.what();
  }
}

TEST(HfReferenceSelftest, ReferencePassesItsOwnChecks) {
  if (!python_torch_available()) GTEST_SKIP() << "python3-torch not installed";
  auto r = run(python() + " " + ref_script() + " selftest", 600);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace memtune::testing
