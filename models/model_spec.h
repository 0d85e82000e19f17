#pragma once
// The shape of a model, as Hugging Face's config.json describes it, normalised across
// families (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, GPT-2). Presets are plain
// functions returning one.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace memtune::models {

struct RopeScaling {
  std::string type = "none";  // none|linear|llama3|yarn|dynamic (models/arch/llama.cpp: within max_position_embeddings only)
  double factor = 1.0;
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3, yarn (yarn's default: max_position_embeddings)
  double beta_fast = 32, beta_slow = 1;             // yarn: rotations bounding the interpolation ramp
  double mscale = 0, mscale_all_dim = 0;            // yarn: 0 = not set
  std::optional<double> attention_factor;           // yarn: cos/sin scale; unset: from factor and mscale
  bool truncate = true;                             // yarn: ramp bounds rounded to whole dimensions
};

struct ModelSpec {
  std::string architecture = "LlamaForCausalLM";  // HF `architectures[0]`
  std::string model_type = "llama";  // llama|mistral|qwen2|qwen3|gemma|gemma2|gemma3_text|gpt2|<registered>
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 172;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 4;
  int64_t head_dim = 16;                 // hidden_size / num_heads unless config says otherwise
  int64_t max_position_embeddings = 2048;
  double norm_eps = 1e-5;                // rms_norm_eps or layer_norm_epsilon
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;           // q,k,v biases, and o_proj's but in Qwen2 (o_proj_bias())
  bool mlp_bias = false;                 // gate/up/down biases (Llama's mlp_bias; Mistral/Qwen2/Qwen3 have none)
  // Qwen3's q_norm and k_norm: an RMSNorm over each head's query and key (weights of
  // head_dim), before the rotary embedding.
  bool qk_norm = false;
  // Mistral's sliding_window: a query sees its W latest keys (itself included); none: all.
  // Read from config.json but kept in `extra`, which writes it back unchanged.
  std::optional<int64_t> sliding_window;
  // The gated MLP's activation (hidden_act; Gemma 3's hidden_activation): silu (SwiGLU), or
  // Gemma's gelu_pytorch_tanh or gelu (GeGLU, tanh's approximation or the exact erf form).
  std::string hidden_act = "silu";
  // Gemma, Gemma 2 and Gemma 3. Their RMSNorm scales by (1 + weight), in fp32, rounded once to the
  // input's dtype (weights initialised to 0); the embeddings are multiplied by
  // sqrt(hidden_size), rounded to the embedding's dtype.
  bool gemma_norm = false;
  bool scale_embeddings = false;
  // Gemma 2's and Gemma 3's decoder layer: post_attention_layernorm normalises the attention's output
  // before the residual sum, and pre_feedforward_layernorm / post_feedforward_layernorm
  // wrap the MLP (four norms a layer, where Llama has two).
  bool sandwich_norms = false;
  // Gemma 2 and 3: attention scores scaled by query_pre_attn_scalar^-0.5 (unset: head_dim^-0.5);
  // an integer, as Gemma2Config and Gemma3TextConfig type it (transformers refuses 24.0).
  std::optional<int64_t> query_pre_attn_scalar;
  // Gemma 2's and Gemma 3's layer_types, a flag per layer: a sliding layer attends within
  // sliding_window (Gemma 3's also rotates by local_rope_theta, rope_local_base_freq, no
  // scaling); a full one attends to every earlier position (rotating by rope_theta with
  // rope_scaling). Empty: every layer alike (Mistral's window, when it has one, on all).
  std::vector<bool> sliding_layers;
  double local_rope_theta = 10000.0;
  // Gemma 2's tanh soft-capping (Gemma 3's configs may set the logits' too): attention scores s become
  // c tanh(s / c) with c = attn_logit_softcapping (models/layers/attention.h), the head's
  // logits likewise with final_logit_softcapping (models/layers/cross_entropy.h). Unset: none.
  std::optional<double> attn_logit_softcapping, final_logit_softcapping;
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
  std::string torch_dtype = "float32";   // dtype the checkpoint stores dense weights in
  // GPT-2's activation_function: gelu_new (transformers' NewGELUActivation, the tanh formula as
  // written) or gelu_pytorch_tanh (F.gelu's tanh approximation): one value in fp32, two
  // roundings of it in 16-bit dtypes.
  std::string activation = "gelu_new";
  nlohmann::json extra = nlohmann::json::object();  // keys of config.json memtune does not model

  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  bool is_gpt2() const { return model_type == "gpt2"; }
  bool is_gemma() const { return model_type == "gemma" || model_type == "gemma2" || model_type == "gemma3_text"; }
  // The embedding's padding_idx, as transformers builds it from pad_token_id (that row gets no
  // gradient); a negative id counts from the vocabulary's end, as nn.Embedding takes it (the
  // range is checked when config.json is read). -1: none.
  int64_t padding_index() const { return !pad_token_id ? -1 : *pad_token_id < 0 ? *pad_token_id + vocab_size : *pad_token_id; }
  // The window layer `i` attends within (0: none).
  int64_t layer_window(int i) const {
    if (!sliding_window) return 0;
    return sliding_layers.empty() || sliding_layers[static_cast<size_t>(i)] ? *sliding_window : 0;
  }
  // Qwen2's attention has biases on q, k and v only; the others' attention_bias covers o_proj too.
  bool o_proj_bias() const { return attention_bias && model_type != "qwen2"; }
};

// The families memtune builds in: their model_type and transformers' class.
struct Family {
  const char* model_type;
  const char* architecture;
};
const std::vector<Family>& builtin_families();
// The model_type of the built-in family `name` names (its model_type or its class); nullopt
// for any other name.
std::optional<std::string> builtin_family(const std::string& name);

// Reads a config.json object; `where` names the file in messages.
ModelSpec spec_from_hf_config(const nlohmann::json& config, const std::string& where);
// The config.json HF writes for this spec (round-trips through spec_from_hf_config).
nlohmann::json spec_to_hf_config(const ModelSpec& spec);
// Dropout in training, as transformers applies it (0 outside training, and wherever the
// config says 0). GPT-2: resid_pdrop after each block's two output projections, embd_pdrop
// on the embeddings, attn_pdrop on the attention probabilities, each 0.1 when absent (memtune's
// own GPT-2 presets say 0.0); the Llama family: attention_dropout on the probabilities, 0
// when absent.
struct DropoutRates {
  double residual = 0, embedding = 0, attention = 0;
};
DropoutRates dropout_rates(const ModelSpec& spec);
// Throws UserError when the shape is impossible (heads not dividing, ...).
void validate_spec(const ModelSpec& spec, const std::string& where);

// Presets: tiny-llama, tiny-gpt2, tiny-qwen3, tiny-gemma2, tiny-gemma3 (tests and the
// quickstart) and the real sizes users fine-tune: llama-3.2-1b, llama-3-8b, mistral-7b,
// qwen2-0.5b, qwen3-0.6b, qwen3-8b, gemma-2-2b, gemma-2-9b, gemma-2-27b, gemma-3-270m,
// gemma-3-1b, gpt2.
std::optional<ModelSpec> preset(const std::string& name);
std::vector<std::string> preset_names();

// Parameter count of the base model (embeddings, head when untied, every layer).
int64_t parameter_count(const ModelSpec& spec);

}  // namespace memtune::models
