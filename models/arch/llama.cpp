// Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) with
// Hugging Face's semantics: RMSNorm in fp32, rotary embeddings in the rotate_half layout (with
// linear, llama3, yarn and, within max_position_embeddings, dynamic frequency scaling),
// grouped-query attention, SwiGLU MLP, optional attention and MLP biases, optionally tied
// embeddings, and Qwen3's RMSNorm over each head's query and key before the rotary embedding.
#include <algorithm>
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>

#include "data/batch.h"
#include "models/arch/gated_layer_memory.h"
#include "models/layers/attention.h"
#include "models/layers/norm_act.h"
#include "models/layers/rotary.h"
#include "models/registry.h"
#include "runtime/error.h"

namespace memtune::models {

namespace {

std::string layer_prefix(int i) { return "model.layers." + std::to_string(i) + "."; }

class LlamaModel : public CausalLM {
 public:
  explicit LlamaModel(const ModelSpec& spec)
      : CausalLM(spec), dropout_(dropout_rates(spec)), layers_(spec.num_layers) {
    const int64_t C = spec.hidden_size, F = spec.intermediate_size, q = spec.q_dim(), kv = spec.kv_dim();
    add_tensor("model.embed_tokens.weight", {spec.vocab_size, C}, TensorRole::kEmbedding, &embed_tokens_);
    for (int i = 0; i < spec.num_layers; ++i) {
      const std::string p = layer_prefix(i);
      Layer& L = layers_[i];
      L.attention_dropout_site = dropout_site(p + "self_attn.attention_dropout");
      add_tensor(p + "input_layernorm.weight", {C}, TensorRole::kNorm, &L.input_norm, i);
      auto lin = [&](const std::string& name, int64_t in, int64_t out, bool bias) {
        return &add_linear(std::make_unique<Linear>(p + name, in, out, bias), i);
      };
      L.q = lin("self_attn.q_proj", C, q, spec.attention_bias);
      L.k = lin("self_attn.k_proj", C, kv, spec.attention_bias);
      L.v = lin("self_attn.v_proj", C, kv, spec.attention_bias);
      // Llama's attention_bias covers o_proj too; Qwen2's biases are on q, k, v only.
      L.o = lin("self_attn.o_proj", q, C, spec.o_proj_bias());
      if (spec.qk_norm) {
        add_tensor(p + "self_attn.q_norm.weight", {spec.head_dim}, TensorRole::kNorm, &L.q_norm, i);
        add_tensor(p + "self_attn.k_norm.weight", {spec.head_dim}, TensorRole::kNorm, &L.k_norm, i);
      }
      add_tensor(p + "post_attention_layernorm.weight", {C}, TensorRole::kNorm, &L.post_norm, i);
      L.gate = lin("mlp.gate_proj", C, F, spec.mlp_bias);
      L.up = lin("mlp.up_proj", C, F, spec.mlp_bias);
      L.down = lin("mlp.down_proj", F, C, spec.mlp_bias);
    }
    add_tensor("model.norm.weight", {C}, TensorRole::kNorm, &norm_);
    if (!spec.tie_word_embeddings)
      add_tensor("lm_head.weight", {spec.vocab_size, C}, TensorRole::kHead, &lm_head_);
    inv_freq_ = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling);
    rope_scale_ = rope_attention_factor(spec.rope_scaling);
  }

  // transformers builds the embedding with padding_idx = pad_token_id: that row gets no gradient.
  at::Tensor embed(const at::Tensor& ids, const at::Tensor&) override {
    return at::embedding(embed_tokens_, ids, spec().padding_index());
  }

  LayerContext layer_context(const data::Batch& b) override {
    LayerContext ctx;
    std::tie(ctx.cos, ctx.sin) = rotary_tables(b.position_ids, inv_freq_, rope_scale_);
    if (spec_.rope_scaling.type == "dynamic") {
      const int64_t longest = b.position_ids.numel() ? b.position_ids.max().item<int64_t>() + 1 : 0;
      MEMTUNE_CHECK(longest <= spec_.max_position_embeddings, "rope_scaling dynamic: a sequence reaches ", longest,
                    " positions, past max_position_embeddings ", spec_.max_position_embeddings,
                    "; there transformers rescales the rotary base from the longest sequence of each forward and "
                    "keeps it for the forwards that follow, a state memtune does not reproduce. memtune supports "
                    "dynamic within max_position_embeddings (where it is the plain rotary embedding): keep "
                    "sequences (data.max_seq_length, prompt and new tokens) within ", spec_.max_position_embeddings);
    }
    ctx.position_ids = b.position_ids;
    ctx.segment_ids = b.segment_ids;
    return ctx;
  }

