#include "models/model_spec.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <type_traits>

#include "runtime/error.h"

namespace memtune::models {

namespace {

using nlohmann::json;

template <class T>
T get_or(const json& j, const char* key, T fallback, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // An integer key written as a float (2048.0) is read when it is a whole number in range;
    // any other float is refused here, before a conversion that could not hold it.
    if (it->is_number_float()) {
      const double v = it->get<double>();
      const double bound = std::ldexp(1.0, std::numeric_limits<T>::digits);  // 2^63 for int64_t
      MEMTUNE_CHECK(std::isfinite(v) && v == std::floor(v) && v >= -bound && v < bound, where, ": '", key,
                    "' must be a whole number, got ", it->dump());
      return static_cast<T>(v);
    }
    MEMTUNE_CHECK(!it->is_number_unsigned() || it->get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max()),
                  where, ": '", key, "' is out of range (", it->dump(), ")");
  }
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    fail(where, ": '", key, "' has the wrong type (value ", it->dump(), ")");
  }
}

int64_t require_int(const json& j, std::initializer_list<const char*> keys, const std::string& where) {
  for (const char* k : keys) {
    auto it = j.find(k);
    if (it != j.end() && it->is_number_integer()) return it->get<int64_t>();
  }
  std::string names;
  for (const char* k : keys) names += std::string(names.empty() ? "" : " or ") + k;
  fail(where, ": missing integer key ", names, " (is this a Hugging Face config.json?)");
}

