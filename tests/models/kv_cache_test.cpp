// Generation's key/value cache: the attention of new positions over cached ones against the
// textbook attention over the whole sequence; each architecture's logits, token by token
// through the cache, against one forward over the whole sequence (the model's own forward,
// which hf_reference_itest checks against transformers); generate with and without the cache;
// and an architecture whose layers attend without the cache, which generate runs uncached.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <cmath>
#include <limits>
#include <vector>

#include "data/batch.h"
#include "models/causal_lm.h"
#include "models/generate.h"
#include "models/hf_model.h"
#include "models/layers/kv_cache.h"
#include "models/lora.h"
#include "models/model_spec.h"
#include "runtime/error.h"
#include "test_util.h"

namespace {

using namespace memtune;
using memtune::testing::expect_close;

// Every query of the L positions against every key, masked causally (and by the window), in
// float64 (scores soft-capped, c tanh(s / c), with `softcap` c > 0); the last T query rows.
// q (B,Hkv,G,L,D), k/v (B,Hkv,L,D).
at::Tensor textbook_last_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                              int64_t window, int64_t T, double softcap = 0) {
  const int64_t L = q.size(3);
  at::Tensor s = at::matmul(q.to(at::kDouble), k.to(at::kDouble).unsqueeze(2).transpose(-1, -2)) * scale;
  if (softcap > 0) s = at::tanh(s / softcap) * softcap;
  at::Tensor pos = at::arange(L, at::kLong);
  at::Tensor qp = pos.view({L, 1}), kp = pos.view({1, L});
  at::Tensor allowed = kp <= qp;
  if (window > 0) allowed = allowed & (qp - kp < window);
  s = s.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  at::Tensor out = at::matmul(at::softmax(s, -1), v.to(at::kDouble).unsqueeze(2));
  return out.narrow(3, L - T, T);
}

TEST(KVCache, AttentionAfterAPrefixIsTheLastRowsOfTheWholeSequences) {
  at::manual_seed(11);
  const int64_t B = 2, Hkv = 2, G = 3, L = 37, D = 16;
  at::Tensor q = at::randn({B, Hkv, G, L, D}), k = at::randn({B, Hkv, L, D}), v = at::randn({B, Hkv, L, D});
  for (int64_t window : {0, 1, 5, 36, 37, 100})
    for (int64_t T : {int64_t{1}, int64_t{2}, int64_t{9}, L}) {
      const std::string what = "window " + std::to_string(window) + ", " + std::to_string(T) + " new positions";
      at::Tensor out = models::attention_after_prefix(q.narrow(3, L - T, T), k, v, 0.3, window);
      expect_close(out, textbook_last_rows(q, k, v, 0.3, window, T).to(at::kFloat), 2e-6, what, 1.0);
      // Gemma 2's soft-capped scores (a cap of 0.8 bends scores of about 1).
      out = models::attention_after_prefix(q.narrow(3, L - T, T), k, v, 0.3, window, 0.8);
      expect_close(out, textbook_last_rows(q, k, v, 0.3, window, T, 0.8).to(at::kFloat), 2e-6, what + ", capped", 1.0);
    }
  // bf16: the scores rounded to bf16 before the fp32 softmax, as the blocked kernel does.
  at::Tensor out = models::attention_after_prefix(q.narrow(3, L - 4, 4).to(at::kBFloat16), k.to(at::kBFloat16),
                                                  v.to(at::kBFloat16), 0.25, 0);
  ASSERT_EQ(out.scalar_type(), at::kBFloat16);
  expect_close(out.to(at::kFloat), textbook_last_rows(q, k, v, 0.25, 0, 4).to(at::kFloat), 3e-2, "bf16", 1.0);
}

// A new token's attention in bf16 on a small model, against float64 sums rounded where a bf16
// attention rounds: the scores, the scaled scores, the probabilities and the output. The
// products are rounded once (not summed in bf16 along the way): within one bf16 step of the
// output's largest value, where LibTorch 1.13's own small bf16 product is up to 5 steps off.
TEST(KVCache, Bf16NewTokensProductsAreRoundedOnce) {
  at::manual_seed(13);
  const int64_t B = 1, Hkv = 2, G = 2, L = 20, D = 16;
  at::Tensor q = at::randn({B, Hkv, G, 1, D}).to(at::kBFloat16), k = at::randn({B, Hkv, L, D}).to(at::kBFloat16),
             v = at::randn({B, Hkv, L, D}).to(at::kBFloat16);
  auto bf16 = [](const at::Tensor& t) { return t.to(at::kBFloat16).to(at::kDouble); };
  at::Tensor s = bf16(at::matmul(q.to(at::kDouble), k.to(at::kDouble).unsqueeze(2).transpose(-1, -2)));
  at::Tensor p = bf16(at::softmax(bf16(s * 0.3).to(at::kFloat), -1));
  at::Tensor expected = bf16(at::matmul(p, v.to(at::kDouble).unsqueeze(2)));
  at::Tensor out = models::attention_after_prefix(q, k, v, 0.3, 0).to(at::kDouble);
  const double step = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(expected.abs().max().item<double>()))) - 7);
  EXPECT_LE((out - expected).abs().max().item<double>(), step);
}

