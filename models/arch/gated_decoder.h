#pragma once
// The decoder the Llama-shaped families share (models/arch/llama.cpp: Llama, Mistral, Qwen2,
// Qwen3; models/arch/gemma.cpp: Gemma, Gemma 2, Gemma 3): embeddings, then per layer an input
// norm, q, k, v and o (per-head q and k norms where spec.qk_norm), the norm after the attention
// (and Gemma 2's and 3's two around the MLP, spec.sandwich_norms), gate, up and down; a final
// norm and a head unless tied. Its tensors, declared once here in transformers' names and
// order, and what follows from them alone (the layers' memory, the head, the modules without
// tensors); each family computes its layer.
#include <string>
#include <utility>
#include <vector>

#include "models/causal_lm.h"
#include "models/model_spec.h"

namespace memtune::models {

class GatedDecoder : public CausalLM {
 public:
  // Biases as the spec says: q, k, v on attention_bias, o on o_proj_bias(), the MLP on mlp_bias.
  explicit GatedDecoder(const ModelSpec& spec);

  bool applies_dropout() const override { return true; }
  std::vector<std::pair<std::string, int>> modules_without_tensors() const override;
  LayerMemory layer_memory(int i, const StepShape& s, const LayerPlan& plan) const override;
  const at::Tensor& head_weight() const override { return spec_.tie_word_embeddings ? embed_tokens_ : lm_head_; }

 protected:
  struct Layer {
    at::Tensor input_norm, post_attention_norm;
    at::Tensor pre_mlp_norm, post_mlp_norm;  // Gemma 2's and 3's (spec.sandwich_norms)
    at::Tensor q_norm, k_norm;               // Qwen3's and Gemma 3's per-head norms (spec.qk_norm)
    Linear *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *gate = nullptr, *up = nullptr,
           *down = nullptr;
    uint64_t attention_dropout_site = 0;
  };
  static std::string layer_prefix(int i) { return "model.layers." + std::to_string(i) + "."; }

  DropoutRates dropout_;
  at::Tensor embed_tokens_, norm_, lm_head_;
  at::Tensor inv_freq_;      // the rotary embedding's frequencies (rope_theta, rope_scaling)
  double rope_scale_ = 1.0;  // its cos/sin scale (yarn's attention factor)
  std::vector<Layer> layers_;
};

}  // namespace memtune::models