// `max_position_embeddings`: yarn's defaults for original_max_position_embeddings and factor.
RopeScaling read_rope_scaling(const json& j, const std::string& where, int64_t max_position_embeddings) {
  RopeScaling r;
  if (j.is_null()) return r;
  MEMTUNE_CHECK(j.is_object(), where, ": rope_scaling must be an object, got ", j.dump());
  std::string type = j.contains("rope_type") ? j["rope_type"].get<std::string>()
                     : j.contains("type")     ? j["type"].get<std::string>()
                                              : "default";
  if (type == "default") return r;
  MEMTUNE_CHECK(type == "linear" || type == "llama3" || type == "yarn" || type == "dynamic", where,
                ": rope_scaling type '", type, "' is not supported (supported: linear, llama3, yarn, dynamic)");
  r.type = type;
  // transformers' rope validation requires these keys (a missing one is its KeyError).
  std::vector<const char*> required;
  if (type != "yarn") required.push_back("factor");
  if (type == "llama3")
    for (const char* k : {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) required.push_back(k);
  for (const char* k : required)
    MEMTUNE_CHECK(j.contains(k) && !j[k].is_null(), where, ": rope_scaling type '", type, "' needs '", k,
                  "' (transformers refuses the config without it)");
  r.low_freq_factor = get_or<double>(j, "low_freq_factor", 1.0, where);
  r.high_freq_factor = get_or<double>(j, "high_freq_factor", 4.0, where);
  const bool yarn = type == "yarn";
  r.original_max_position_embeddings =
      get_or<int64_t>(j, "original_max_position_embeddings", yarn ? max_position_embeddings : 8192, where);
  // transformers 5: yarn without a factor scales max_position_embeddings / original.
  const bool has_factor = j.contains("factor") && !j["factor"].is_null();
  r.factor = has_factor || !yarn ? get_or<double>(j, "factor", 1.0, where)
                                 : static_cast<double>(max_position_embeddings) /
                                       static_cast<double>(r.original_max_position_embeddings);
  if (yarn) {
    // transformers reads these with `or`: null or 0 falls back to the default.
    auto number = [&](const char* key, double fallback) {
      return j.contains(key) && !j[key].is_null() ? get_or<double>(j, key, fallback, where) : fallback;
    };
    r.beta_fast = number("beta_fast", 32);
    r.beta_slow = number("beta_slow", 1);
    if (r.beta_fast == 0) r.beta_fast = 32;
    if (r.beta_slow == 0) r.beta_slow = 1;
    r.mscale = number("mscale", 0);
    r.mscale_all_dim = number("mscale_all_dim", 0);
    if (j.contains("attention_factor") && !j["attention_factor"].is_null())
      r.attention_factor = get_or<double>(j, "attention_factor", 1.0, where);
    r.truncate = get_or<bool>(j, "truncate", true, where);
    MEMTUNE_CHECK(r.original_max_position_embeddings > 0, where,
                  ": rope_scaling.original_max_position_embeddings must be > 0, got ",
                  r.original_max_position_embeddings);
  }
  MEMTUNE_CHECK(r.factor > 0, where, ": rope_scaling.factor must be > 0, got ", r.factor);
  // transformers' own check for dynamic (_validate_dynamic_scaling_rope_parameters).
  MEMTUNE_CHECK(type != "dynamic" || r.factor >= 1, where, ": rope_scaling.factor must be >= 1 for dynamic, got ",
                r.factor);
  return r;
}

// Keys spec_from_hf_config consumes; everything else is kept in `extra` and written back.
const std::set<std::string>& modelled_keys() {
  static const std::set<std::string> keys = {
      "architectures", "model_type", "vocab_size", "hidden_size", "n_embd", "intermediate_size",
      "n_inner", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
      "num_key_value_heads", "head_dim", "max_position_embeddings", "n_positions",
      "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "rope_scaling", "rope_parameters",
      "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id",
      "torch_dtype", "hidden_act", "activation_function"};
  return keys;
}

// Whether `key` is one of the Gemma family `model_type`'s own keys, which spec_to_hf_config
// writes from the spec (other families keep them in `extra`: Mistral's sliding_window, Qwen's
// layer_types; Gemma 2 keeps Gemma 3's sliding_window_pattern and rope_local_base_freq there,
// which its transformers class does not read).
bool gemma_models_key(const std::string& model_type, const std::string& key) {
  static const std::set<std::string> keys = {"hidden_activation", "query_pre_attn_scalar", "sliding_window",
                                             "layer_types", "attn_logit_softcapping", "final_logit_softcapping"};
  if (keys.count(key)) return true;
  return model_type == "gemma3_text" && (key == "sliding_window_pattern" || key == "rope_local_base_freq");
}

// Gemma 2's and Gemma 3's layer_types (or, absent, every pattern-th layer full and the others
// sliding, as Gemma2Config (pattern 2) and Gemma3TextConfig (sliding_window_pattern, 6) fill
// it in): true for a sliding layer.
std::vector<bool> gemma_sliding_layers(const json& c, bool gemma2, int64_t layers, const std::string& where) {
  const char* family = gemma2 ? "Gemma 2" : "Gemma 3";
  // Before a flag per layer is made (validate_spec checks the sizes after this reader).
  constexpr int64_t kMaxLayers = int64_t{1} << 24;
  MEMTUNE_CHECK(layers > 0 && layers <= kMaxLayers, where, ": num_hidden_layers is ", layers,
                "; it must be positive and at most ", kMaxLayers, " (no real model comes close); is config.json damaged?");
  std::vector<bool> sliding;
  if (c.contains("layer_types") && !c["layer_types"].is_null()) {
    const json& types = c["layer_types"];
    MEMTUNE_CHECK(types.is_array() && static_cast<int64_t>(types.size()) == layers, where,
                  ": layer_types must be a list of num_hidden_layers (", layers, ") entries, got ", types.dump());
    for (size_t i = 0; i < types.size(); ++i) {
      MEMTUNE_CHECK(types[i] == "sliding_attention" || types[i] == "full_attention", where, ": layer_types[", i,
                    "] is ", types[i].dump(), "; ", family, "'s layers are sliding_attention or full_attention");
      sliding.push_back(types[i] == "sliding_attention");
    }
    return sliding;
  }
  const int64_t pattern = gemma2 ? 2 : get_or<int64_t>(c, "sliding_window_pattern", 6, where);
  MEMTUNE_CHECK(pattern > 0, where, ": sliding_window_pattern must be positive, got ", pattern);
  for (int64_t i = 0; i < layers; ++i) sliding.push_back((i + 1) % pattern != 0);
  return sliding;
}

// A soft-capping value (Gemma2Config's attn_logit_softcapping 50.0, final_logit_softcapping
// 30.0; Gemma3TextConfig's null): absent gives `absent`, null none, else a positive number.
std::optional<double> read_softcap(const json& c, const char* key, std::optional<double> absent,
                                   const std::string& where) {
  if (!c.contains(key)) return absent;
  if (c[key].is_null()) return std::nullopt;
  const double v = get_or<double>(c, key, 0.0, where);
  MEMTUNE_CHECK(v > 0, where, ": ", key, " ", c[key].dump(), " must be positive (null: no soft-capping)");
  return v;
}

// Gemma's, Gemma 2's and Gemma 3's keys past Llama's: the MLP's activation, the attention
// scale, the sliding layers (Gemma 3's rotary base is read_gemma3_rope's), soft-capping, and
// what memtune refuses (bidirectional attention).
void read_gemma(const json& c, ModelSpec& s, const std::string& where) {
  const bool gemma3 = s.model_type == "gemma3_text", gemma2 = s.model_type == "gemma2";
  const char* family = gemma2 ? "Gemma2Config" : "Gemma3TextConfig";
  s.gemma_norm = true;
  s.scale_embeddings = true;
  // transformers 5's GemmaMLP reads hidden_act, Gemma2MLP and Gemma3MLP hidden_activation
  // (transformers 4's GemmaMLP read hidden_activation): a Gemma config where the two disagree
  // is computed differently by the two versions.
  const std::string act_key = gemma3 || gemma2 ? "hidden_activation" : "hidden_act";
  s.hidden_act = get_or<std::string>(c, act_key.c_str(), "gelu_pytorch_tanh", where);
  MEMTUNE_CHECK(s.hidden_act == "gelu_pytorch_tanh" || s.hidden_act == "gelu", where, ": ", act_key, " '",
                s.hidden_act, "' is not supported (gelu_pytorch_tanh, gelu)");
  if (s.model_type == "gemma" && c.contains("hidden_activation") && !c["hidden_activation"].is_null())
    MEMTUNE_CHECK(c["hidden_activation"] == s.hidden_act, where, ": hidden_act '", s.hidden_act,
                  "' and hidden_activation ", c["hidden_activation"].dump(),
                  " disagree: transformers 5's Gemma computes hidden_act, transformers 4's hidden_activation, so "
                  "the model is not one model. Hint: set both to the activation the checkpoint was trained with "
                  "(gelu_pytorch_tanh for Google's Gemma checkpoints)");
  MEMTUNE_CHECK(!get_or<bool>(c, "use_bidirectional_attention", false, where), where,
                ": use_bidirectional_attention true (an encoder's attention, EmbeddingGemma's) is not supported; "
                "memtune trains causal language models");
  if (s.model_type == "gemma") {
    // GemmaConfig has no soft-capping and transformers' Gemma computes none: refused rather
    // than ignored, since the file asks for it.
    for (const char* key : {"final_logit_softcapping", "attn_logit_softcapping"})
      MEMTUNE_CHECK(!c.contains(key) || c[key].is_null(), where, ": ", key, " ", c[key].dump(),
                    " is set, but transformers' Gemma (model_type gemma) does not soft-cap: it is Gemma 2's "
                    "(model_type gemma2, Gemma2ForCausalLM). Hint: fix model_type, or drop the key");
    return;
  }
  // transformers 5's Gemma3Attention keeps attn_logit_softcapping but never passes it to its
  // attention: a Gemma 3 that sets it computes no cap there. Refused rather than ignored.
  MEMTUNE_CHECK(gemma2 || !c.contains("attn_logit_softcapping") || c["attn_logit_softcapping"].is_null(), where,
                ": attn_logit_softcapping ", c["attn_logit_softcapping"].dump(),
                " is set, but transformers' Gemma 3 does not apply it (its attention never receives it), so the "
                "model it computes has no cap there. Hint: set it to null (Google's Gemma 3 configs do)");
  const auto gemma2_default = [&](double v) { return gemma2 ? std::optional<double>(v) : std::nullopt; };
  s.attn_logit_softcapping = read_softcap(c, "attn_logit_softcapping", gemma2_default(50.0), where);
  s.final_logit_softcapping = read_softcap(c, "final_logit_softcapping", gemma2_default(30.0), where);
  // Gemma2Config's and Gemma3TextConfig's own check, though their heads have head_dim of their own
  // (no heads at all: validate's message, below).
  MEMTUNE_CHECK(s.num_heads <= 0 || s.hidden_size % s.num_heads == 0, where, ": hidden_size ", s.hidden_size,
                " is not a multiple of num_attention_heads ", s.num_heads, ", which transformers' ", family,
                " refuses");
  s.sandwich_norms = true;
  s.qk_norm = gemma3;
  s.query_pre_attn_scalar = get_or<int64_t>(c, "query_pre_attn_scalar", 256, where);
  MEMTUNE_CHECK(*s.query_pre_attn_scalar > 0, where, ": query_pre_attn_scalar must be positive, got ",
                *s.query_pre_attn_scalar);
  s.sliding_layers = gemma_sliding_layers(c, gemma2, s.num_layers, where);
  const bool any_sliding = std::find(s.sliding_layers.begin(), s.sliding_layers.end(), true) != s.sliding_layers.end();
  if (c.contains("sliding_window") && c["sliding_window"].is_null()) {
    MEMTUNE_CHECK(!any_sliding, where, ": sliding_window is null, but layer_types has sliding_attention layers, "
                  "whose mask transformers cannot build without a window. Hint: set sliding_window (Gemma 3's is 512, "
                  "Gemma 2's 4096)");
  } else {
    s.sliding_window = get_or<int64_t>(c, "sliding_window", 4096, where);
    MEMTUNE_CHECK(*s.sliding_window > 0, where, ": sliding_window ", *s.sliding_window, " must be positive");
  }
}

// Gemma 3's two rotary embeddings: full layers by rope_theta (Gemma3TextConfig's default
// 1e6) with rope_scaling, sliding layers by rope_local_base_freq (10000), unscaled. transformers
// 5 writes them as rope_parameters keyed by layer type.
void read_gemma3_rope(const json& c, ModelSpec& s, const std::string& where) {
  double theta = get_or<double>(c, "rope_theta", 1000000.0, where);
  double local_theta = get_or<double>(c, "rope_local_base_freq", 10000.0, where);
  json full = c.contains("rope_scaling") ? c["rope_scaling"] : json(nullptr), sliding = nullptr;
  // transformers 5 merges rope_scaling into the full layers' {"rope_type": "default"}, where an
  // old-style "type" does not override it: the scaling is dropped with a warning (transformers 4
  // applied it). Not one model, so refused.
  if (full.is_object() && full.contains("type") && !full.contains("rope_type"))
    fail(where, ": rope_scaling ", full.dump(), " names its type as \"type\", which transformers 5's Gemma 3 "
         "ignores (it keeps the plain rotary embedding) and transformers 4 applied. Hint: write \"rope_type\": ",
         full["type"].dump(), " to scale the full layers' rotary embedding, or drop rope_scaling");
  if (c.contains("rope_parameters") && !c["rope_parameters"].is_null()) {
    const json& rp = c["rope_parameters"];
    MEMTUNE_CHECK(rp.is_object() && (rp.contains("full_attention") || rp.contains("sliding_attention")), where,
                  ": Gemma 3's rope_parameters are keyed by layer type ({\"full_attention\": {...}, "
                  "\"sliding_attention\": {...}}), got ", rp.dump());
    for (auto it = rp.begin(); it != rp.end(); ++it)
      MEMTUNE_CHECK(it.key() == "full_attention" || it.key() == "sliding_attention", where, ": rope_parameters.",
                    it.key(), " is not a Gemma 3 layer type (full_attention, sliding_attention)");
    if (rp.contains("full_attention") && rp["full_attention"].is_object()) {
      full = rp["full_attention"];
      theta = get_or<double>(full, "rope_theta", theta, where);
    }
    if (rp.contains("sliding_attention") && rp["sliding_attention"].is_object()) {
      sliding = rp["sliding_attention"];
      local_theta = get_or<double>(sliding, "rope_theta", local_theta, where);
    }
  }
  s.rope_theta = theta;
  s.local_rope_theta = local_theta;
  MEMTUNE_CHECK(theta > 0 && local_theta > 0, where, ": rope theta must be positive (full ", theta, ", sliding ",
                local_theta, ")");
  s.rope_scaling = read_rope_scaling(full, where + " rope_parameters.full_attention", s.max_position_embeddings);
  const RopeScaling local = read_rope_scaling(sliding, where + " rope_parameters.sliding_attention",
                                              s.max_position_embeddings);
  MEMTUNE_CHECK(local.type == "none", where, ": rope_parameters.sliding_attention has rope_type '", local.type,
                "'; memtune rotates Gemma 3's sliding layers by the plain (default) rotary embedding, as its "
                "checkpoints do");
}

}  // namespace