TEST(KVCache, GrowsPastItsCapacityAndHoldsWhatWasAppended) {
  at::NoGradGuard no_grad;
  at::manual_seed(12);
  const int64_t Hkv = 2, G = 2, D = 8;
  models::KVCache cache(2, 3);
  at::Tensor k = at::randn({1, Hkv, 13, D}), v = at::randn({1, Hkv, 13, D}), q = at::randn({1, Hkv, G, 13, D});
  // The first 5 positions at once (the prompt), then one at a time, in layer 1 only.
  cache.attend(1, q.narrow(3, 0, 5), k.narrow(2, 0, 5), v.narrow(2, 0, 5), at::zeros({1, 5}, at::kLong), 0.5, 0, {});
  at::Tensor last;
  for (int64_t t = 5; t < 13; ++t)
    last = cache.attend(1, q.narrow(3, t, 1), k.narrow(2, t, 1), v.narrow(2, t, 1), at::zeros({1, 1}, at::kLong),
                        0.5, 0, {});
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_EQ(cache.length(1), 13);
  EXPECT_FALSE(cache.holds(13));  // layer 0 holds nothing
  // 3 -> 6 -> 12 -> 24 positions of Hkv x D fp32 keys and values.
  EXPECT_EQ(cache.bytes(), 2 * 24 * Hkv * D * 4);
  expect_close(last, textbook_last_rows(q, k, v, 0.5, 0, 1).to(at::kFloat), 2e-6, "after growing", 1.0);
}

data::Batch tokens(const std::vector<int32_t>& ids, int64_t first_position) {
  data::Sample s;
  s.input_ids = ids;
  s.targets.assign(ids.size(), data::kIgnoreIndex);
  s.segment_ids.assign(ids.size(), 0);
  for (size_t i = 0; i < ids.size(); ++i) s.position_ids.push_back(static_cast<int32_t>(first_position + i));
  return data::collate({s}, 1, 0);
}

// The logits of positions prompt-1 .. T-1: one forward over the whole sequence, and the
// prompt's forward then one token at a time through a cache.
struct LogitsBothWays {
  at::Tensor whole, cached;
  int64_t cache_bytes = 0;
  bool filled = false;
};

LogitsBothWays logits_both_ways(models::CausalLM& model, const std::vector<int32_t>& ids, int64_t prompt) {
  at::NoGradGuard no_grad;
  const int64_t T = static_cast<int64_t>(ids.size());
  models::ForwardOptions whole;
  whole.return_logits = true;
  LogitsBothWays r;
  r.whole = model.forward(tokens(ids, 0), whole).logits[0].narrow(0, prompt - 1, T - prompt + 1);
  models::KVCache cache(static_cast<int>(model.num_layers()), 4);
  models::ForwardOptions step;
  step.kv_cache = &cache;
  step.last_logits_only = true;
  std::vector<at::Tensor> rows;
  rows.push_back(model.forward(tokens({ids.begin(), ids.begin() + prompt}, 0), step).logits[0][0]);
  for (int64_t t = prompt; t < T; ++t) {
    models::ForwardOutput o = model.forward(tokens({ids[t]}, t), step);
    EXPECT_EQ(o.logits.sizes(), (std::vector<int64_t>{1, 1, model.spec().vocab_size}));
    rows.push_back(o.logits[0][0]);
  }
  r.cached = at::stack(rows);
  r.cache_bytes = cache.bytes();
  r.filled = cache.holds(T);
  return r;
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t seed) {
  at::Tensor t = at::randint(vocab, {n}, at::detail::createCPUGenerator(seed), at::kInt);
  return std::vector<int32_t>(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + n);
}

// An NF4 base with LoRA adapters whose B is not zero, so the adapters take part.
std::unique_ptr<models::CausalLM> model_with_lora(const models::ModelSpec& spec, bool quantize) {
  auto model = models::init_random_model(spec, 5);
  if (quantize)
    for (models::Linear* l : model->linears()) l->quantize(64, true, QuantType::kNF4);
  models::LoraOptions o;
  o.r = 4;
  at::manual_seed(6);
  models::apply_lora(*model, o, {});
  at::NoGradGuard g;
  for (models::Linear* l : model->linears()) l->lora->B.normal_(0, 0.05);
  return model;
}

