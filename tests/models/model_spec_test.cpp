// config.json keys of the sliding window: read for Mistral, written back unchanged, and
// refused with a clear message where memtune does not implement them.
#include <gtest/gtest.h>

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

}  // namespace