const std::vector<Family>& builtin_families() {
  static const std::vector<Family> families = {{"llama", "LlamaForCausalLM"},
                                               {"mistral", "MistralForCausalLM"},
                                               {"qwen2", "Qwen2ForCausalLM"},
                                               {"qwen3", "Qwen3ForCausalLM"},
                                               {"gemma", "GemmaForCausalLM"},
                                               {"gemma2", "Gemma2ForCausalLM"},
                                               {"gemma3_text", "Gemma3ForCausalLM"},
                                               {"gpt2", "GPT2LMHeadModel"}};
  return families;
}

std::optional<std::string> builtin_family(const std::string& name) {
  for (const Family& f : builtin_families())
    if (name == f.model_type || name == f.architecture) return std::string(f.model_type);
  return std::nullopt;
}

ModelSpec spec_from_hf_config(const json& c, const std::string& where) {
  MEMTUNE_CHECK(c.is_object(), where, ": config.json must be a JSON object");
  ModelSpec s;
  s.architecture.clear();
  if (c.contains("architectures") && c["architectures"].is_array() && !c["architectures"].empty())
    s.architecture = c["architectures"][0].get<std::string>();
  s.model_type = get_or<std::string>(c, "model_type", "", where);
  if (s.model_type.empty()) {
    if (s.architecture.rfind("GPT2", 0) == 0) s.model_type = "gpt2";
    else if (s.architecture.rfind("Mistral", 0) == 0) s.model_type = "mistral";
    else if (s.architecture.rfind("Qwen2", 0) == 0) s.model_type = "qwen2";
    else if (s.architecture.rfind("Qwen3", 0) == 0) s.model_type = "qwen3";
    else if (s.architecture == "Gemma3ForCausalLM") s.model_type = "gemma3_text";
    else if (s.architecture == "GemmaForCausalLM") s.model_type = "gemma";
    else if (s.architecture == "Gemma2ForCausalLM") s.model_type = "gemma2";
    else s.model_type = "llama";
  }
  if (s.architecture.empty())
    for (const Family& f : builtin_families())
      if (s.model_type == f.model_type) s.architecture = f.architecture;
  s.vocab_size = require_int(c, {"vocab_size"}, where);
  s.hidden_size = require_int(c, {"hidden_size", "n_embd"}, where);
  s.num_layers = require_int(c, {"num_hidden_layers", "n_layer"}, where);
  s.num_heads = require_int(c, {"num_attention_heads", "n_head"}, where);
  // The multimodal Gemma 3 (Gemma3ForConditionalGeneration) nests its language model in text_config.
  MEMTUNE_CHECK(s.model_type != "gemma3", where,
                ": model_type gemma3 is Gemma 3's image-and-text model (Gemma3ForConditionalGeneration), which memtune "
                "does not load; memtune trains Gemma3ForCausalLM (model_type gemma3_text: gemma-3-270m, gemma-3-1b)");
  // Absent, MistralConfig says 8, Qwen2Config and Qwen3Config 32, GemmaConfig 16,
  // Gemma2Config and Gemma3TextConfig 4; the others, as many as the query heads.
  const int64_t kv_heads = s.model_type == "mistral"                                ? 8
                           : s.model_type == "qwen2" || s.model_type == "qwen3"     ? 32
                           : s.model_type == "gemma"                                ? 16
                           : s.model_type == "gemma2" || s.model_type == "gemma3_text" ? 4
                                                                                    : s.num_heads;
  s.num_kv_heads = get_or<int64_t>(c, "num_key_value_heads", kv_heads, where);
  // Qwen3Config's head_dim defaults to 128; the other families' to hidden_size / heads.
  const bool qwen3 = s.model_type == "qwen3";
  // Qwen3Config keeps a null head_dim as None, and transformers' Qwen3 attention then cannot
  // be built (it takes config.head_dim as it is); the other families read null as absent.
  MEMTUNE_CHECK(!(qwen3 && c.contains("head_dim") && c["head_dim"].is_null()), where,
                ": head_dim is null, which transformers' Qwen3 cannot build a model from (Qwen3Config keeps it as "
                "None). Hint: write the number: 128 is Qwen3Config's default, hidden_size / num_attention_heads is ",
                s.num_heads > 0 ? s.hidden_size / s.num_heads : 0);
  // GemmaConfig's, Gemma2Config's and Gemma3TextConfig's is 256.
  s.head_dim = get_or<int64_t>(c, "head_dim",
                               qwen3 ? 128 : s.is_gemma() ? 256 : s.num_heads > 0 ? s.hidden_size / s.num_heads : 0, where);
  if (s.is_gpt2()) {
    s.intermediate_size = get_or<int64_t>(c, "n_inner", 4 * s.hidden_size, where);
    s.max_position_embeddings = require_int(c, {"n_positions", "max_position_embeddings"}, where);
    s.norm_eps = get_or<double>(c, "layer_norm_epsilon", 1e-5, where);
    s.tie_word_embeddings = get_or<bool>(c, "tie_word_embeddings", true, where);
    s.activation = get_or<std::string>(c, "activation_function", "gelu_new", where);
    MEMTUNE_CHECK(s.activation == "gelu_new" || s.activation == "gelu_pytorch_tanh", where,
                  ": activation_function '", s.activation, "' is not supported (gelu_new, gelu_pytorch_tanh)");
    // Attention scores scaled otherwise than by 1/sqrt(head_dim): transformers' eager GPT-2
    // attention reads these, its SDPA path does not; memtune implements neither form.
    MEMTUNE_CHECK(get_or<bool>(c, "scale_attn_weights", true, where), where,
                  ": scale_attn_weights false (attention without 1/sqrt(head_dim)) is not supported");
    MEMTUNE_CHECK(!get_or<bool>(c, "scale_attn_by_inverse_layer_idx", false, where), where,
                  ": scale_attn_by_inverse_layer_idx true (scores divided by the layer's index + 1) is not "
                  "supported");
  } else {
    s.intermediate_size = require_int(c, {"intermediate_size"}, where);
    // Each family's config class default (LlamaConfig 2048, MistralConfig 4096 x 32, Qwen2Config
    // and Qwen3Config 32768, GemmaConfig and Gemma2Config 8192, Gemma3TextConfig 131072): it
    // bounds dynamic rope scaling and is yarn's original length.
    const int64_t max_positions = s.model_type == "mistral" || s.model_type == "gemma3_text" ? 131072
                                  : s.model_type == "qwen2" || qwen3                       ? 32768
                                  : s.model_type == "gemma" || s.model_type == "gemma2"    ? 8192
                                                                                           : 2048;
    s.max_position_embeddings = get_or<int64_t>(c, "max_position_embeddings", max_positions, where);
    s.norm_eps = get_or<double>(c, "rms_norm_eps", 1e-6, where);
    s.tie_word_embeddings = get_or<bool>(c, "tie_word_embeddings", s.is_gemma(), where);
    s.attention_bias = get_or<bool>(c, "attention_bias", s.model_type == "qwen2", where);
    // transformers reads mlp_bias in LlamaMLP only; Mistral's, Qwen2's and Qwen3's MLPs have no biases.
    if (s.model_type == "llama") s.mlp_bias = get_or<bool>(c, "mlp_bias", false, where);
    s.qk_norm = qwen3;
    if (s.model_type == "mistral" && c.contains("sliding_window") && !c["sliding_window"].is_null()) {
      s.sliding_window = get_or<int64_t>(c, "sliding_window", 0, where);
      MEMTUNE_CHECK(*s.sliding_window > 0, where, ": sliding_window ", *s.sliding_window,
                    " must be positive (or null for none)");
    }
    MEMTUNE_CHECK(!get_or<bool>(c, "use_sliding_window", false, where), where,
                  ": use_sliding_window true (Qwen2's and Qwen3's windowed layers) is not supported; set it to false "
                  "to train with full attention");
    // With use_sliding_window false transformers sets sliding_window to None, and a layer that
    // layer_types still names sliding then fails in its mask ("Could not find a sliding_window").
    if ((s.model_type == "qwen2" || qwen3) && c.contains("layer_types") && c["layer_types"].is_array())
      for (size_t i = 0; i < c["layer_types"].size(); ++i)
        MEMTUNE_CHECK(c["layer_types"][i] != "sliding_attention", where, ": layer_types[", i,
                      "] is sliding_attention, but use_sliding_window is false and transformers then has no "
                      "window for it; memtune trains Qwen models with full attention only: make every entry "
                      "full_attention (or drop layer_types)");
    if (s.is_gemma()) {
      read_gemma(c, s, where);
    } else {
      s.hidden_act = get_or<std::string>(c, "hidden_act", "silu", where);
      MEMTUNE_CHECK(s.hidden_act == "silu", where, ": hidden_act '", s.hidden_act, "' is not supported (silu)");
    }
    for (const json* holder : {&c, c.contains("rope_parameters") ? &c["rope_parameters"] : nullptr})
      if (holder != nullptr && holder->is_object())
        MEMTUNE_CHECK(get_or<double>(*holder, "partial_rotary_factor", 1.0, where) == 1.0, where,
                      ": partial_rotary_factor ", get_or<double>(*holder, "partial_rotary_factor", 1.0, where),
                      " (rotary on part of each head) is not supported");
    // Newer configs nest rope settings in rope_parameters; older ones keep them top level.
    if (s.model_type == "gemma3_text") {
      read_gemma3_rope(c, s, where);
    } else if (c.contains("rope_parameters") && c["rope_parameters"].is_object()) {
      const json& rp = c["rope_parameters"];
      s.rope_theta = get_or<double>(rp, "rope_theta", get_or<double>(c, "rope_theta", 10000.0, where), where);
      s.rope_scaling = read_rope_scaling(rp, where + " rope_parameters", s.max_position_embeddings);
    } else {
      s.rope_theta = get_or<double>(c, "rope_theta", 10000.0, where);
      if (c.contains("rope_scaling"))
        s.rope_scaling = read_rope_scaling(c["rope_scaling"], where + " rope_scaling", s.max_position_embeddings);
    }
  }
  auto opt_int = [&](const char* key) -> std::optional<int64_t> {
    auto it = c.find(key);
    if (it == c.end() || !it->is_number_integer()) return std::nullopt;
    return it->get<int64_t>();
  };
  s.bos_token_id = opt_int("bos_token_id");
  s.eos_token_id = opt_int("eos_token_id");
  s.pad_token_id = opt_int("pad_token_id");
  // GemmaConfig, Gemma2Config and Gemma3TextConfig default pad_token_id to 0 (the embedding's padding_idx,
  // whose row the lookup gives no gradient); null is none.
  if (s.is_gemma() && !c.contains("pad_token_id")) s.pad_token_id = 0;
  // The Llama family's embedding takes it as nn.Embedding's padding_idx, which must index the
  // vocabulary (a negative one counts from its end).
  if (!s.is_gpt2() && s.pad_token_id)
    MEMTUNE_CHECK(*s.pad_token_id >= -s.vocab_size && *s.pad_token_id < s.vocab_size, where, ": pad_token_id ",
                  *s.pad_token_id, " is outside the vocabulary (vocab_size ", s.vocab_size,
                  "); transformers' embedding refuses it as its padding index");
  s.torch_dtype = get_or<std::string>(c, "torch_dtype", "float32", where);
  for (auto it = c.begin(); it != c.end(); ++it)
    if ((!modelled_keys().count(it.key()) || (it.key() == "mlp_bias" && s.model_type != "llama")) &&
        !(s.is_gemma() && gemma_models_key(s.model_type, it.key())))
      s.extra[it.key()] = it.value();
  validate_spec(s, where);
  return s;
}