void expect_cached_equals_whole(models::CausalLM& model, const std::string& what, double tol = 2e-5) {
  const int64_t T = 29, prompt = 7;
  const auto ids = random_ids(T, model.spec().vocab_size, 21);
  LogitsBothWays r = logits_both_ways(model, ids, prompt);
  EXPECT_TRUE(r.filled) << what;
  // Capacity 4 doubled to 32 positions of every layer's keys and values.
  const auto& s = model.spec();
  const int64_t elem = c10::elementSize(model.compute_dtype());
  EXPECT_EQ(r.cache_bytes, s.num_layers * 2 * 32 * s.num_kv_heads * s.head_dim * elem) << what;
  expect_close(r.cached, r.whole, tol, what);
}

TEST(KVCache, LlamaTokenByTokenEqualsOneForwardOverTheSequence) {
  models::ModelSpec spec = *models::preset("tiny-llama");  // grouped-query heads
  auto dense = model_with_lora(spec, false);
  expect_cached_equals_whole(*dense, "tiny-llama, LoRA");
  auto nf4 = model_with_lora(spec, true);
  expect_cached_equals_whole(*nf4, "tiny-llama, NF4 + LoRA");
}

TEST(KVCache, SlidingWindowAndYarnTokenByTokenEqualOneForward) {
  models::ModelSpec spec = *models::preset("tiny-llama");
  spec.model_type = "mistral";
  spec.architecture = "MistralForCausalLM";
  spec.sliding_window = 6;  // the 29 positions reach past it
  spec.rope_scaling.type = "yarn";
  spec.rope_scaling.factor = 4.0;
  spec.rope_scaling.original_max_position_embeddings = 256;
  auto model = model_with_lora(spec, true);
  expect_cached_equals_whole(*model, "window 6, yarn");
}

TEST(KVCache, Qwen3AndGpt2TokenByTokenEqualOneForward) {
  auto qwen3 = model_with_lora(*models::preset("tiny-qwen3"), true);  // q_norm, k_norm; head_dim 64
  expect_cached_equals_whole(*qwen3, "tiny-qwen3");
  auto gpt2 = model_with_lora(*models::preset("tiny-gpt2"), false);  // learned positions
  expect_cached_equals_whole(*gpt2, "tiny-gpt2");
}

// Gemma 2: a new token's scores and the last logits soft-capped as the whole forward's (caps
// of 5 and 3, which bend them), its sliding layers' window reached (6 of 29 positions).
TEST(KVCache, Gemma2SoftcappedTokenByTokenEqualsOneForward) {
  models::ModelSpec spec = *models::preset("tiny-gemma2");
  spec.sliding_window = 6;
  auto model = model_with_lora(spec, true);
  expect_cached_equals_whole(*model, "tiny-gemma2");
}

// SDPA cannot cap the scores: a soft-capped model refuses it when it is chosen, before any
// forward (model.attn_implementation: sdpa), and takes auto and eager.
TEST(KVCache, Gemma2RefusesSdpaWhenItIsChosen) {
  auto model = models::init_random_model(*models::preset("tiny-gemma2"), 5);
  try {
    model->set_attention_kernel(models::AttentionOptions::Kernel::kSdpa);
    ADD_FAILURE() << "sdpa taken by a soft-capped model";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("sdpa cannot soft-cap attention scores, and Gemma2ForCausalLM's are capped "
                                         "(attn_logit_softcapping 5)"),
              std::string::npos)
        << e.what();
  }
  model->set_attention_kernel(models::AttentionOptions::Kernel::kEager);
  model->set_attention_kernel(models::AttentionOptions::Kernel::kAuto);
}

TEST(KVCache, Bf16ModelTokenByTokenEqualsOneForwardToBf16Rounding) {
  auto model = model_with_lora(*models::preset("tiny-llama"), false);
  model->set_dense_dtype(at::kBFloat16);
  model->set_compute_dtype(at::kBFloat16);
  expect_cached_equals_whole(*model, "bf16", 3e-2);
}

TEST(KVCache, AForwardThatRecordsGradientsRefusesTheCache) {
  auto model = model_with_lora(*models::preset("tiny-llama"), false);
  models::KVCache cache(static_cast<int>(model->num_layers()), 8);
  models::ForwardOptions o;
  o.kv_cache = &cache;
  EXPECT_THROW(model->forward(tokens({1, 2, 3}, 0), o), UserError);
  EXPECT_EQ(cache.length(0), 0);
}

