#include "models/registry.h"

#include <map>
#include <mutex>

#include "runtime/error.h"

namespace memtune::models {

namespace {

std::map<std::string, ArchitectureBuilder>& table() {
  static std::map<std::string, ArchitectureBuilder> t = [] {
    std::map<std::string, ArchitectureBuilder> m;
    for (const Family& f : builtin_families()) {
      const std::string type = f.model_type;
      const bool gemma = type == "gemma" || type == "gemma2" || type == "gemma3_text";
      const ArchitectureBuilder build = type == "gpt2" ? make_gpt2 : gemma ? make_gemma : make_llama;
      m[f.model_type] = build;
      m[f.architecture] = build;
    }
    return m;
  }();
  return t;
}

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

void register_architecture(const std::string& name, ArchitectureBuilder builder) {
  std::lock_guard<std::mutex> lock(table_mutex());
  table()[name] = std::move(builder);
}

std::vector<std::string> registered_architectures() {
  std::lock_guard<std::mutex> lock(table_mutex());
  std::vector<std::string> names;
  for (const auto& [name, _] : table()) names.push_back(name);
  return names;
}

std::unique_ptr<CausalLM> build_model(const ModelSpec& spec) {
  ArchitectureBuilder builder;
  {
    std::lock_guard<std::mutex> lock(table_mutex());
    // The architecture decides; model_type only when config.json names none (a checkpoint
    // of an unregistered architecture must not load into a look-alike family).
    auto it = spec.architecture.empty() ? table().find(spec.model_type) : table().find(spec.architecture);
    if (it != table().end()) builder = it->second;
  }
  if (!builder) {
    std::string names;
    for (const auto& n : registered_architectures()) names += (names.empty() ? "" : ", ") + n;
    fail("architecture '", spec.architecture, "' (model_type '", spec.model_type,
         "') is not registered; registered: ", names,
         ". Register your own with memtune::models::ArchitectureRegistrar (examples/custom_model/)");
  }
  return builder(spec);
}

}  // namespace memtune::models