DropoutRates dropout_rates(const ModelSpec& s) {
  auto rate = [&](const char* key, double absent) {
    const auto it = s.extra.find(key);
    return it != s.extra.end() && it->is_number() ? it->get<double>() : absent;
  };
  DropoutRates r;
  if (s.is_gpt2()) {
    r.residual = rate("resid_pdrop", 0.1);
    r.embedding = rate("embd_pdrop", 0.1);
    r.attention = rate("attn_pdrop", 0.1);
  } else {
    r.attention = rate("attention_dropout", 0.0);
  }
  return r;
}

json spec_to_hf_config(const ModelSpec& s) {
  json c = s.extra;
  c["architectures"] = json::array({s.architecture});
  c["model_type"] = s.model_type;
  c["vocab_size"] = s.vocab_size;
  if (s.is_gpt2()) {
    c["n_embd"] = s.hidden_size;
    c["n_layer"] = s.num_layers;
    c["n_head"] = s.num_heads;
    c["n_inner"] = s.intermediate_size;
    c["n_positions"] = s.max_position_embeddings;
    c["layer_norm_epsilon"] = s.norm_eps;
    c["activation_function"] = s.activation;
  } else {
    c["hidden_size"] = s.hidden_size;
    c["intermediate_size"] = s.intermediate_size;
    c["num_hidden_layers"] = s.num_layers;
    c["num_attention_heads"] = s.num_heads;
    c["num_key_value_heads"] = s.num_kv_heads;
    c["head_dim"] = s.head_dim;
    c["max_position_embeddings"] = s.max_position_embeddings;
    c["rms_norm_eps"] = s.norm_eps;
    c["rope_theta"] = s.rope_theta;
    if (s.model_type == "gemma2" || s.model_type == "gemma3_text") {
      c["hidden_activation"] = s.hidden_act;
      c["query_pre_attn_scalar"] = s.query_pre_attn_scalar.value_or(s.head_dim);
      c["sliding_window"] = s.sliding_window ? json(*s.sliding_window) : json(nullptr);
      json types = json::array();
      for (int i = 0; i < s.num_layers; ++i) types.push_back(s.layer_window(i) > 0 ? "sliding_attention" : "full_attention");
      c["layer_types"] = types;
      if (s.model_type == "gemma3_text") c["rope_local_base_freq"] = s.local_rope_theta;
      auto cap = [](const std::optional<double>& v) { return v ? json(*v) : json(nullptr); };
      c["attn_logit_softcapping"] = cap(s.attn_logit_softcapping);
      c["final_logit_softcapping"] = cap(s.final_logit_softcapping);
    } else {
      c["hidden_act"] = s.hidden_act;
      // transformers 4's Gemma read hidden_activation, 5's hidden_act: both say the same.
      if (s.model_type == "gemma") c["hidden_activation"] = s.hidden_act;
    }
    c["attention_bias"] = s.attention_bias;
    if (s.model_type == "llama") c["mlp_bias"] = s.mlp_bias;
    if (s.rope_scaling.type == "none") {
      c["rope_scaling"] = nullptr;
    } else {
      json r = {{"rope_type", s.rope_scaling.type}, {"factor", s.rope_scaling.factor}};
      if (s.rope_scaling.type == "llama3") {
        r["low_freq_factor"] = s.rope_scaling.low_freq_factor;
        r["high_freq_factor"] = s.rope_scaling.high_freq_factor;
        r["original_max_position_embeddings"] = s.rope_scaling.original_max_position_embeddings;
      }
      if (s.rope_scaling.type == "yarn") {
        const RopeScaling& y = s.rope_scaling;
        r["original_max_position_embeddings"] = y.original_max_position_embeddings;
        r["beta_fast"] = y.beta_fast;
        r["beta_slow"] = y.beta_slow;
        if (y.mscale != 0) r["mscale"] = y.mscale;
        if (y.mscale_all_dim != 0) r["mscale_all_dim"] = y.mscale_all_dim;
        if (y.attention_factor) r["attention_factor"] = *y.attention_factor;
        r["truncate"] = y.truncate;
      }
      c["rope_scaling"] = r;
    }
  }
  c["tie_word_embeddings"] = s.tie_word_embeddings;
  if (s.bos_token_id) c["bos_token_id"] = *s.bos_token_id;
  if (s.eos_token_id) c["eos_token_id"] = *s.eos_token_id;
  if (s.pad_token_id) c["pad_token_id"] = *s.pad_token_id;
  else if (s.is_gemma()) c["pad_token_id"] = nullptr;  // absent, Gemma's configs say 0
  c["torch_dtype"] = s.torch_dtype;
  return c;
}