// The layers of `inner`, each given the forward's context, or (`use_cache` false) a context
// without the cache, as a custom architecture that calls causal_segment_attention itself;
// the length of every forward's input is recorded.
class Wrapped : public models::CausalLM {
 public:
  Wrapped(models::CausalLM& inner, bool use_cache) : CausalLM(inner.spec()), inner_(inner), use_cache_(use_cache) {}
  at::Tensor embed(const at::Tensor& ids, const at::Tensor& positions) override {
    lengths.push_back(ids.size(1));
    return inner_.embed(ids, positions);
  }
  models::LayerContext layer_context(const data::Batch& b) override { return inner_.layer_context(b); }
  at::Tensor layer(int i, const at::Tensor& x, const models::LayerContext& ctx) override {
    models::LayerContext own = ctx;
    if (!use_cache_) own.kv_cache = nullptr;
    return inner_.layer(i, x, own);
  }
  at::Tensor final_norm(const at::Tensor& x) override { return inner_.final_norm(x); }
  const at::Tensor& head_weight() const override { return inner_.head_weight(); }

  std::vector<int64_t> lengths;

 private:
  models::CausalLM& inner_;
  bool use_cache_;
};

// Forward lengths of a prompt of `prompt` tokens and `n` new ones: each new token read alone
// (the cache), or the whole sequence every time.
std::vector<int64_t> forward_lengths(int64_t prompt, int64_t n, bool cached) {
  std::vector<int64_t> l;
  for (int64_t i = 0; i < n; ++i) l.push_back(i == 0 ? prompt : cached ? 1 : prompt + i);
  return l;
}

// Greedy tokens of two runs: equal, or apart only where the first run's top two logits were
// within rounding of each other (a tie the two ways of adding up may break differently).
void expect_same_greedy(models::CausalLM& model, const std::vector<int32_t>& prompt, const models::GenerateOptions& a,
                        const models::GenerateOptions& b, const std::string& what) {
  const auto x = models::generate(model, prompt, a), y = models::generate(model, prompt, b);
  ASSERT_EQ(x.size(), static_cast<size_t>(a.max_new_tokens)) << what;
  size_t same = 0;
  while (same < x.size() && same < y.size() && x[same] == y[same]) ++same;
  if (same == x.size() && x.size() == y.size()) return;
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), x.begin(), x.begin() + static_cast<int64_t>(same));
  at::NoGradGuard no_grad;
  models::ForwardOptions o;
  o.last_logits_only = true;
  at::Tensor top = std::get<0>(model.forward(tokens(seq, 0), o).logits[0][0].topk(2));
  EXPECT_LT((top[0] - top[1]).item<float>(), 1e-4f) << what << ": the tokens part at " << same;
}

// Greedy generation of `n` new tokens with the key/value cache, and the same without it.
std::pair<models::GenerateOptions, models::GenerateOptions> cached_and_uncached(int64_t n) {
  models::GenerateOptions cached, uncached;
  cached.max_new_tokens = uncached.max_new_tokens = n;
  uncached.use_cache = false;
  return {cached, uncached};
}

TEST(KVCache, GenerateWithTheCacheEqualsGenerateWithoutIt) {
  for (const char* name : {"tiny-llama", "tiny-gpt2", "tiny-qwen3"}) {
    auto model = model_with_lora(*models::preset(name), true);
    const auto [cached, uncached] = cached_and_uncached(40);
    expect_same_greedy(*model, random_ids(9, model->spec().vocab_size, 3), cached, uncached, name);
  }
}

TEST(KVCache, GenerateReadsOnePositionPerNewTokenUnlessTold) {
  auto inner = model_with_lora(*models::preset("tiny-llama"), false);
  Wrapped model(*inner, true);
  const auto [cached, uncached] = cached_and_uncached(12);
  const auto prompt = random_ids(6, model.spec().vocab_size, 4);
  models::generate(model, prompt, cached);
  EXPECT_EQ(model.lengths, forward_lengths(6, 12, true));
  model.lengths.clear();
  models::generate(model, prompt, uncached);
  EXPECT_EQ(model.lengths, forward_lengths(6, 12, false));
}

TEST(KVCache, LayersThatAttendWithoutTheCacheGenerateUncached) {
  auto inner = model_with_lora(*models::preset("tiny-llama"), false);
  Wrapped model(*inner, false);
  const auto [cached, uncached] = cached_and_uncached(30);
  const auto prompt = random_ids(6, model.spec().vocab_size, 4);
  // The same computation both ways: every forward runs the whole sequence.
  const auto with_cache = models::generate(model, prompt, cached);
  EXPECT_EQ(model.lengths, forward_lengths(6, 30, false));
  EXPECT_EQ(with_cache, models::generate(model, prompt, uncached));
  EXPECT_EQ(models::generate(model, prompt, uncached), models::generate(*inner, prompt, uncached));
}

}  // namespace
