#include "models/arch/gated_decoder.h"

#include "models/arch/gated_layer_memory.h"
#include "models/layers/rotary.h"

namespace memtune::models {

GatedDecoder::GatedDecoder(const ModelSpec& spec)
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
    add_tensor(p + "post_attention_layernorm.weight", {C}, TensorRole::kNorm, &L.post_attention_norm, i);
    if (spec.sandwich_norms) {
      add_tensor(p + "pre_feedforward_layernorm.weight", {C}, TensorRole::kNorm, &L.pre_mlp_norm, i);
      add_tensor(p + "post_feedforward_layernorm.weight", {C}, TensorRole::kNorm, &L.post_mlp_norm, i);
    }
    L.gate = lin("mlp.gate_proj", C, F, spec.mlp_bias);
    L.up = lin("mlp.up_proj", C, F, spec.mlp_bias);
    L.down = lin("mlp.down_proj", F, C, spec.mlp_bias);
  }
  add_tensor("model.norm.weight", {C}, TensorRole::kNorm, &norm_);
  if (!spec.tie_word_embeddings) add_tensor("lm_head.weight", {spec.vocab_size, C}, TensorRole::kHead, &lm_head_);
  inv_freq_ = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling);
  rope_scale_ = rope_attention_factor(spec.rope_scaling);
}

std::vector<std::pair<std::string, int>> GatedDecoder::modules_without_tensors() const {
  std::vector<std::pair<std::string, int>> m = {{"model.rotary_emb", -1}};
  for (int i = 0; i < spec_.num_layers; ++i) m.emplace_back(layer_prefix(i) + "mlp.act_fn", i);
  return m;
}

LayerMemory GatedDecoder::layer_memory(int i, const StepShape& s, const LayerPlan& plan) const {
  const Layer& L = layers_[i];
  GatedLayerForm form;
  form.qk_norm = spec_.qk_norm;
  form.sandwich_norms = spec_.sandwich_norms;
  form.geglu = spec_.hidden_act != "silu";  // Gemma's gelu_pytorch_tanh or gelu
  form.attention_dropout = dropout_.attention;
  return gated_layer_memory({L.q, L.k, L.v, L.o, L.gate, L.up, L.down}, form, spec_, s, plan);
}

}  // namespace memtune::models