void validate_spec(const ModelSpec& s, const std::string& where) {
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"}) {
    const auto it = s.extra.find(key);
    if (it == s.extra.end() || it->is_null()) continue;
    MEMTUNE_CHECK(it->is_number() && it->get<double>() >= 0 && it->get<double>() <= 1, where, ": ", key, " ",
                  it->dump(), " is not a dropout probability; it must be a number in [0, 1], as nn.Dropout takes");
  }
  MEMTUNE_CHECK(s.vocab_size > 0 && s.hidden_size > 0 && s.num_layers > 0 && s.num_heads > 0 &&
                    s.intermediate_size > 0 && s.head_dim > 0,
                where, ": vocab_size, hidden_size, num_hidden_layers, num_attention_heads, "
                "intermediate_size and head_dim must be positive");
  MEMTUNE_CHECK(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, where,
                ": num_attention_heads (", s.num_heads, ") must be a multiple of num_key_value_heads (",
                s.num_kv_heads, ")");
  MEMTUNE_CHECK(s.head_dim % 2 == 0 || s.is_gpt2(), where, ": head_dim ", s.head_dim,
                " must be even for rotary embeddings");
  MEMTUNE_CHECK(s.sliding_layers.empty() || static_cast<int64_t>(s.sliding_layers.size()) == s.num_layers, where,
                ": layer_types has ", s.sliding_layers.size(), " entries for ", s.num_layers, " layers");
  for (const auto& [key, cap] : {std::pair{"attn_logit_softcapping", s.attn_logit_softcapping},
                                 std::pair{"final_logit_softcapping", s.final_logit_softcapping}})
    MEMTUNE_CHECK(!cap || *cap > 0, where, ": ", key, " ", cap.value_or(0), " must be positive (unset: none)");
  if (s.is_gpt2())
    MEMTUNE_CHECK(s.hidden_size == s.num_heads * s.head_dim, where, ": n_embd (", s.hidden_size,
                  ") must equal n_head x head_dim");
  // Sizes past any real model's are a damaged or mistyped file: refused here, by name,
  // rather than as a petabyte allocation once the tensors are made.
  const std::pair<const char*, int64_t> dims[] = {
      {"vocab_size", s.vocab_size},           {"hidden_size", s.hidden_size},
      {"intermediate_size", s.intermediate_size}, {"num_hidden_layers", s.num_layers},
      {"num_attention_heads", s.num_heads},   {"head_dim", s.head_dim}};
  constexpr int64_t kMaxDim = int64_t{1} << 24;  // 16.7M: ~64x the largest of each in published models
  for (const auto& [key, v] : dims)
    MEMTUNE_CHECK(v <= kMaxDim, where, ": ", key, " is ", v, ", more than ", kMaxDim,
                  " (no real model comes close); is config.json damaged?");
  const double embed = static_cast<double>(s.vocab_size) * static_cast<double>(s.hidden_size);
  const double attn = static_cast<double>(s.hidden_size) * static_cast<double>(s.head_dim) *
                      static_cast<double>(2 * s.num_heads + 2 * s.num_kv_heads);
  const double mlp = 3.0 * static_cast<double>(s.hidden_size) * static_cast<double>(s.intermediate_size);
  const double params = (s.tie_word_embeddings ? 1.0 : 2.0) * embed + static_cast<double>(s.num_layers) * (attn + mlp);
  constexpr double kMaxParams = 1e13;  // 10T: several times the largest published models
  MEMTUNE_CHECK(params <= kMaxParams, where, ": these sizes make a model of ", params, " parameters (",
                params * 2 / (1ull << 40), " TiB in bf16), past the 10T memtune accepts; is config.json damaged?");
}

