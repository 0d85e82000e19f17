// memtune generate: a prompt continued by a model (and adapter), greedy or sampled.
#include <iostream>

#include <CLI/CLI.hpp>

#include "data/tokenizer.h"
#include "models/generate.h"
#include "tools/commands.h"
#include "tools/model_files.h"

namespace memtune::cli {

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "continue a prompt with a model (and adapter)");
  struct A {
    std::string model, adapter, prompt, tokenizer, device = "cpu", dtype = "fp32";
    int64_t max_new_tokens = 64;
    bool greedy = false, no_cache = false;
    double temperature = 1.0, top_p = 1.0;
    uint64_t seed = 0;
  };
  auto a = std::make_shared<A>();
  cmd->add_option("--model", a->model, "model directory")->required();
  cmd->add_option("--adapter", a->adapter, "PEFT adapter directory");
  cmd->add_option("--tokenizer", a->tokenizer, "tokenizer (default: the model directory's)");
  cmd->add_option("--prompt", a->prompt, "text to continue")->required();
  cmd->add_option("--max-new-tokens", a->max_new_tokens)->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_flag("--greedy", a->greedy, "always the most likely token");
  cmd->add_option("--temperature", a->temperature)->capture_default_str();
  cmd->add_option("--top-p", a->top_p)->capture_default_str();
  cmd->add_option("--seed", a->seed)->capture_default_str();
  cmd->add_flag("--no-cache", a->no_cache,
                "run the whole sequence again for every new token instead of keeping each layer's keys and values "
                "(transformers' use_cache=False): slower, the same tokens up to rounding");
  cmd->add_option("--device", a->device, "cpu, cuda, cuda:N or auto")->capture_default_str();
  cmd->add_option("--dtype", a->dtype,
                  "fp32, bf16 or fp16 (GPUs): the dtype the model's weights are kept and its products run in, "
                  "as from_pretrained's dtype; adapters stay fp32")
      ->capture_default_str();
  cmd->callback([a] {
    auto model = load_for_inference(a->model, a->adapter, a->device, a->dtype);
    auto tok = data::Tokenizer::load(a->tokenizer.empty() ? a->model : a->tokenizer);
    check_tokenizer_fits(*tok, *model);
    models::GenerateOptions o;
    o.max_new_tokens = a->max_new_tokens;
    o.greedy = a->greedy;
    o.temperature = a->temperature;
    o.top_p = a->top_p;
    o.seed = a->seed;
    o.use_cache = !a->no_cache;
    o.eos_id = tok->eos_id;
    std::vector<int32_t> generated = models::generate(*model, tok->encode(a->prompt, true), o);
    std::cout << a->prompt << tok->decode(generated, true) << "\n";
  });
}

}  // namespace memtune::cli