  at::Tensor layer(int i, const at::Tensor& x, const LayerContext& ctx) override {
    const Layer& L = layers_[i];
    const ModelSpec& s = spec_;
    const int64_t B = x.size(0), T = x.size(1), D = s.head_dim, Hkv = s.num_kv_heads,
                  G = s.num_heads / s.num_kv_heads;
    at::Tensor h = rms_norm(x, L.input_norm, s.norm_eps);
    at::Tensor q = L.q->forward(h, ctx.training).view({B, T, s.num_heads, D});
    at::Tensor k = L.k->forward(h, ctx.training).view({B, T, Hkv, D});
    at::Tensor v = L.v->forward(h, ctx.training).view({B, T, Hkv, D});
    if (s.qk_norm) {  // over each head's D values, as Qwen3Attention's q_norm and k_norm
      q = rms_norm(q, L.q_norm, s.norm_eps);
      k = rms_norm(k, L.k_norm, s.norm_eps);
    }
    q = apply_rotary(q, ctx.cos, ctx.sin);
    k = apply_rotary(k, ctx.cos, ctx.sin);
    // Query head j uses key/value head j / G (HF's repeat_kv).
    at::Tensor q5 = q.view({B, T, Hkv, G, D}).permute({0, 2, 3, 1, 4});  // (B,Hkv,G,T,D)
    // attention_dropout on the probabilities in training, as transformers' eager attention.
    at::Tensor a = layer_attention(
        ctx, i, q5, k.permute({0, 2, 1, 3}), v.permute({0, 2, 1, 3}), 1.0 / std::sqrt(static_cast<double>(D)),
        s.sliding_window.value_or(0),
        with_dropout(ctx.attention, ctx.training, dropout_.attention, L.attention_dropout_site, B, x.device()));
    a = a.permute({0, 3, 1, 2, 4}).reshape({B, T, s.q_dim()});
    at::Tensor y = x + L.o->forward(a, ctx.training);
    h = rms_norm(y, L.post_norm, s.norm_eps);
    at::Tensor m = swiglu(L.gate->forward(h, ctx.training), L.up->forward(h, ctx.training));
    return y + L.down->forward(m, ctx.training);
  }

  at::Tensor final_norm(const at::Tensor& x) override { return rms_norm(x, norm_, spec_.norm_eps); }

  bool applies_dropout() const override { return true; }

  std::vector<std::pair<std::string, int>> modules_without_tensors() const override {
    std::vector<std::pair<std::string, int>> m = {{"model.rotary_emb", -1}};
    for (int i = 0; i < spec_.num_layers; ++i) m.emplace_back(layer_prefix(i) + "mlp.act_fn", i);
    return m;
  }

  LayerMemory layer_memory(int i, const StepShape& s, const LayerPlan& plan) const override {
    const Layer& L = layers_[i];
    GatedLayerForm form;
    form.qk_norm = spec_.qk_norm;
    form.attention_dropout = dropout_.attention;
    return gated_layer_memory({L.q, L.k, L.v, L.o, L.gate, L.up, L.down}, form, spec_, s, plan);
  }

  StackMemory stack_memory(const StepShape& s) const override {
    // cos and sin (B,T,1,D) fp32; the final RMSNorm.
    return {2 * s.rows() * spec_.head_dim * 4, rms_norm_kept(s.rows(), spec_.hidden_size, s.act_bytes)};
  }

  const at::Tensor& head_weight() const override {
    return spec_.tie_word_embeddings ? embed_tokens_ : lm_head_;
  }

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    at::Tensor q_norm, k_norm;  // Qwen3's per-head norms (spec.qk_norm)
    Linear *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *gate = nullptr, *up = nullptr,
           *down = nullptr;
    uint64_t attention_dropout_site = 0;
  };
  DropoutRates dropout_;
  at::Tensor embed_tokens_, norm_, lm_head_, inv_freq_;
  double rope_scale_ = 1.0;  // cos/sin scale (yarn's attention factor)
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<CausalLM> make_llama(const ModelSpec& spec) { return std::make_unique<LlamaModel>(spec); }

}  // namespace memtune::models