namespace {

ModelSpec llama_like(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads,
                     int64_t kv, int64_t max_pos, double theta, bool tie) {
  ModelSpec s;
  s.vocab_size = vocab;
  s.hidden_size = hidden;
  s.intermediate_size = inter;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = kv;
  s.head_dim = hidden / heads;
  s.max_position_embeddings = max_pos;
  s.rope_theta = theta;
  s.tie_word_embeddings = tie;
  return s;
}

ModelSpec qwen3_like(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
                     int64_t head_dim, bool tie) {
  ModelSpec s = llama_like(vocab, hidden, inter, layers, heads, kv, 32768, 1000000.0, tie);
  s.architecture = "Qwen3ForCausalLM";
  s.model_type = "qwen3";
  s.head_dim = head_dim;
  s.norm_eps = 1e-6;
  s.qk_norm = true;
  return s;
}

// Gemma 2 (Gemma2ForCausalLM): heads of 256, alternating sliding (first) and full layers with
// a window of 4096 and one rotary embedding, the attention scores soft-capped at 50 and the
// logits at 30, Gemma's norms (four a layer) and scaled embeddings, GeGLU, tied head.
ModelSpec gemma2_like(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
                      int64_t head_dim) {
  ModelSpec s = llama_like(vocab, hidden, inter, layers, heads, kv, 8192, 10000.0, true);
  s.architecture = "Gemma2ForCausalLM";
  s.model_type = "gemma2";
  s.head_dim = head_dim;
  s.norm_eps = 1e-6;
  s.hidden_act = "gelu_pytorch_tanh";
  s.gemma_norm = s.scale_embeddings = s.sandwich_norms = true;
  s.query_pre_attn_scalar = head_dim;
  s.sliding_window = 4096;
  for (int64_t i = 0; i < layers; ++i) s.sliding_layers.push_back((i + 1) % 2 != 0);
  s.attn_logit_softcapping = 50.0;
  s.final_logit_softcapping = 30.0;
  return s;
}

// Gemma 3 (Gemma3ForCausalLM): Gemma 2's layer with per-head q and k norms and no
// soft-capping, every sixth layer full and the others within a window of 512 rotating by their
// own base (10000; the full ones by 1e6).
ModelSpec gemma3_like(int64_t vocab, int64_t hidden, int64_t inter, int64_t layers, int64_t heads, int64_t kv,
                      int64_t head_dim) {
  ModelSpec s = gemma2_like(vocab, hidden, inter, layers, heads, kv, head_dim);
  s.architecture = "Gemma3ForCausalLM";
  s.model_type = "gemma3_text";
  s.max_position_embeddings = 32768;
  s.rope_theta = 1000000.0;
  s.qk_norm = true;
  s.sliding_window = 512;
  s.sliding_layers.clear();
  for (int64_t i = 0; i < layers; ++i) s.sliding_layers.push_back((i + 1) % 6 != 0);
  s.local_rope_theta = 10000.0;
  s.attn_logit_softcapping.reset();
  s.final_logit_softcapping.reset();
  return s;
}

// GPT-2 family: 4x MLP, tied head, learned positions.
ModelSpec gpt2_like(int64_t vocab, int64_t hidden, int64_t layers, int64_t heads, int64_t max_pos) {
  ModelSpec s;
  s.architecture = "GPT2LMHeadModel";
  s.model_type = "gpt2";
  s.vocab_size = vocab;
  s.hidden_size = hidden;
  s.intermediate_size = 4 * hidden;
  s.num_layers = layers;
  s.num_heads = heads;
  s.num_kv_heads = heads;
  s.head_dim = hidden / heads;
  s.max_position_embeddings = max_pos;
  s.tie_word_embeddings = true;
  // memtune's own GPT-2 models train without dropout, as llm.c's (transformers' default is 0.1).
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) s.extra[key] = 0.0;
  return s;
}

}  // namespace

