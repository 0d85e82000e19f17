// config.json keys of the sliding window: read for Mistral, written back unchanged, and
// refused with a clear message where memtune does not implement them.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include <nlohmann/json.hpp>

#include "models/model_spec.h"
#include "runtime/error.h"

namespace {

using nlohmann::json;
using memtune::models::spec_from_hf_config;
using memtune::models::spec_to_hf_config;

json small(const std::string& model_type) {
  return {{"model_type", model_type}, {"vocab_size", 256}, {"hidden_size", 64}, {"intermediate_size", 96},
          {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
}

std::string error_of(const json& c) {
  try {
    spec_from_hf_config(c, "dir/config.json");
  } catch (const memtune::UserError& e) {
    return e.what();
  }
  return "";
}

TEST(ModelSpecSlidingWindow, MistralReadsItAndWritesItBack) {
  json c = small("mistral");
  c["sliding_window"] = 4096;
  auto s = spec_from_hf_config(c, "dir/config.json");
  ASSERT_TRUE(s.sliding_window.has_value());
  EXPECT_EQ(*s.sliding_window, 4096);
  EXPECT_EQ(spec_to_hf_config(s)["sliding_window"], 4096);

  c["sliding_window"] = nullptr;  // transformers' way of saying none
  EXPECT_FALSE(spec_from_hf_config(c, "dir/config.json").sliding_window.has_value());
}

TEST(ModelSpecSlidingWindow, Qwen2WithTheWindowOffTrainsWithFullAttention) {
  json c = small("qwen2");
  c["sliding_window"] = 32768;
  c["use_sliding_window"] = false;
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_FALSE(s.sliding_window.has_value());
  json back = spec_to_hf_config(s);
  EXPECT_EQ(back["sliding_window"], 32768);
  EXPECT_EQ(back["use_sliding_window"], false);
}

TEST(ModelSpecSlidingWindow, RefusesWhatItCannotHonour) {
  json c = small("mistral");
  c["sliding_window"] = 0;
  std::string e = error_of(c);
  EXPECT_NE(e.find("dir/config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("sliding_window 0 must be positive"), std::string::npos) << e;

  c = small("qwen2");
  c["use_sliding_window"] = true;
  e = error_of(c);
  EXPECT_NE(e.find("dir/config.json"), std::string::npos) << e;
  EXPECT_NE(e.find("use_sliding_window true"), std::string::npos) << e;
  EXPECT_NE(e.find("set it to false"), std::string::npos) << e;
}

// An integer key written as a float is read when it is a whole number in range; any other
// float or an unsigned number past int64 is refused by name (the fuzzer's head_dim of 8.9e56
// reached a float-to-integer conversion that cannot hold it).
TEST(ModelSpecNumbers, IntegerKeysTakeWholeNumbersOnly) {
  json c = small("llama");
  c["head_dim"] = 16.0;
  EXPECT_EQ(spec_from_hf_config(c, "dir/config.json").head_dim, 16);
  for (const json& bad : {json(8.88889e56), json(16.5), json(-1e300), json(std::numeric_limits<uint64_t>::max())}) {
    c["head_dim"] = bad;
    const std::string e = error_of(c);
    EXPECT_NE(e.find("dir/config.json"), std::string::npos) << bad.dump() << ": " << e;
    EXPECT_NE(e.find("'head_dim'"), std::string::npos) << bad.dump() << ": " << e;
  }
}

}  // namespace

namespace {

// yarn's defaults as transformers 5 reads them, kept when written back; mlp_bias is Llama's only.
TEST(ModelSpecRope, YarnDefaultsAndRoundTrip) {
  json c = small("llama");
  c["max_position_embeddings"] = 4096;
  c["rope_scaling"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 1024}};
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_EQ(s.rope_scaling.type, "yarn");
  EXPECT_DOUBLE_EQ(s.rope_scaling.factor, 4.0);  // max_position_embeddings / original
  EXPECT_DOUBLE_EQ(s.rope_scaling.beta_fast, 32);
  EXPECT_DOUBLE_EQ(s.rope_scaling.beta_slow, 1);
  EXPECT_TRUE(s.rope_scaling.truncate);
  c["rope_scaling"] = {{"type", "yarn"}, {"factor", 2.0}, {"mscale", 0.707}, {"mscale_all_dim", 1.0},
                       {"attention_factor", 1.5}, {"truncate", false}};
  s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_EQ(s.rope_scaling.original_max_position_embeddings, 4096);  // the model's own
  auto back = spec_from_hf_config(spec_to_hf_config(s), "written/config.json");
  EXPECT_DOUBLE_EQ(back.rope_scaling.factor, 2.0);
  EXPECT_DOUBLE_EQ(back.rope_scaling.mscale, 0.707);
  EXPECT_DOUBLE_EQ(back.rope_scaling.mscale_all_dim, 1.0);
  ASSERT_TRUE(back.rope_scaling.attention_factor.has_value());
  EXPECT_DOUBLE_EQ(*back.rope_scaling.attention_factor, 1.5);
  EXPECT_FALSE(back.rope_scaling.truncate);
  EXPECT_EQ(back.rope_scaling.original_max_position_embeddings, 4096);
}

TEST(ModelSpecRope, LongropeIsRefusedByName) {
  json c = small("llama");
  c["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 2.0}};
  std::string e = error_of(c);
  EXPECT_NE(e.find("'longrope'"), std::string::npos) << e;
}

// dynamic: read and written back; a factor under 1 is refused as transformers refuses it.
TEST(ModelSpecRope, DynamicIsReadAndKept) {
  json c = small("llama");
  c["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_EQ(s.rope_scaling.type, "dynamic");
  auto back = spec_from_hf_config(spec_to_hf_config(s), "written");
  EXPECT_EQ(back.rope_scaling.type, "dynamic");
  EXPECT_DOUBLE_EQ(back.rope_scaling.factor, 2.0);
  c["rope_scaling"]["factor"] = 0.5;
  EXPECT_NE(error_of(c).find("must be >= 1 for dynamic, got 0.5"), std::string::npos) << error_of(c);
}

TEST(ModelSpecBias, MlpBiasIsLlamasOnly) {
  json c = small("llama");
  c["mlp_bias"] = true;
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_TRUE(s.mlp_bias);
  EXPECT_EQ(spec_to_hf_config(s)["mlp_bias"], true);
  c = small("mistral");
  c["mlp_bias"] = true;  // MistralMLP has no biases whatever the config says
  s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_FALSE(s.mlp_bias);
  EXPECT_EQ(spec_to_hf_config(s)["mlp_bias"], true);  // kept as an unmodelled key
}

}  // namespace

namespace {

json small_gpt2() {
  return {{"model_type", "gpt2"}, {"vocab_size", 256}, {"n_embd", 64}, {"n_layer", 2}, {"n_head", 4},
          {"n_positions", 128}};
}

// Fields transformers reads that change the forward and that memtune does not implement are
// refused by name unless they hold their no-op value (they were read past before).
TEST(ModelSpecUnimplemented, MathChangingFieldsAreRefusedByName) {
  json c = small("llama");
  c["pad_token_id"] = 256;  // nn.Embedding(padding_idx) must index the vocabulary
  EXPECT_NE(error_of(c).find("pad_token_id 256 is outside the vocabulary (vocab_size 256)"), std::string::npos)
      << error_of(c);
  c["pad_token_id"] = -257;
  EXPECT_NE(error_of(c).find("pad_token_id -257 is outside"), std::string::npos) << error_of(c);
  c["pad_token_id"] = -1;  // counts from the end, as nn.Embedding takes it
  EXPECT_EQ(error_of(c), "");
  c.erase("pad_token_id");
  // attention_dropout is read (training applies it to the probabilities); a value nn.Dropout
  // could not take, or one that would drop everything, is refused.
  c["attention_dropout"] = 0.1;
  EXPECT_EQ(error_of(c), "");
  EXPECT_EQ(memtune::models::dropout_rates(spec_from_hf_config(c, "c")).attention, 0.1);
  c["attention_dropout"] = 1.5;
  EXPECT_NE(error_of(c).find("attention_dropout 1.5 is not a dropout probability"), std::string::npos) << error_of(c);
  c["attention_dropout"] = 1.0;  // nn.Dropout takes it (training refuses it: nothing would train)
  EXPECT_EQ(error_of(c), "");
  c["attention_dropout"] = "0.1";
  EXPECT_NE(error_of(c).find("attention_dropout \"0.1\" is not a dropout probability"), std::string::npos)
      << error_of(c);
  c.erase("attention_dropout");
  EXPECT_EQ(memtune::models::dropout_rates(spec_from_hf_config(c, "c")).attention, 0.0);
  c["partial_rotary_factor"] = 0.5;
  EXPECT_NE(error_of(c).find("partial_rotary_factor 0.5 (rotary on part of each head) is not supported"),
            std::string::npos)
      << error_of(c);
  c.erase("partial_rotary_factor");
  c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.25}};
  EXPECT_NE(error_of(c).find("partial_rotary_factor 0.25"), std::string::npos) << error_of(c);
  c["rope_parameters"]["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(error_of(c), "");

  json g = small_gpt2();
  EXPECT_EQ(error_of(g), "");
  g["scale_attn_weights"] = false;
  EXPECT_NE(error_of(g).find("scale_attn_weights false"), std::string::npos) << error_of(g);
  g["scale_attn_weights"] = true;
  g["scale_attn_by_inverse_layer_idx"] = true;
  EXPECT_NE(error_of(g).find("scale_attn_by_inverse_layer_idx true"), std::string::npos) << error_of(g);
}

// transformers' rope validation needs these keys; memtune used defaults where it raises.
TEST(ModelSpecRope, KeysTransformersRequiresAreRequired) {
  json c = small("llama");
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  EXPECT_NE(error_of(c).find("rope_scaling type 'llama3' needs 'low_freq_factor'"), std::string::npos) << error_of(c);
  c["rope_scaling"]["low_freq_factor"] = 1.0;
  EXPECT_EQ(error_of(c), "");
  c["rope_scaling"] = {{"type", "linear"}};
  EXPECT_NE(error_of(c).find("rope_scaling type 'linear' needs 'factor'"), std::string::npos) << error_of(c);
  c["rope_scaling"]["factor"] = 2.0;
  EXPECT_EQ(error_of(c), "");
}

// GPT-2's dropout rates are transformers' (0.1 when absent), memtune's own GPT-2 presets say
// 0.0, and a config written for a spec keeps what it read (absent stays absent: 0.1 for both).
TEST(ModelSpecDropout, Gpt2RatesAreTransformersAndRoundTrip) {
  json g = small_gpt2();
  const memtune::models::DropoutRates absent = memtune::models::dropout_rates(spec_from_hf_config(g, "c"));
  EXPECT_EQ(absent.residual, 0.1);
  EXPECT_EQ(absent.embedding, 0.1);
  EXPECT_EQ(absent.attention, 0.1);
  g["resid_pdrop"] = 0.0;
  g["embd_pdrop"] = 0.25;
  g["attn_pdrop"] = 0.2;
  const memtune::models::DropoutRates set = memtune::models::dropout_rates(spec_from_hf_config(g, "c"));
  EXPECT_EQ(set.residual, 0.0);
  EXPECT_EQ(set.embedding, 0.25);
  EXPECT_EQ(set.attention, 0.2);
  EXPECT_EQ(memtune::models::dropout_rates(spec_from_hf_config(small("llama"), "c")).attention, 0.0);
  g["resid_pdrop"] = -0.1;
  EXPECT_NE(error_of(g).find("resid_pdrop -0.1 is not a dropout probability"), std::string::npos) << error_of(g);

  const json written = spec_to_hf_config(spec_from_hf_config(small_gpt2(), "c"));
  for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) EXPECT_FALSE(written.contains(key)) << key;
  json kept = small_gpt2();
  kept["resid_pdrop"] = 0.05;
  EXPECT_EQ(spec_to_hf_config(spec_from_hf_config(kept, "c")).at("resid_pdrop"), 0.05);
  for (const char* name : {"tiny-gpt2", "gpt2"}) {
    const memtune::models::DropoutRates own = memtune::models::dropout_rates(*memtune::models::preset(name));
    EXPECT_EQ(own.residual + own.embedding + own.attention, 0.0) << name;
  }
}

}  // namespace

namespace {

// Qwen3 as transformers 5.12's Qwen3Config and Qwen3Attention read it: head_dim 128 when the
// file omits it (not hidden_size / heads), no biases unless attention_bias (then on o_proj too,
// unlike Qwen2's), 32768 positions, per-head q and k norms; and its windowed layers refused,
// whichever key names them.
TEST(ModelSpecQwen3, DefaultsAreQwen3Configs) {
  json c = small("qwen3");
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_EQ(s.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(s.head_dim, 128);
  EXPECT_EQ(s.q_dim(), 4 * 128);
  EXPECT_EQ(s.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(s.norm_eps, 1e-6);
  EXPECT_TRUE(s.qk_norm);
  EXPECT_FALSE(s.attention_bias);
  EXPECT_FALSE(s.o_proj_bias());
  c["attention_bias"] = true;
  EXPECT_TRUE(spec_from_hf_config(c, "dir/config.json").o_proj_bias());
  // The architecture alone names the family too.
  json by_arch = small("");
  by_arch.erase("model_type");
  by_arch["architectures"] = {"Qwen3ForCausalLM"};
  EXPECT_EQ(spec_from_hf_config(by_arch, "dir/config.json").model_type, "qwen3");
  // A null head_dim: transformers 5.12 refuses it for Qwen3 (Qwen3Config's head_dim is an
  // int: "Field 'head_dim' expected int, got NoneType"), and reads it as hidden_size / heads
  // for Llama.
  c["head_dim"] = nullptr;
  EXPECT_NE(error_of(c).find("dir/config.json: head_dim is null"), std::string::npos) << error_of(c);
  json llama_null = small("llama");
  llama_null["head_dim"] = nullptr;
  EXPECT_EQ(spec_from_hf_config(llama_null, "dir/config.json").head_dim, 16);
  // Round trip: what memtune writes reads back as the same shape.
  c["head_dim"] = 32;
  s = spec_from_hf_config(c, "dir/config.json");
  auto back = spec_from_hf_config(spec_to_hf_config(s), "dir/config.json");
  EXPECT_EQ(back.model_type, "qwen3");
  EXPECT_EQ(back.head_dim, 32);
  EXPECT_TRUE(back.qk_norm && back.o_proj_bias());
  // The other families keep no per-head norms, and Qwen2's biases stay off o_proj.
  EXPECT_FALSE(spec_from_hf_config(small("llama"), "dir/config.json").qk_norm);
  EXPECT_EQ(spec_from_hf_config(small("llama"), "dir/config.json").max_position_embeddings, 2048);
  EXPECT_EQ(spec_from_hf_config(small("mistral"), "dir/config.json").max_position_embeddings, 131072);
  auto qwen2 = spec_from_hf_config(small("qwen2"), "dir/config.json");
  EXPECT_TRUE(qwen2.attention_bias && !qwen2.o_proj_bias() && !qwen2.qk_norm);
  EXPECT_EQ(qwen2.head_dim, 16);
  // num_key_value_heads absent: each config class's default (Llama: the query heads').
  for (const auto& [type, heads, kv] : {std::tuple<const char*, int64_t, int64_t>{"llama", 16, 16},
                                        {"mistral", 16, 8}, {"qwen2", 64, 32}, {"qwen3", 64, 32}}) {
    json no_kv = small(type);
    no_kv.erase("num_key_value_heads");
    no_kv["hidden_size"] = 128;
    no_kv["num_attention_heads"] = heads;
    EXPECT_EQ(spec_from_hf_config(no_kv, "dir/config.json").num_kv_heads, kv) << type;
  }
}

TEST(ModelSpecQwen3, WindowedLayersAreRefusedByName) {
  json c = small("qwen3");
  c["use_sliding_window"] = true;
  std::string e = error_of(c);
  EXPECT_NE(e.find("use_sliding_window true"), std::string::npos) << e;
  for (const char* type : {"qwen3", "qwen2"}) {
    c = small(type);
    c["use_sliding_window"] = false;
    c["layer_types"] = {"full_attention", "sliding_attention"};
    e = error_of(c);
    EXPECT_NE(e.find("dir/config.json"), std::string::npos) << e;
    EXPECT_NE(e.find("layer_types[1] is sliding_attention"), std::string::npos) << e;
    c["layer_types"] = {"full_attention", "full_attention"};
    EXPECT_EQ(error_of(c), "") << type;
  }
}

// The presets' sizes against the published counts: Llama 3.2 1B and Llama 3 8B exactly (their
// safetensors' element counts), Qwen3 0.6B and 8B as their model cards round them (0.6B with
// 0.44B outside the embedding; 8.2B with 6.95B).
TEST(ModelSpecPresets, ParameterCountsArePublishedOnes) {
  using memtune::models::parameter_count;
  using memtune::models::preset;
  EXPECT_EQ(parameter_count(*preset("llama-3.2-1b")), 1235814400);
  EXPECT_EQ(parameter_count(*preset("llama-3-8b")), 8030261248);
  auto billions = [](int64_t n) { return static_cast<double>(n) / 1e9; };
  for (const auto& [name, total, inner] : {std::tuple<const char*, double, double>{"qwen3-0.6b", 0.6, 0.44},
                                           {"qwen3-8b", 8.2, 6.95}}) {
    const memtune::models::ModelSpec s = *preset(name);
    const int64_t embedding = s.vocab_size * s.hidden_size * (s.tie_word_embeddings ? 1 : 2);
    EXPECT_NEAR(billions(parameter_count(s)), total, 0.05) << name;
    EXPECT_NEAR(billions(parameter_count(s) - embedding), inner, 0.005) << name;
    EXPECT_TRUE(s.qk_norm) << name;
    EXPECT_EQ(s.head_dim, 128) << name;
  }
}

// Gemma's and Gemma 3's defaults are their config classes' (transformers 5.12's GemmaConfig
// and Gemma3TextConfig): what a config that leaves a key out means.
TEST(ModelSpecGemma, DefaultsAreTheConfigClasses) {
  json g3 = {{"model_type", "gemma3_text"}, {"vocab_size", 256}, {"hidden_size", 64}, {"intermediate_size", 96},
             {"num_hidden_layers", 7}, {"num_attention_heads", 8}};
  auto s = spec_from_hf_config(g3, "dir/config.json");
  EXPECT_EQ(s.architecture, "Gemma3ForCausalLM");
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.head_dim, 256);
  EXPECT_EQ(s.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(s.norm_eps, 1e-6);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_EQ(s.hidden_act, "gelu_pytorch_tanh");
  EXPECT_TRUE(s.gemma_norm && s.scale_embeddings && s.sandwich_norms && s.qk_norm);
  EXPECT_EQ(s.query_pre_attn_scalar.value_or(0), 256);
  EXPECT_EQ(s.sliding_window.value_or(0), 4096);
  // sliding_window_pattern 6: every sixth layer full.
  EXPECT_EQ(s.sliding_layers, (std::vector<bool>{true, true, true, true, true, false, true}));
  EXPECT_EQ(s.layer_window(5), 0);
  EXPECT_EQ(s.layer_window(6), 4096);
  EXPECT_DOUBLE_EQ(s.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(s.local_rope_theta, 1e4);
  EXPECT_EQ(s.pad_token_id.value_or(-1), 0);
  g3["sliding_window_pattern"] = 2;
  EXPECT_EQ(spec_from_hf_config(g3, "dir/config.json").sliding_layers,
            (std::vector<bool>{true, false, true, false, true, false, true}));
  g3["pad_token_id"] = nullptr;
  EXPECT_FALSE(spec_from_hf_config(g3, "dir/config.json").pad_token_id.has_value());

  json g = small("gemma");
  g.erase("num_key_value_heads");
  g["num_attention_heads"] = 16;
  s = spec_from_hf_config(g, "dir/config.json");
  EXPECT_EQ(s.architecture, "GemmaForCausalLM");
  EXPECT_EQ(s.num_kv_heads, 16);
  EXPECT_EQ(s.head_dim, 256);
  EXPECT_EQ(s.max_position_embeddings, 8192);
  EXPECT_TRUE(s.tie_word_embeddings && s.gemma_norm && s.scale_embeddings);
  EXPECT_FALSE(s.sandwich_norms || s.qk_norm || s.query_pre_attn_scalar || s.sliding_window);
  EXPECT_DOUBLE_EQ(s.rope_theta, 1e4);
  EXPECT_EQ(s.hidden_act, "gelu_pytorch_tanh");
  g["hidden_act"] = "gelu";  // the exact GELU, which transformers 5 computes for Google's Gemma 1 configs
  EXPECT_EQ(spec_from_hf_config(g, "dir/config.json").hidden_act, "gelu");
  // The architecture alone names the family.
  g.erase("model_type");
  g["architectures"] = {"Gemma3ForCausalLM"};
  EXPECT_EQ(spec_from_hf_config(g, "dir/config.json").model_type, "gemma3_text");
}

// transformers 5's nested rope_parameters and the older top-level keys read alike, and what
// memtune writes reads back as the same model.
TEST(ModelSpecGemma, RopeFormsAndRoundTrip) {
  json top = small("gemma3_text");
  top["rope_theta"] = 5e5;
  top["rope_local_base_freq"] = 2e4;
  top["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  top["layer_types"] = {"full_attention", "sliding_attention"};
  top["sliding_window"] = 512;
  top["query_pre_attn_scalar"] = 24;
  json nested = small("gemma3_text");
  nested["rope_parameters"] = {
      {"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 5e5}}},
      {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 2e4}}}};
  nested["layer_types"] = top["layer_types"];
  nested["sliding_window"] = 512;
  nested["query_pre_attn_scalar"] = 24;
  for (const json& c : {top, nested}) {
    const auto s = spec_from_hf_config(c, "dir/config.json");
    for (const auto& t : {s, spec_from_hf_config(spec_to_hf_config(s), "dir/config.json")}) {
      EXPECT_DOUBLE_EQ(t.rope_theta, 5e5);
      EXPECT_DOUBLE_EQ(t.local_rope_theta, 2e4);
      EXPECT_EQ(t.rope_scaling.type, "linear");
      EXPECT_DOUBLE_EQ(t.rope_scaling.factor, 8.0);
      EXPECT_EQ(t.sliding_layers, (std::vector<bool>{false, true}));
      EXPECT_EQ(t.sliding_window.value_or(0), 512);
      EXPECT_EQ(t.query_pre_attn_scalar.value_or(0), 24);
      EXPECT_EQ(t.head_dim, 256);
      EXPECT_EQ(t.hidden_act, "gelu_pytorch_tanh");
      EXPECT_EQ(t.pad_token_id.value_or(-1), 0);
    }
  }
  // A model without a padding index writes null, which reads back as none (absent is 0).
  json no_pad = small("gemma");
  no_pad["pad_token_id"] = nullptr;
  const json written = spec_to_hf_config(spec_from_hf_config(no_pad, "dir/config.json"));
  EXPECT_TRUE(written.contains("pad_token_id") && written["pad_token_id"].is_null());
  // An integer, as Gemma3TextConfig types it (transformers 5 refuses 24.0: "expected int, got float").
  EXPECT_TRUE(spec_to_hf_config(spec_from_hf_config(top, "dir/config.json"))["query_pre_attn_scalar"].is_number_integer());
  EXPECT_EQ(written["hidden_activation"], "gelu_pytorch_tanh");  // what transformers 4 read
}

// What transformers computes otherwise (soft-capping, bidirectional attention), cannot build,
// or reads differently by version is refused by name.
TEST(ModelSpecGemma, RefusesWhatItCannotHonour) {
  auto refused = [](json c, const char* key, const json& value, const char* says) {
    c[key] = value;
    const std::string e = error_of(c);
    EXPECT_NE(e.find("dir/config.json"), std::string::npos) << key << ": " << e;
    EXPECT_NE(e.find(says), std::string::npos) << key << ": " << e;
  };
  const json g3 = small("gemma3_text"), g = small("gemma");
  refused(g, "final_logit_softcapping", 30.0, "final_logit_softcapping 30.0 is set, but transformers' Gemma");
  refused(g, "attn_logit_softcapping", 50.0, "attn_logit_softcapping 50.0 is set");
  refused(g3, "attn_logit_softcapping", 20.0, "transformers' Gemma 3 does not apply it");
  refused(g3, "final_logit_softcapping", 0.0, "final_logit_softcapping 0.0 must be positive");
  refused(small("gemma2"), "final_logit_softcapping", -1.0, "final_logit_softcapping -1.0 must be positive");
  refused(small("gemma2"), "layer_types", {"sliding_attention", "chunked_attention"}, "Gemma 2's layers are");
  refused(g, "use_bidirectional_attention", true, "use_bidirectional_attention true");
  refused(g3, "model_type", "gemma3", "Gemma3ForConditionalGeneration");
  refused(g3, "hidden_activation", "silu", "hidden_activation 'silu' is not supported");
  refused(g, "hidden_activation", "gelu", "disagree");
  refused(g3, "layer_types", {"full_attention"}, "layer_types must be a list of num_hidden_layers (2)");
  refused(g3, "layer_types", {"full_attention", "chunked_attention"}, "layer_types[1] is \"chunked_attention\"");
  refused(g3, "num_attention_heads", 3, "not a multiple of num_attention_heads 3");
  // fuzz/regressions/hf_config-d32d2907cd0c: no heads at all divided by zero in that check.
  refused(small("gemma2"), "num_attention_heads", 0, "num_attention_heads");
  // And a layer count past any model's, which made a flag per layer before the sizes' check.
  refused(small("gemma2"), "num_hidden_layers", int64_t{100000000000}, "num_hidden_layers is 100000000000");
  refused(g3, "rope_scaling", {{"type", "linear"}, {"factor", 8.0}}, "transformers 5's Gemma 3 ignores");
  refused(g3, "rope_parameters", {{"rope_type", "linear"}, {"factor", 8.0}}, "keyed by layer type");
  refused(g3, "rope_parameters", {{"sliding_attention", {{"rope_type", "linear"}, {"factor", 2.0}}}},
          "sliding_attention has rope_type 'linear'");
  json windowless = g3;
  windowless["layer_types"] = {"sliding_attention", "full_attention"};
  refused(windowless, "sliding_window", nullptr, "sliding_window is null");
  windowless["layer_types"] = {"full_attention", "full_attention"};
  windowless["sliding_window"] = nullptr;
  EXPECT_EQ(error_of(windowless), "");
}

// Gemma 2's defaults are Gemma2Config's (transformers 5.12): alternating sliding (first) and
// full layers, one rotary embedding, the scores soft-capped at 50 and the logits at 30 unless
// the file says null; and what memtune writes reads back as the same model.
TEST(ModelSpecGemma2, DefaultsAreGemma2ConfigAndRoundTrip) {
  json c = {{"model_type", "gemma2"}, {"vocab_size", 256}, {"hidden_size", 64}, {"intermediate_size", 96},
            {"num_hidden_layers", 5}, {"num_attention_heads", 8}};
  auto s = spec_from_hf_config(c, "dir/config.json");
  EXPECT_EQ(s.architecture, "Gemma2ForCausalLM");
  EXPECT_EQ(s.num_kv_heads, 4);
  EXPECT_EQ(s.head_dim, 256);
  EXPECT_EQ(s.max_position_embeddings, 8192);
  EXPECT_DOUBLE_EQ(s.norm_eps, 1e-6);
  EXPECT_TRUE(s.tie_word_embeddings && s.gemma_norm && s.scale_embeddings && s.sandwich_norms);
  EXPECT_FALSE(s.qk_norm);
  EXPECT_EQ(s.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(s.query_pre_attn_scalar.value_or(0), 256);
  EXPECT_EQ(s.sliding_window.value_or(0), 4096);
  EXPECT_EQ(s.sliding_layers, (std::vector<bool>{true, false, true, false, true}));
  EXPECT_DOUBLE_EQ(s.rope_theta, 1e4);
  EXPECT_DOUBLE_EQ(s.attn_logit_softcapping.value_or(0), 50.0);
  EXPECT_DOUBLE_EQ(s.final_logit_softcapping.value_or(0), 30.0);
  EXPECT_EQ(s.pad_token_id.value_or(-1), 0);
  // Gemma2MLP reads hidden_activation (hidden_act is not Gemma2Config's).
  c["hidden_activation"] = "gelu";
  EXPECT_EQ(spec_from_hf_config(c, "dir/config.json").hidden_act, "gelu");
  c.erase("hidden_activation");
  c["attn_logit_softcapping"] = nullptr;
  c["final_logit_softcapping"] = 12.5;
  c["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
  c["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention", "full_attention", "full_attention"};
  c["sliding_window"] = 64;
  c["query_pre_attn_scalar"] = 144;
  c["sliding_window_pattern"] = 3;  // Gemma 3's key: Gemma 2 does not read it, and keeps it as it is
  s = spec_from_hf_config(c, "dir/config.json");
  const json written = spec_to_hf_config(s);
  EXPECT_TRUE(written["attn_logit_softcapping"].is_null());
  EXPECT_DOUBLE_EQ(written["final_logit_softcapping"].get<double>(), 12.5);
  EXPECT_FALSE(written.contains("rope_local_base_freq"));
  EXPECT_EQ(written["sliding_window_pattern"], 3);
  EXPECT_EQ(written["hidden_activation"], "gelu_pytorch_tanh");
  for (const auto& t : {s, spec_from_hf_config(written, "dir/config.json")}) {
    EXPECT_FALSE(t.attn_logit_softcapping.has_value());
    EXPECT_DOUBLE_EQ(t.final_logit_softcapping.value_or(0), 12.5);
    EXPECT_EQ(t.rope_scaling.type, "linear");
    EXPECT_EQ(t.sliding_layers, (std::vector<bool>{false, true, true, false, false}));
    EXPECT_EQ(t.layer_window(1), 64);
    EXPECT_EQ(t.layer_window(0), 0);
    EXPECT_EQ(t.query_pre_attn_scalar.value_or(0), 144);
  }
  // The architecture alone names the family; Gemma 3 caps its logits too (default none; its
  // attention cap is refused: transformers does not apply it).
  c.erase("model_type");
  c["architectures"] = {"Gemma2ForCausalLM"};
  EXPECT_EQ(spec_from_hf_config(c, "dir/config.json").model_type, "gemma2");
  json g3 = small("gemma3_text");
  EXPECT_FALSE(spec_from_hf_config(g3, "dir/config.json").final_logit_softcapping.has_value());
  g3["final_logit_softcapping"] = 20.0;
  g3["attn_logit_softcapping"] = nullptr;
  EXPECT_DOUBLE_EQ(spec_from_hf_config(g3, "dir/config.json").final_logit_softcapping.value_or(0), 20.0);
}

// Gemma 2 2B, 9B and 27B against their model cards' parameter counts (2,614,341,888,
// 9,241,705,984 and 27,227,128,320); 27B's attention scale is 144^-0.5.
TEST(ModelSpecPresets, Gemma2CountsAreTheModelCards) {
  using memtune::models::parameter_count;
  using memtune::models::preset;
  EXPECT_EQ(parameter_count(*preset("gemma-2-2b")), 2614341888);
  EXPECT_EQ(parameter_count(*preset("gemma-2-9b")), 9241705984);
  EXPECT_EQ(parameter_count(*preset("gemma-2-27b")), 27227128320);
  EXPECT_EQ(preset("gemma-2-9b")->sliding_layers.size(), 42u);
  EXPECT_EQ(preset("gemma-2-27b")->query_pre_attn_scalar.value_or(0), 144);
}

// Gemma 3 270M and 1B against their model cards: 270M as 170M of embedding and 100M of
// transformer blocks, 1B as 1.0B.
TEST(ModelSpecPresets, GemmaCountsAreTheModelCards) {
  using memtune::models::parameter_count;
  using memtune::models::preset;
  const auto small3 = *preset("gemma-3-270m"), one = *preset("gemma-3-1b");
  const int64_t embedding = small3.vocab_size * small3.hidden_size;
  EXPECT_NEAR(static_cast<double>(embedding) / 1e6, 170, 3);
  EXPECT_NEAR(static_cast<double>(parameter_count(small3) - embedding) / 1e6, 100, 1);
  EXPECT_NEAR(static_cast<double>(parameter_count(one)) / 1e9, 1.0, 0.005);
  EXPECT_EQ(one.sliding_layers.size(), 26u);
  EXPECT_FALSE(one.sliding_layers[5]);
  EXPECT_TRUE(one.sliding_layers[6]);
}

}  // namespace
