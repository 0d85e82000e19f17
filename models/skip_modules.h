#pragma once
// bitsandbytes' llm_int8_skip_modules: the modules a quantized model keeps dense, matched as
// transformers 5 matches them (quantizers_utils.should_convert_module). The key applies to
// 4-bit and 8-bit loading alike.
#include <optional>
#include <regex>
#include <string>
#include <vector>

namespace memtune::models {

class CausalLM;

// The list as BitsAndBytesConfig holds it. Unset (null) is transformers' default: the output
// layer and the modules tied to it, none of which memtune quantizes. A list replaces that
// default: transformers then quantizes lm_head unless the list names it.
using SkipModules = std::optional<std::vector<std::string>>;

// The name transformers gives the output layer of every causal LM memtune builds.
inline constexpr const char* kOutputModule = "lm_head";

class SkipMatcher {
 public:
  // A pattern std::regex cannot compile is a UserError naming `where` and the pattern.
  SkipMatcher(const SkipModules& skip, const std::string& where);

  // The first pattern that keeps `module` (a full module name) dense, or -1. A pattern
  // matches when it matches at the start of the name as a regex (Python's re.match, so
  // "model.layers.1" also covers "model.layers.10.mlp" and a bare "mlp" covers nothing), or
  // when the name ends with it ("down_proj").
  int match(const std::string& module) const;
  bool keeps_dense(const std::string& module) const { return match(module) >= 0; }

  const std::vector<std::string>& patterns() const { return patterns_; }

 private:
  std::vector<std::string> patterns_;
  std::vector<std::regex> regexes_;
};

// The list as errors quote it: ['lm_head', 'model.layers.1.mlp'].
std::string quoted_list(const std::vector<std::string>& patterns);

// Per model.tensors(): true for each projection weight that `skip` keeps dense.
std::vector<bool> dense_projections(const CausalLM& model, const SkipModules& skip, const std::string& where);

// A configured list, checked as train and estimate both refuse it: a UserError naming
// `where` when the list leaves the output layer to be quantized (transformers would quantize
// lm_head; memtune's output layer is always dense). Returns the patterns that keep no
// projection of `model` dense (a vision tower's name over a text model), for a note.
std::vector<std::string> check_skip_modules(const CausalLM& model, const std::vector<std::string>& patterns,
                                            const std::string& where);

}  // namespace memtune::models