std::optional<ModelSpec> preset(const std::string& name) {
  if (name == "tiny-llama") {
    // GQA (2 kv heads for 4 heads) so the smallest model exercises every path.
    ModelSpec s = llama_like(1024, 128, 344, 4, 4, 2, 1024, 10000.0, false);
    s.bos_token_id = 1019;  // examples/tiny-tokenizer: <|begin_of_text|>
    s.eos_token_id = 1020;  // <|end_of_text|>
    return s;
  }
  if (name == "tiny-qwen3") {
    // Heads of 64 over a hidden of 128 (4 heads of 32 would fill it): q_proj widens, o_proj narrows.
    ModelSpec s = qwen3_like(1024, 128, 344, 4, 4, 2, 64, true);
    s.max_position_embeddings = 1024;
    s.bos_token_id = 1019;  // examples/tiny-tokenizer: <|begin_of_text|>
    s.eos_token_id = 1020;  // <|end_of_text|>
    return s;
  }
  if (name == "tiny-gemma3") {
    // Heads of 64 over a hidden of 128, a window of 32 on the first and third layers, and an
    // attention scale (48^-0.5) that is not head_dim's.
    ModelSpec s = gemma3_like(1024, 128, 344, 4, 4, 2, 64);
    s.max_position_embeddings = 1024;
    s.query_pre_attn_scalar = 48;
    s.sliding_window = 32;
    s.sliding_layers = {true, false, true, false};
    s.bos_token_id = 1019;  // examples/tiny-tokenizer: <|begin_of_text|>
    s.eos_token_id = 1020;  // <|end_of_text|>
    return s;
  }
  if (name == "tiny-gemma2") {
    // Heads of 64 over a hidden of 128, a window of 32 on the first and third layers, caps low
    // enough to bend a small model's scores and logits (transformers' 50 and 30 barely would).
    ModelSpec s = gemma2_like(1024, 128, 344, 4, 4, 2, 64);
    s.max_position_embeddings = 1024;
    s.query_pre_attn_scalar = 48;
    s.sliding_window = 32;
    s.attn_logit_softcapping = 5.0;
    s.final_logit_softcapping = 3.0;
    s.bos_token_id = 1019;  // examples/tiny-tokenizer: <|begin_of_text|>
    s.eos_token_id = 1020;  // <|end_of_text|>
    return s;
  }
  if (name == "tiny-gpt2") {
    ModelSpec s = gpt2_like(1024, 128, 4, 4, 1024);
    s.bos_token_id = 1019;  // examples/tiny-tokenizer: <|begin_of_text|>
    s.eos_token_id = 1020;  // <|end_of_text|>
    return s;
  }
  if (name == "llama-3.2-1b") {
    ModelSpec s = llama_like(128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, true);
    s.rope_scaling.type = "llama3";
    s.rope_scaling.factor = 32.0;
    s.rope_scaling.low_freq_factor = 1.0;
    s.rope_scaling.high_freq_factor = 4.0;
    s.rope_scaling.original_max_position_embeddings = 8192;
    s.bos_token_id = 128000;
    s.eos_token_id = 128001;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "llama-3-8b") {
    ModelSpec s = llama_like(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0, false);
    s.bos_token_id = 128000;
    s.eos_token_id = 128001;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "mistral-7b") {
    ModelSpec s = llama_like(32000, 4096, 14336, 32, 32, 8, 32768, 10000.0, false);
    s.architecture = "MistralForCausalLM";
    s.model_type = "mistral";
    s.bos_token_id = 1;
    s.eos_token_id = 2;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "qwen2-0.5b") {
    ModelSpec s = llama_like(151936, 896, 4864, 24, 14, 2, 32768, 1000000.0, true);
    s.architecture = "Qwen2ForCausalLM";
    s.model_type = "qwen2";
    s.head_dim = 64;
    s.norm_eps = 1e-6;
    s.attention_bias = true;
    s.eos_token_id = 151643;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "qwen3-0.6b" || name == "qwen3-8b") {
    // Qwen3-0.6B-Base and Qwen3-8B-Base: heads of 128 wider than hidden_size / heads, per-head
    // q and k norms.
    ModelSpec s = name == "qwen3-8b" ? qwen3_like(151936, 4096, 12288, 36, 32, 8, 128, false)
                                     : qwen3_like(151936, 1024, 3072, 28, 16, 8, 128, true);
    s.bos_token_id = 151643;
    s.eos_token_id = 151643;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "gemma-2-2b" || name == "gemma-2-9b" || name == "gemma-2-27b") {
    // google/gemma-2-2b, gemma-2-9b and gemma-2-27b (heads of 128, its scores scaled by
    // 144^-0.5: hidden_size / heads, not head_dim).
    ModelSpec s = name == "gemma-2-27b" ? gemma2_like(256000, 4608, 36864, 46, 32, 16, 128)
                  : name == "gemma-2-9b" ? gemma2_like(256000, 3584, 14336, 42, 16, 8, 256)
                                         : gemma2_like(256000, 2304, 9216, 26, 8, 4, 256);
    if (name == "gemma-2-27b") s.query_pre_attn_scalar = 144;
    s.bos_token_id = 2;
    s.eos_token_id = 1;
    s.pad_token_id = 0;
    s.torch_dtype = "float32";  // as Google ships them
    return s;
  }
  if (name == "gemma-3-270m" || name == "gemma-3-1b") {
    // google/gemma-3-270m and google/gemma-3-1b-pt.
    ModelSpec s = name == "gemma-3-1b" ? gemma3_like(262144, 1152, 6912, 26, 4, 1, 256)
                                       : gemma3_like(262144, 640, 2048, 18, 4, 1, 256);
    s.bos_token_id = 2;
    s.eos_token_id = 1;
    s.pad_token_id = 0;
    s.torch_dtype = "bfloat16";
    return s;
  }
  if (name == "gpt2") {
    ModelSpec s = gpt2_like(50257, 768, 12, 12, 1024);
    s.bos_token_id = 50256;
    s.eos_token_id = 50256;
    return s;
  }
  return std::nullopt;
}

