#pragma once
// Architecture name -> builder. Hugging Face's `architectures[0]` (LlamaForCausalLM) or
// `model_type` (llama) selects the builder. A user adds an architecture from their own
// source file, without editing memtune (see examples/custom_model/):
//
//   static memtune::models::ArchitectureRegistrar reg("MyForCausalLM",
//       [](const memtune::models::ModelSpec& s) { return std::make_unique<MyModel>(s); });
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "models/causal_lm.h"

namespace memtune::models {

using ArchitectureBuilder = std::function<std::unique_ptr<CausalLM>(const ModelSpec&)>;

void register_architecture(const std::string& name, ArchitectureBuilder builder);
std::vector<std::string> registered_architectures();

// Builds the model's structure (no tensor memory yet) for spec.architecture (spec.model_type
// when the architecture is empty). Throws UserError listing the registered names when neither is known.
std::unique_ptr<CausalLM> build_model(const ModelSpec& spec);

struct ArchitectureRegistrar {
  ArchitectureRegistrar(const std::string& name, ArchitectureBuilder builder) {
    register_architecture(name, std::move(builder));
  }
};

// Built-in families (models/arch/), registered on first use of the registry.
std::unique_ptr<CausalLM> make_llama(const ModelSpec& spec);
std::unique_ptr<CausalLM> make_gpt2(const ModelSpec& spec);
std::unique_ptr<CausalLM> make_gemma(const ModelSpec& spec);

}  // namespace memtune::models
