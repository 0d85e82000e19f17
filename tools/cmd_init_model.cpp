// memtune init-model: a randomly initialised model in Hugging Face format, from a preset or
// any config.json.
#include <filesystem>
#include <iostream>
#include <optional>

#include <CLI/CLI.hpp>

#include "models/hf_model.h"
#include "models/registry.h"
#include "runtime/error.h"
#include "tools/commands.h"
#include "tools/model_files.h"

namespace memtune::cli {

namespace fs = std::filesystem;

void add_init_model_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("init-model", "write a randomly initialised model in Hugging Face format");
  struct A {
    std::string arch = "llama", preset = "tiny", config, out, tokenizer;
    uint64_t seed = 0;
  };
  auto a = std::make_shared<A>();
  auto* arch = cmd->add_option("--arch", a->arch,
                                "the family of the tiny preset (llama, gpt2, qwen3, gemma3_text), or a registered architecture "
                                "name to build from the preset's shape")
                   ->capture_default_str();
  auto* preset = cmd->add_option("--preset", a->preset, "tiny, or a preset name (tiny-llama, llama-3.2-1b, gpt2, ...)")
                     ->capture_default_str();
  auto* config = cmd->add_option("--config", a->config,
                                 "a Hugging Face config.json (or its directory) to build instead of a preset")
                     ->excludes(preset)
                     ->excludes(arch);
  cmd->add_option("--out", a->out, "output directory")->required();
  cmd->add_option("--seed", a->seed, "random seed")->capture_default_str();
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer directory or file to copy in");
  cmd->callback([a, config, arch] {
    std::optional<models::ModelSpec> spec;
    if (config->count() > 0) {
      spec = models::read_hf_config(a->config);
    } else {
      // A built-in family's semantics come from its model_type (Qwen3's per-head norms, Qwen2's
      // biases), so --arch picks a preset of that family rather than relabelling another's.
      const std::optional<std::string> family = models::builtin_family(a->arch);
      std::string name = a->preset;
      if (name == "tiny") {
        const std::string f = family.value_or("llama");
        MEMTUNE_CHECK(f == "llama" || f == "gpt2" || f == "qwen3" || f == "gemma2" || f == "gemma3_text", "--arch ",
                      a->arch, ": there is no tiny ", f,
                      " preset (tiny-llama, tiny-gpt2, tiny-qwen3, tiny-gemma2, tiny-gemma3); ",
                      f == "mistral" ? "name a mistral preset (mistral-7b) or "
                      : f == "qwen2" ? "name a qwen2 preset (qwen2-0.5b) or "
                                     : "",
                      "write its config.json and pass --config");
        name = f == "gemma3_text" ? "tiny-gemma3" : "tiny-" + f;
      }
      spec = models::preset(name);
      MEMTUNE_CHECK(spec.has_value(), "--preset '", a->preset, "' is not a preset");
      if (!family) {
        spec->architecture = a->arch;  // a registered architecture, built from the preset's shape
      } else {
        MEMTUNE_CHECK(arch->count() == 0 || spec->model_type == *family, "--arch ", a->arch, " with --preset '",
                      name, "', a ", spec->model_type, " model: a preset keeps its own family; drop --arch, or "
                      "write a ", *family, " config.json and pass --config");
      }
    }
    // Checked before anything is written, so a bad --tokenizer leaves no model behind.
    MEMTUNE_CHECK(a->tokenizer.empty() || fs::exists(a->tokenizer), "--tokenizer '", a->tokenizer,
                  "' does not exist (a tokenizer directory, tokenizer.json or tokenizer.model)");
    auto model = models::init_random_model(*spec, a->seed);
    models::save_hf_model(*model, a->out, {});
    if (!a->tokenizer.empty()) {
      fs::path t(a->tokenizer);
      if (fs::is_directory(t)) copy_tokenizer_files(t, a->out);
      else copy_file_or_fail(t, fs::path(a->out) / t.filename());
    }
    std::cout << "wrote " << a->out << ": " << spec->architecture << ", " << model->base_parameter_count()
              << " parameters, seed " << a->seed << "\n";
  });
}

}  // namespace memtune::cli