std::vector<std::string> preset_names() {
  return {"tiny-llama", "tiny-gpt2",    "tiny-qwen3",   "tiny-gemma2", "tiny-gemma3",  "llama-3.2-1b",
          "llama-3-8b", "mistral-7b",   "qwen2-0.5b",   "qwen3-0.6b",  "qwen3-8b",     "gemma-2-2b",
          "gemma-2-9b", "gemma-2-27b",  "gemma-3-270m", "gemma-3-1b",  "gpt2"};
}

int64_t parameter_count(const ModelSpec& s) {
  const int64_t C = s.hidden_size, F = s.intermediate_size, V = s.vocab_size;
  int64_t per_layer = 0;
  if (s.is_gpt2()) {
    per_layer = 4 * C + (C * 3 * C + 3 * C) + (C * C + C) + (C * F + F) + (F * C + C);
    return V * C + s.max_position_embeddings * C + s.num_layers * per_layer + 2 * C +
           (s.tie_word_embeddings ? 0 : V * C);
  }
  const int64_t q = s.q_dim(), kv = s.kv_dim();
  per_layer = 2 * C + C * q + 2 * C * kv + q * C + 3 * C * F + (s.attention_bias ? q + 2 * kv : 0) +
              (s.o_proj_bias() ? C : 0) + (s.mlp_bias ? 2 * F + C : 0) + (s.qk_norm ? 2 * s.head_dim : 0) +
              (s.sandwich_norms ? 2 * C : 0);
  return V * C + s.num_layers * per_layer + C + (s.tie_word_embeddings ? 0 : V * C);
}

}  // namespace memtune::models
